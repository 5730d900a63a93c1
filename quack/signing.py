"""Ed25519 signing keys, named Nix-style, for signed cache objects and bundles.

Key files are one line of text, ``NAME:BASE64``, so a key can be pasted into a
CI secret, a config file or a chat message without a binary encoding:

- ``NAME.pub`` (public, what readers trust): ``NAME:`` + base64 of the 32-byte
  Ed25519 public key.
- ``NAME.key`` (private, what a writer signs with; mode 0600): ``NAME:`` +
  base64 of 64 bytes, the 32-byte seed followed by the public key (as Nix's
  secret keys). The different length means a private key given where a public
  key is expected is recognised and refused, never silently trusted; the
  embedded public half is checked against the seed on load.

The name travels with every signature, so readers can trust several keys at
once (``ci-1``, ``ci-2``) and rotate without a flag day. A name is not a
secret and proves nothing by itself: a signature verifies only against the
public key the *reader* holds under that name.

Errors: :class:`quack.errors.KeyFileError` for a key file that is missing,
unreadable or malformed (its path and the fix in the message);
:class:`quack.errors.SignatureError` for an untrusted signer or a bad
signature."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import os
import re
import stat
import warnings
from pathlib import Path
from typing import Iterable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from quack.cache import openat
from quack.errors import KeyFileError, SignatureError
from quack.filekind import describe

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")
SIGNATURE_BYTES = 64
_SEED = 32
_PUB = 32
# A key file is one short line; anything much bigger is not a key file, and
# reading it whole (a device, a log) must not be what a typo costs.
_MAX_KEY_FILE = 4096


def check_name(name: str) -> str:
    """A key name: 1-64 of letters, digits, ``. _ + -``, not starting with punctuation."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(
            f"invalid key name {name!r}: use 1-64 letters, digits, '.', '_', '+', '-' "
            "(starting with a letter or digit), e.g. 'ci-1'"
        )
    return name


def _raw_public(pub: Ed25519PublicKey) -> bytes:
    return pub.public_bytes(Encoding.Raw, PublicFormat.Raw)


@dataclasses.dataclass(frozen=True)
class PublicKey:
    """A named Ed25519 public key."""

    name: str
    raw: bytes  # 32 bytes

    def text(self) -> str:
        """The ``NAME:BASE64`` line of a ``.pub`` file."""
        return f"{self.name}:{base64.b64encode(self.raw).decode('ascii')}"

    def verify(self, data: bytes, signature: bytes) -> None:
        """Raise :class:`SignatureError` unless ``signature`` is this key's over ``data``."""
        try:
            Ed25519PublicKey.from_public_bytes(self.raw).verify(bytes(signature), bytes(data))
        except InvalidSignature:
            raise SignatureError(
                f"bad signature by key {self.name!r}: the data was altered or "
                "signed by another key of that name",
                signer=self.name,
                reason="bad-signature",
            ) from None


class SigningKey:
    """A named Ed25519 private key; ``sign`` gives a 64-byte signature."""

    def __init__(self, name: str, private: Ed25519PrivateKey):
        self.name = check_name(name)
        self._private = private
        self.public = PublicKey(name, _raw_public(private.public_key()))

    @classmethod
    def generate(cls, name: str) -> "SigningKey":
        return cls(name, Ed25519PrivateKey.generate())

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(bytes(data))

    def text(self) -> str:
        """The ``NAME:BASE64(seed || public)`` line of a ``.key`` file."""
        seed = self._private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        return f"{self.name}:{base64.b64encode(seed + self.public.raw).decode('ascii')}"

    def __repr__(self) -> str:  # never the secret
        return f"SigningKey({self.name!r})"


class TrustedKeys:
    """The public keys a reader trusts, by name. ``verify`` is the one check
    readers call; an empty set trusts nothing (every signature is refused)."""

    def __init__(self, keys: Iterable[PublicKey] = ()):
        self._keys: dict[str, PublicKey] = {}
        for k in keys:
            self.add(k)

    def add(self, key: PublicKey, *, origin: str = "") -> None:
        old = self._keys.get(key.name)
        if old is not None and old.raw != key.raw:
            raise KeyFileError(
                f"two different public keys are named {key.name!r}"
                + (f" ({origin})" if origin else "")
                + ": key names must be unique; rename one (e.g. ci-2)",
                path=origin,
                reason="duplicate-name",
            )
        self._keys[key.name] = key

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._keys))

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, name: object) -> bool:
        return name in self._keys

    def including(self, key: PublicKey) -> "TrustedKeys":
        """A copy that also trusts ``key``, unless a key of that name is trusted already."""
        out = TrustedKeys(self._keys.values())
        if key.name not in out:
            out.add(key)
        return out

    def verify(self, signer: str, data: bytes, signature: bytes) -> None:
        """Raise :class:`SignatureError` (``reason`` ``untrusted`` or
        ``bad-signature``) unless ``signature`` over ``data`` is by the trusted
        key named ``signer``."""
        key = self._keys.get(signer)
        if key is None:
            trusted = ", ".join(self.names) or "none"
            raise SignatureError(
                f"signer {signer!r} is not a trusted key (trusted: {trusted}); "
                "add its .pub file to QUACK_TRUSTED_KEYS / [remote] trusted_keys "
                "if you trust it",
                signer=signer,
                reason="untrusted",
            )
        if len(signature) != SIGNATURE_BYTES:
            raise SignatureError(
                f"bad signature by key {signer!r}: {len(signature)} bytes, expected {SIGNATURE_BYTES}",
                signer=signer,
                reason="bad-signature",
            )
        key.verify(data, signature)


# --- key files ---------------------------------------------------------------------


def _parse_line(line: str, path: str) -> tuple[str, bytes]:
    name, sep, b64 = line.strip().partition(":")
    if not sep:
        raise KeyFileError(
            f"{path}: not a key: expected one line NAME:BASE64 (as written by `quack keygen NAME`)",
            path=path,
            reason="format",
        )
    try:
        check_name(name)
    except ValueError as e:
        raise KeyFileError(f"{path}: {e}", path=path, reason="format") from None
    try:
        raw = base64.b64decode(b64.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise KeyFileError(
            f"{path}: key {name!r}: the part after ':' is not valid base64", path=path, reason="format"
        ) from None
    return name, raw


def _read_small(path: Path) -> str:
    # O_NONBLOCK, then fstat (openat.read_regular): a FIFO named as a key file
    # (QUACK_TRUSTED_KEYS=fifo.pub) made a blocking open() wait for a writer for ever,
    # hanging every build, pull and first kernel call. Symlinks are followed on purpose:
    # mounted secrets are usually links.
    def fail(what: str, reason: str = "format") -> KeyFileError:
        return KeyFileError(f"{path}: {what}", path=str(path), reason=reason)

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise fail("no such key file (create one with `quack keygen NAME`)", "missing") from None
    except OSError as e:
        raise fail(f"cannot read ({e.strerror})", "unreadable") from None
    try:
        data = openat.read_regular(
            fd,
            _MAX_KEY_FILE,
            not_regular=lambda mode: fail(
                f"is {describe(mode)}, not a key file "
                "(expected a regular file of NAME:BASE64 lines, as `quack keygen NAME` writes)"
            ),
            too_large=lambda _n: fail(f"too large for a key file ({_MAX_KEY_FILE} bytes at most)"),
        )
    except OSError as e:
        raise fail(f"cannot read ({e.strerror})", "unreadable") from None
    finally:
        os.close(fd)
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise KeyFileError(
            f"{path}: not a key file (not ASCII text)", path=str(path), reason="format"
        ) from None


def _lines(text: str) -> list[str]:
    return [ln for ln in (x.strip() for x in text.splitlines()) if ln and not ln.startswith("#")]


def parse_public(text: str, origin: str = "<text>") -> PublicKey:
    name, raw = _parse_line(text, origin)
    if len(raw) == _SEED + _PUB:
        raise KeyFileError(
            f"{origin}: this is a PRIVATE key ({name!r}); trust its .pub file instead, "
            "and keep the .key secret",
            path=origin,
            reason="private-as-public",
        )
    if len(raw) != _PUB:
        raise KeyFileError(
            f"{origin}: key {name!r}: {len(raw)} bytes, an Ed25519 public key has {_PUB}",
            path=origin,
            reason="format",
        )
    return PublicKey(name, raw)


def parse_private(text: str, origin: str = "<text>") -> SigningKey:
    name, raw = _parse_line(text, origin)
    if len(raw) == _PUB:
        raise KeyFileError(
            f"{origin}: this is a PUBLIC key ({name!r}); signing needs the .key file "
            "written next to it by `quack keygen`",
            path=origin,
            reason="public-as-private",
        )
    if len(raw) != _SEED + _PUB:
        raise KeyFileError(
            f"{origin}: key {name!r}: {len(raw)} bytes, a signing key has {_SEED + _PUB}",
            path=origin,
            reason="format",
        )
    key = SigningKey(name, Ed25519PrivateKey.from_private_bytes(raw[:_SEED]))
    if key.public.raw != raw[_SEED:]:
        raise KeyFileError(
            f"{origin}: key {name!r} is damaged: its public half does not match its seed",
            path=origin,
            reason="format",
        )
    return key


def load_signing_key(path: str | os.PathLike) -> SigningKey:
    """Load a ``.key`` file. A file others can read still loads, with a warning
    (CI runners often write secrets with the default umask)."""
    p = Path(path).expanduser()
    text = _read_small(p)
    lines = _lines(text)
    if len(lines) != 1:
        raise KeyFileError(
            f"{p}: a signing key file holds exactly one key line, found {len(lines)}",
            path=str(p),
            reason="format",
        )
    key = parse_private(lines[0], str(p))
    try:
        mode = p.stat().st_mode
    except OSError:
        mode = 0
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        warnings.warn(
            f"signing key {p} is readable by other users (mode {stat.S_IMODE(mode):o}); run: chmod 600 {p}",
            stacklevel=2,
        )
    return key


def load_public_keys(path: str | os.PathLike) -> list[PublicKey]:
    """The public keys in one file (one ``NAME:BASE64`` per line; ``#`` comments)."""
    p = Path(path).expanduser()
    lines = _lines(_read_small(p))
    if not lines:
        raise KeyFileError(f"{p}: no key in this file", path=str(p), reason="format")
    return [parse_public(ln, str(p)) for ln in lines]


def load_trusted_keys(specs: str | os.PathLike | Iterable[str | os.PathLike]) -> TrustedKeys:
    """Trusted keys from files and directories (every ``*.pub`` in a directory).

    ``specs`` is a ``:``-separated string (as ``QUACK_TRUSTED_KEYS``) or a
    sequence of paths. A listed path that does not exist is an error: a typo
    must not quietly leave a reader trusting fewer keys than meant."""
    if isinstance(specs, (str, os.PathLike)):
        parts = [x for x in str(specs).split(":") if x.strip()]
    else:
        parts = [str(x) for x in specs]
    trusted = TrustedKeys()
    for part in parts:
        p = Path(part).expanduser()
        if p.is_dir():
            files = sorted(f for f in p.iterdir() if f.suffix == ".pub" and f.is_file())
            if not files:
                raise KeyFileError(f"{p}: directory holds no *.pub key file", path=str(p), reason="missing")
        else:
            files = [p]
        for f in files:
            for k in load_public_keys(f):
                trusted.add(k, origin=str(f))
    return trusted


def write_keypair(name: str, out_dir: str | os.PathLike = ".") -> tuple[Path, Path]:
    """Generate a key pair: ``out_dir/NAME.key`` (0600) and ``out_dir/NAME.pub``.

    Never overwrites: losing a signing key by a repeated command would orphan
    every object signed with it. Raises :class:`FileExistsError` if either
    file exists, :class:`ValueError` for an invalid name."""
    check_name(name)
    d = Path(out_dir).expanduser()
    d.mkdir(parents=True, exist_ok=True)
    key_path, pub_path = d / f"{name}.key", d / f"{name}.pub"
    for p in (key_path, pub_path):
        if os.path.lexists(p):
            raise FileExistsError(f"{p} already exists; remove it or choose another name (e.g. {name}-2)")
    key = SigningKey.generate(name)
    _write_new(key_path, key.text() + "\n", 0o600)
    try:
        _write_new(pub_path, key.public.text() + "\n", 0o644)
    except BaseException:
        key_path.unlink(missing_ok=True)
        raise
    return key_path, pub_path


def _write_new(path: Path, text: str, mode: int) -> None:
    """Write a new file with ``mode`` from the start (the secret is never on
    disk with wider permissions), then link it into place so an existing file
    is never replaced and a reader never sees a partial key."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)  # the umask must not widen or narrow what we promise
        os.write(fd, text.encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    finally:
        os.unlink(tmp)


# --- settings --------------------------------------------------------------------


def signing_key_from_settings(s) -> SigningKey | None:
    """The writer's key named by ``signing_key`` (``QUACK_SIGNING_KEY``), or None."""
    if not s.signing_key:
        return None
    try:
        return load_signing_key(s.signing_key)
    except KeyFileError as e:
        raise _with_setting(e, s, "signing_key", "QUACK_SIGNING_KEY") from None


def trusted_keys_from_settings(s) -> TrustedKeys:
    """The reader's keys named by ``trusted_keys`` (``QUACK_TRUSTED_KEYS``); may be empty."""
    if not s.trusted_keys:
        return TrustedKeys()
    try:
        return load_trusted_keys(list(s.trusted_keys))
    except KeyFileError as e:
        raise _with_setting(e, s, "trusted_keys", "QUACK_TRUSTED_KEYS") from None


def _with_setting(e: KeyFileError, s, field: str, env: str) -> KeyFileError:
    """``e`` with the setting that named the file: a path alone left users hunting for
    which of the environment, quack.toml or a flag pointed at it."""
    src = (getattr(s, "sources", None) or {}).get(field, "")
    if src == env:
        where = env
    elif src and src != "cli":
        where = f"[remote] {field} in {src}"
    else:
        where = f"{env} / [remote] {field}"
    return KeyFileError(f"{e} (set by {where})", path=e.path, reason=e.reason)
