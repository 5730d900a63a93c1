"""quack.signing: Ed25519 key pairs, named Nix-style; trusted key sets; the
signing settings; `quack keygen`. Real keys and signatures (no fakes)."""

from __future__ import annotations

import os
import pickle
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from quack import settings, signing
from quack.errors import KeyFileError, QuackError, SignatureError
from quack_build.cli.app import app

runner = CliRunner()


@pytest.fixture
def keydir(tmp_path) -> Path:
    d = tmp_path / "keys"
    signing.write_keypair("ci-1", d)
    signing.write_keypair("ci-2", d)
    return d


def test_keypair_files_modes_and_format(keydir):
    key, pub = keydir / "ci-1.key", keydir / "ci-1.pub"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(pub.stat().st_mode) == 0o644
    name, _, b64 = pub.read_text().strip().partition(":")
    assert name == "ci-1" and len(b64) == 44  # 32 bytes, base64
    assert key.read_text().startswith("ci-1:")
    assert not list(keydir.glob(".*tmp"))  # no temp file left behind


def test_sign_verify_round_trip(keydir):
    sk = signing.load_signing_key(keydir / "ci-1.key")
    trusted = signing.load_trusted_keys(str(keydir / "ci-1.pub"))
    sig = sk.sign(b"object bytes")
    assert len(sig) == signing.SIGNATURE_BYTES
    trusted.verify("ci-1", b"object bytes", sig)  # no exception
    assert sk.public == signing.load_public_keys(keydir / "ci-1.pub")[0]
    assert "ci-1" in trusted and len(trusted) == 1


def test_bad_signature_and_untrusted_signer(keydir):
    sk1 = signing.load_signing_key(keydir / "ci-1.key")
    sk2 = signing.load_signing_key(keydir / "ci-2.key")
    trusted = signing.load_trusted_keys([keydir / "ci-1.pub"])
    sig = sk1.sign(b"data")
    with pytest.raises(SignatureError) as e:
        trusted.verify("ci-1", b"datA", sig)
    assert e.value.reason == "bad-signature" and e.value.signer == "ci-1"
    with pytest.raises(SignatureError) as e:
        trusted.verify("ci-2", b"data", sk2.sign(b"data"))
    assert e.value.reason == "untrusted" and "ci-1" in str(e.value)
    # A signature by ci-2 presented as ci-1's: the name proves nothing by itself.
    with pytest.raises(SignatureError) as e:
        trusted.verify("ci-1", b"data", sk2.sign(b"data"))
    assert e.value.reason == "bad-signature"
    with pytest.raises(SignatureError):
        trusted.verify("ci-1", b"data", sig[:-1])
    with pytest.raises(SignatureError) as e:
        signing.TrustedKeys().verify("ci-1", b"data", sig)
    assert "trusted: none" in str(e.value)


def test_errors_are_quack_errors_and_pickle(keydir):
    err = SignatureError("x", signer="ci-1", reason="untrusted")
    assert isinstance(err, QuackError) and isinstance(err, ValueError)
    back = pickle.loads(pickle.dumps(err))
    assert (back.signer, back.reason, str(back)) == ("ci-1", "untrusted", "x")
    kerr = KeyFileError("y", path="/p", reason="format")
    back = pickle.loads(pickle.dumps(kerr))
    assert (back.path, back.reason) == ("/p", "format")


def test_directory_and_colon_list(keydir, tmp_path):
    t = signing.load_trusted_keys(str(keydir))
    assert t.names == ("ci-1", "ci-2")
    other = tmp_path / "other"
    signing.write_keypair("dev-anna", other)
    t = signing.load_trusted_keys(f"{keydir / 'ci-1.pub'}:{other}")
    assert t.names == ("ci-1", "dev-anna")
    # Several keys in one file, with comments.
    multi = tmp_path / "team.pub"
    multi.write_text(
        "# the CI fleet\n" + (keydir / "ci-1.pub").read_text() + "\n" + (keydir / "ci-2.pub").read_text()
    )
    assert signing.load_trusted_keys(str(multi)).names == ("ci-1", "ci-2")


def test_private_key_is_never_trusted_and_public_never_signs(keydir):
    with pytest.raises(KeyFileError) as e:
        signing.load_trusted_keys(str(keydir / "ci-1.key"))
    assert e.value.reason == "private-as-public" and "PRIVATE" in str(e.value)
    with pytest.raises(KeyFileError) as e:
        signing.load_signing_key(keydir / "ci-1.pub")
    assert e.value.reason == "public-as-private"


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("no colon here", "NAME:BASE64"),
        ("ci-1:!!!notbase64", "not valid base64"),
        ("-bad:AAAA", "invalid key name"),
        ("ci-1:" + "QUFB", "bytes, an Ed25519 public key has 32"),
        ("", "no key in this file"),
    ],
)
def test_malformed_public_key_files(tmp_path, content, fragment):
    p = tmp_path / "k.pub"
    p.write_text(content)
    with pytest.raises(KeyFileError) as e:
        signing.load_trusted_keys(str(p))
    assert fragment in str(e.value) and str(p) in str(e.value)


def test_missing_paths_and_empty_directory(tmp_path):
    with pytest.raises(KeyFileError) as e:
        signing.load_trusted_keys(str(tmp_path / "nope.pub"))
    assert e.value.reason == "missing" and "quack keygen" in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(KeyFileError, match="no \\*.pub"):
        signing.load_trusted_keys(str(tmp_path / "empty"))
    with pytest.raises(KeyFileError):
        signing.load_signing_key(tmp_path / "nope.key")


def test_damaged_private_key_refused(keydir):
    import base64

    p = keydir / "ci-1.key"
    name, _, b64 = p.read_text().strip().partition(":")
    raw = bytearray(base64.b64decode(b64))
    raw[40] ^= 1  # flip a bit of the embedded public half
    p.write_text(f"{name}:{base64.b64encode(bytes(raw)).decode()}\n")
    with pytest.raises(KeyFileError, match="damaged"):
        signing.load_signing_key(p)


def test_duplicate_name_with_different_key_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    signing.write_keypair("ci-1", a)
    signing.write_keypair("ci-1", b)
    with pytest.raises(KeyFileError) as e:
        signing.load_trusted_keys(f"{a}:{b}")
    assert e.value.reason == "duplicate-name"
    # The same key listed twice is fine.
    assert signing.load_trusted_keys(f"{a}:{a / 'ci-1.pub'}").names == ("ci-1",)


def test_group_readable_signing_key_warns(keydir):
    p = keydir / "ci-1.key"
    os.chmod(p, 0o640)
    with pytest.warns(UserWarning, match="chmod 600"):
        signing.load_signing_key(p)
    os.chmod(p, 0o600)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        signing.load_signing_key(p)


def test_write_keypair_never_overwrites(keydir):
    before = (keydir / "ci-1.key").read_bytes()
    with pytest.raises(FileExistsError):
        signing.write_keypair("ci-1", keydir)
    assert (keydir / "ci-1.key").read_bytes() == before
    with pytest.raises(ValueError):
        signing.write_keypair("../evil", keydir)


def test_signing_key_repr_hides_secret(keydir):
    sk = signing.load_signing_key(keydir / "ci-1.key")
    secret = (keydir / "ci-1.key").read_text().split(":")[1].strip()
    assert secret not in repr(sk) and "ci-1" in repr(sk)


_LOAD_FROM_SETTINGS = r"""
import sys
from pathlib import Path
from quack import settings, signing
from quack.errors import KeyFileError
var, value, cwd = sys.argv[1:]
s = settings.resolve(env={var: value}, cwd=Path(cwd))
load = signing.trusted_keys_from_settings if var == "QUACK_TRUSTED_KEYS" else signing.signing_key_from_settings
try:
    load(s)
    print("loaded")
except KeyFileError as e:
    print(e.reason, "|", e)
"""


@pytest.mark.parametrize("var", ["QUACK_TRUSTED_KEYS", "QUACK_SIGNING_KEY"])
@pytest.mark.parametrize("how", ["fifo", "link-to-fifo"])
def test_a_fifo_as_a_key_file_is_refused_not_waited_on(tmp_path, var, how):
    """A blocking open() of a FIFO waits for a writer for ever: every build, pull, push
    and first kernel call hung. Run in a child under a time-out, so a regression fails."""
    fifo = tmp_path / "fifo.pub"
    os.mkfifo(fifo)
    named = fifo
    if how == "link-to-fifo":
        named = tmp_path / "link.pub"
        named.symlink_to(fifo)
    r = subprocess.run(
        [sys.executable, "-c", _LOAD_FROM_SETTINGS, var, str(named), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("format | "), r.stdout
    assert f"{named}: is a FIFO, not a key file" in r.stdout
    assert f"(set by {var})" in r.stdout


def test_a_device_as_a_key_file_is_refused_and_symlinked_keys_still_load(keydir, tmp_path):
    with pytest.raises(KeyFileError) as e:
        signing.load_trusted_keys("/dev/zero")
    assert "/dev/zero: is a character device, not a key file" in str(e.value)
    # Mounted secrets are usually symlinks: a link to a regular key file is followed.
    (tmp_path / "pub").symlink_to(keydir / "ci-1.pub")
    (tmp_path / "key").symlink_to(keydir / "ci-1.key")
    assert signing.load_trusted_keys(str(tmp_path / "pub")).names == ("ci-1",)
    assert signing.load_signing_key(tmp_path / "key").name == "ci-1"


def test_a_key_file_error_from_settings_names_the_setting(tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "quack.toml").write_text('[remote]\ntrusted_keys = ["nope.pub"]\n')
    s = settings.resolve(env={}, cwd=proj)
    with pytest.raises(KeyFileError) as e:
        signing.trusted_keys_from_settings(s)
    assert e.value.reason == "missing"
    assert f"(set by [remote] trusted_keys in {proj / 'quack.toml'})" in str(e.value)
    assert pickle.loads(pickle.dumps(e.value)).path == e.value.path


# --- settings ----------------------------------------------------------------------


def test_settings_from_environment(keydir, tmp_path):
    env = {
        "QUACK_SIGNING_KEY": str(keydir / "ci-1.key"),
        "QUACK_TRUSTED_KEYS": f"{keydir / 'ci-1.pub'}:{keydir / 'ci-2.pub'}",
    }
    s = settings.resolve(env=env, cwd=tmp_path)
    assert s.signing_key == str(keydir / "ci-1.key")
    assert s.trusted_keys == (str(keydir / "ci-1.pub"), str(keydir / "ci-2.pub"))
    assert s.sources["signing_key"] == "QUACK_SIGNING_KEY"
    assert signing.signing_key_from_settings(s).name == "ci-1"
    assert signing.trusted_keys_from_settings(s).names == ("ci-1", "ci-2")


def test_settings_defaults_trust_nothing(tmp_path):
    s = settings.resolve(env={}, cwd=tmp_path)
    assert s.signing_key is None and s.trusted_keys == ()
    assert signing.signing_key_from_settings(s) is None
    assert len(signing.trusted_keys_from_settings(s)) == 0


def test_settings_from_quack_toml_relative_to_it(keydir, tmp_path):
    proj = tmp_path / "proj"
    (proj / "sub").mkdir(parents=True)
    (proj / "quack.toml").write_text(
        f'[remote]\nsigning_key = "{os.path.relpath(keydir / "ci-1.key", proj)}"\n'
        f'trusted_keys = ["{os.path.relpath(keydir, proj)}"]\n'
    )
    s = settings.resolve(env={}, cwd=proj / "sub")
    assert Path(s.signing_key).resolve() == (keydir / "ci-1.key").resolve()
    assert signing.trusted_keys_from_settings(s).names == ("ci-1", "ci-2")
    # A ':'-separated string works in quack.toml too.
    (proj / "quack.toml").write_text(
        f'[remote]\ntrusted_keys = "{keydir / "ci-1.pub"}:{keydir / "ci-2.pub"}"\n'
    )
    assert len(settings.resolve(env={}, cwd=proj).trusted_keys) == 2
    # The environment wins over quack.toml.
    s = settings.resolve(env={"QUACK_TRUSTED_KEYS": str(keydir / "ci-2.pub")}, cwd=proj)
    assert s.trusted_keys == (str(keydir / "ci-2.pub"),)


def test_settings_bad_type_names_file_and_key(tmp_path):
    (tmp_path / "quack.toml").write_text("[remote]\nsigning_key = 3\n")
    with pytest.raises(settings.SettingsError) as e:
        settings.resolve(env={}, cwd=tmp_path)
    assert "remote.signing_key" in str(e.value) and "quack.toml" in str(e.value)


# --- CLI ---------------------------------------------------------------------------


def test_cli_keygen(tmp_path):
    r = runner.invoke(app, ["keygen", "ci-7", "-o", str(tmp_path / "k")])
    assert r.exit_code == 0, r.output
    pub = (tmp_path / "k" / "ci-7.pub").read_text().strip()
    assert pub in r.output
    assert stat.S_IMODE((tmp_path / "k" / "ci-7.key").stat().st_mode) == 0o600
    r = runner.invoke(app, ["keygen", "ci-7", "-o", str(tmp_path / "k")])
    assert r.exit_code == 1 and "already exists" in r.output
    r = runner.invoke(app, ["keygen", "bad/name", "-o", str(tmp_path / "k")])
    assert r.exit_code == 2 and "invalid key name" in r.output


def test_cli_keygen_console_script_in_cwd(tmp_path):
    """The installed console script, in a real process, default directory '.'."""
    r = subprocess.run(
        [sys.executable, "-m", "quack_build", "keygen", "ops"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    sk = signing.load_signing_key(tmp_path / "ops.key")
    signing.load_trusted_keys(str(tmp_path / "ops.pub")).verify("ops", b"m", sk.sign(b"m"))
