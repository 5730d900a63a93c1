"""The cache directory tools on a cache they can't use: the cache directory under a file
or without permission (an `error:` line naming the setting that chose it, exit 1, no
traceback), a read-only cache (`clean` says so instead of "in use by other processes"),
`--cache-dir ''` (refused, not the current directory), and `prewarm --emit-manifest` to
a path it can't write. Real CLI subprocesses on synthetic caches (no compiles)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import toykernels  # noqa: F401
from reliability_support import QUACK, can_mount, env
from typer.testing import CliRunner

from quack import registry, settings
from quack.cache import fsutil, journal, keys, orphans
from quack_build.cli.app import app

runner = CliRunner()
# As root, permission bits are bypassed (CAP_DAC_OVERRIDE): drop it for the child.
NO_DAC = [
    "setpriv",
    "--inh-caps=-dac_override,-dac_read_search",
    "--bounding-set=-dac_override,-dac_read_search",
]
needs_perm_checks = pytest.mark.skipif(
    os.geteuid() == 0 and shutil.which("setpriv") is None, reason="root without setpriv: no EACCES"
)


def _entry(d: Path, key: str) -> None:
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    data = os.urandom(1000)
    (d / f"{key}.o").write_bytes(data)
    meta = {"format": 1, "key": key, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (d / f"{key}.json").write_text(json.dumps(meta))
    (d / f"{key}.lock").write_bytes(b"")
    t = time.time() - 3 * 86400
    for f in d.glob(f"{key}*"):
        os.utime(f, (t, t))


@pytest.fixture
def proj(tmp_path):
    """A project of the toy kernels and a cache with two current entries of toy_scale."""
    d = tmp_path / "proj"
    d.mkdir()
    (d / "quack.toml").write_text(
        '[runtime]\narch = "sm_90a"\n[build]\nkernel_packages = ["toykernels"]\nmanifests = ["toy.toml"]\n'
    )
    (d / "toy.toml").write_text('[[kernel]]\nname = "toy_scale"\nparams = { dtype = ["float32"] }\n')
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    fp = registry.get("toy_scale").source_fingerprint()
    fpdir = root / "v1" / keys.toolchain_stamp("sm_90a") / "toy_scale" / fp
    for i in range(2):
        _entry(fpdir, hashlib.sha256(str(i).encode()).hexdigest())
    saved = settings.installed()
    yield {"dir": d, "root": root, "fpdir": fpdir, "tmp": tmp_path}
    settings.set_current(saved)


def _q(args, cwd: Path, *, no_dac: bool = False, **envextra) -> subprocess.CompletedProcess:
    """``quack ARGS`` in a subprocess (without CAP_DAC_OVERRIDE if asked), bounded."""
    pre = NO_DAC if no_dac and os.geteuid() == 0 else []
    r = subprocess.run(
        [*pre, *QUACK, *map(str, args)],
        cwd=str(cwd),
        env=env(**envextra),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    return r


def _files(root: Path) -> list[str]:
    """The entries' files (a command may add the source-fingerprint memo, srcfp/)."""
    return sorted(str(p) for p in (root / "v1").rglob("*"))


COMMANDS = [
    ["cache", "stats"],
    ["cache", "stats", "--json"],
    ["cache", "clean"],
    ["cache", "clean", "--all"],
    ["prewarm", "-n"],
    ["verify", "--no-load"],
    # build planned before it failed: its message said the directory twice ("error: cache X:
    # cache directory X: ...") and did not name the setting
    ["build"],
    ["build", "--dry-run"],
]


@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_cache_dir_under_a_file_is_an_error_naming_its_setting(proj, cmd):
    afile = proj["tmp"] / "afile"
    afile.write_text("x\n")
    r = _q(cmd, proj["dir"], QUACK_CACHE_DIR=afile / "sub")
    assert r.returncode == 1, r.stdout + r.stderr
    line = f"error: cache directory {afile / 'sub'}: not a directory ({afile} is a file)"
    assert r.stderr.startswith(line), r.stderr
    assert "(cache directory set by QUACK_CACHE_DIR)" in r.stderr
    assert r.stdout == ""


def test_unreachable_cache_dir_names_the_option_or_quack_toml(proj):
    afile = proj["tmp"] / "afile"
    afile.write_text("x\n")
    r = _q(["cache", "clean", "--cache-dir", afile / "sub"], proj["dir"])
    assert r.returncode == 1 and "not a directory" in r.stderr, r.stderr
    assert "(cache directory set by --cache-dir)" in r.stderr
    toml = proj["dir"] / "quack.toml"
    toml.write_text(toml.read_text() + '[cache]\ndir = "../afile/sub"\n')
    for cmd in (["cache", "stats"], ["cache", "clean"], ["prewarm", "-n"]):
        r = _q(cmd, proj["dir"], QUACK_CACHE_DIR="")  # unset: quack.toml decides
        assert r.returncode == 1 and "not a directory" in r.stderr, r.stderr
        assert f"(cache directory set by [cache] dir in {toml})" in r.stderr
    # The cache directory itself a file: prewarm read it as an empty journal, exit 0.
    r = _q(["prewarm", "-n"], proj["dir"], QUACK_CACHE_DIR=afile)
    assert r.returncode == 1 and f"cache directory {afile} exists and is not a directory" in r.stderr
    assert "journal records" not in r.stdout


@needs_perm_checks
@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_cache_dir_without_permission_is_an_error(proj, cmd):
    root = proj["root"]
    before = _files(root)
    root.chmod(0)
    try:
        r = _q(cmd, proj["dir"], no_dac=True, QUACK_CACHE_DIR=root)
    finally:
        root.chmod(0o700)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.startswith(f"error: cache directory {root}: permission denied"), r.stderr
    assert "(cache directory set by QUACK_CACHE_DIR)" in r.stderr
    assert _files(root) == before


@needs_perm_checks
@pytest.mark.parametrize("cmd", [["cache", "stats", "--json"], ["cache", "clean", "--all"]], ids=" ".join)
def test_unreadable_directory_inside_the_cache_is_an_error_not_skipped(proj, cmd):
    """Skipped silently, it made stats report a smaller cache and clean leave it."""
    root, stamp = proj["root"], proj["fpdir"].parent.parent
    before = _files(root)
    stamp.chmod(0)
    try:
        r = _q(cmd, proj["dir"], no_dac=True, QUACK_CACHE_DIR=root)
    finally:
        stamp.chmod(0o700)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.startswith(f"error: cache directory {root}: permission denied ({stamp})"), r.stderr
    assert _files(root) == before


@pytest.mark.skipif(not can_mount(), reason="needs root with mount (a real read-only tmpfs)")
def test_clean_on_a_read_only_cache_says_so_and_exits_1(proj):
    ro = proj["tmp"] / "ro"
    ro.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700", "tmpfs", str(ro)], check=True, timeout=30)
    try:
        shutil.copytree(proj["root"], ro, dirs_exist_ok=True)
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True, timeout=30)
        before = _files(ro)
        lock = next(ro.rglob("*.lock"))
        with pytest.raises(OSError) as exc:  # not None ("held by another process")
            orphans.try_lock(lock)
        assert exc.value.errno == errno.EROFS
        for args in (["--all"], ["--max-size", "0"], ["--older-than", "0"], ["--all", "--json"], []):
            r = _q(["cache", "clean", *args], proj["dir"], QUACK_CACHE_DIR=ro)
            assert r.returncode == 1, (args, r.stdout, r.stderr)
            assert r.stderr.startswith(
                f"error: cannot clean the cache directory {ro}: read-only file system; nothing was removed"
            ), r.stderr
            assert "in use" not in r.stdout + r.stderr and r.stdout == ""
        r = _q(["cache", "clean", "--all", "-n"], proj["dir"], QUACK_CACHE_DIR=ro)
        assert r.returncode == 0 and "would free" in r.stdout, r.stdout + r.stderr
        assert _files(ro) == before
    finally:
        subprocess.run(["umount", str(ro)], check=True, timeout=30)


@needs_perm_checks
def test_a_lock_that_cannot_be_opened_is_an_error_not_busy(proj):
    """try_lock's PermissionError was taken for "held by another process"."""
    keys_ = sorted(p.name[:-5] for p in proj["fpdir"].glob("*.lock"))
    lock = proj["fpdir"] / f"{keys_[0]}.lock"
    lock.chmod(0o400)
    r = _q(["cache", "clean", "--all", "--json"], proj["dir"], no_dac=True, QUACK_CACHE_DIR=proj["root"])
    assert r.returncode == 1, r.stdout + r.stderr
    res = json.loads(r.stdout)
    assert res["busy"] == [] and res["errors"] == [f"{lock}: Permission denied"], res
    assert (proj["fpdir"] / f"{keys_[0]}.o").exists()  # not removed without its lock
    assert not (proj["fpdir"] / f"{keys_[1]}.o").exists()


@pytest.mark.parametrize(
    "cmd",
    [["cache", "clean", "--all"], ["cache", "stats"], ["prewarm", "-n"], ["verify", "--no-load"]],
    ids=" ".join,
)
def test_empty_cache_dir_option_is_refused(proj, monkeypatch, cmd):
    """`--cache-dir ''` was Path('') == '.': `clean --all` cleaned the current directory."""
    monkeypatch.chdir(proj["root"])
    before = _files(proj["root"])
    r = runner.invoke(app, [*cmd, "--cache-dir", ""])
    assert r.exit_code == 2, r.output
    assert "Invalid value for '--cache-dir': must not be empty" in r.output
    assert _files(proj["root"]) == before


@pytest.mark.parametrize("where", ["quack.toml", "QUACK_CACHE_DIR"])
def test_empty_cache_dir_setting_is_refused(proj, where):
    """`[cache] dir = ""` (or QUACK_CACHE_DIR=' ') was the project (or working) directory:
    the cache went there and `clean --all` cleaned there. Now the settings' error."""
    toml = proj["dir"] / "quack.toml"
    extra = {"QUACK_CACHE_DIR": " "}
    if where == "quack.toml":
        toml.write_text(toml.read_text() + '[cache]\ndir = ""\n')
        extra = {"QUACK_CACHE_DIR": ""}  # unset: quack.toml decides
    before = sorted(os.listdir(proj["dir"]))
    for cmd in (["cache", "clean", "--all"], ["cache", "stats"], ["build"]):
        r = _q(cmd, proj["dir"], **extra)
        assert r.returncode == 1, r.stdout + r.stderr
        bad = f"{toml}: cache.dir = ''" if where == "quack.toml" else "QUACK_CACHE_DIR=' '"
        assert f"{bad} is invalid: must not be empty or blank" in r.stderr, r.stderr
    assert sorted(os.listdir(proj["dir"])) == before


def _used(proj) -> None:
    journal.append(
        proj["root"],
        [
            {
                "kernel": "toy_scale",
                "key": "x",
                "arch": "sm_90a",
                "params": {"dtype": "float32", "block": 128, "bias": False},
                "hits": 3,
                "misses": 1,
                "compiles": 0,
                "t": time.time(),
            }
        ],
    )


def test_emit_manifest_to_a_directory_or_under_a_file_is_an_error(proj):
    _used(proj)
    afile = proj["tmp"] / "afile"
    afile.write_text("x\n")
    d = proj["tmp"] / "outdir"
    d.mkdir()
    cases = [
        (d, f"error: --emit-manifest {d}: is a directory; give a file name"),
        (
            afile / "x.toml",
            f"error: --emit-manifest {afile / 'x.toml'}: {afile} on its path is not a directory",
        ),
        (afile / "a" / "x.toml", f"error: --emit-manifest {afile / 'a' / 'x.toml'}: {afile} on its path"),
    ]
    for out, msg in cases:
        # A usage error (2), found before the journal is read, as for --trace: it was 1.
        r = _q(["prewarm", "-n", "--emit-manifest", out], proj["dir"], QUACK_CACHE_DIR=proj["root"])
        assert r.returncode == 2 and r.stderr.startswith(msg), r.stderr
        assert "journal" not in r.stdout + r.stderr
    assert os.listdir(d) == [] and afile.read_text() == "x\n"
    assert not [p for p in proj["tmp"].iterdir() if ".tmp-" in p.name]
    ok = proj["tmp"] / "new" / "used.toml"
    r = _q(["prewarm", "-n", "--emit-manifest", ok], proj["dir"], QUACK_CACHE_DIR=proj["root"])
    assert r.returncode == 0 and "wrote 1 configurations" in r.stdout, r.stdout + r.stderr


def test_write_atomic_removes_its_temp_and_raises_the_original_error(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    with pytest.raises(IsADirectoryError) as exc:  # os.replace onto a directory
        fsutil.write_atomic(d, b"x", fsync=False)
    assert exc.value.__context__ is None
    assert [p.name for p in tmp_path.iterdir()] == ["d"] and os.listdir(d) == []
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(NotADirectoryError) as exc:  # the temp file can't be created
        fsutil.write_atomic(f / "t", b"x", fsync=False)
    # Its cleanup's own NotADirectoryError was chained onto it (a second traceback).
    assert exc.value.__context__ is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "f"]
