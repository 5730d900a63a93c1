"""Signatures of bundle indexes: Ed25519 through quack.signing.

``index.json.sig`` is JSON ``{"format": 1, "signer": NAME, "signature": BASE64}``
over the exact bytes of ``index.json``; the index lists every file's SHA-256, so
one signature covers the whole bundle. cryptography is imported only when keys are
configured (a process without trusted keys never pays for it)."""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path

from quack.bundles.index import MAX_SIG_BYTES
from quack.errors import BundleError, KeyFileError, SignatureError
from quack.safejson import safe_loads

SIG_FORMAT = 1


def trusted_keys(settings):
    """The configured trusted keys (quack.signing.TrustedKeys), or None when none are
    configured (then bundles need no signature). Raises KeyFileError for a configured
    key file that is missing or malformed."""
    if not getattr(settings, "trusted_keys", ()):
        return None
    from quack import signing

    return signing.trusted_keys_from_settings(settings)


def signature_bytes(index_bytes: bytes, key) -> bytes:
    """The ``index.json.sig`` content for ``index_bytes`` signed with ``key`` (a SigningKey)."""
    sig = key.sign(index_bytes)
    return json.dumps(
        {"format": SIG_FORMAT, "signer": key.name, "signature": base64.b64encode(sig).decode("ascii")},
        sort_keys=True,
    ).encode()


def parse_signature(data: bytes, where: str) -> tuple[str, bytes]:
    if len(data) > MAX_SIG_BYTES:
        raise BundleError(f"{where} is {len(data)} bytes, more than {MAX_SIG_BYTES}", path=where)
    try:
        doc = safe_loads(data)
        if not isinstance(doc, dict) or doc.get("format") != SIG_FORMAT:
            raise ValueError("not a format-1 signature object")
        signer, b64 = doc["signer"], doc["signature"]
        if not isinstance(signer, str) or not isinstance(b64, str):
            raise ValueError("signer/signature must be strings")
        return signer, base64.b64decode(b64, validate=True)
    except (ValueError, KeyError, binascii.Error) as e:
        raise BundleError(f"{where} is malformed ({e})", path=where) from None


def verify_index(index_bytes: bytes, pkg_dir: Path, trusted, *, bundle: str = "") -> str:
    """The name of the trusted key that signed ``index_bytes`` (the raw bytes, before
    they are parsed); BundleError if the signature in ``pkg_dir`` is missing, over
    MAX_SIG_BYTES, malformed, untrusted or bad."""
    from quack.bundles import files
    from quack.bundles.index import SIG_NAME

    sig_path = pkg_dir / SIG_NAME
    try:
        data = files.read_under(pkg_dir, SIG_NAME, MAX_SIG_BYTES)
    except BundleError as e:
        raise BundleError(f"its signature: {e}", bundle=bundle, path=str(sig_path)) from None
    except FileNotFoundError:
        names = ", ".join(trusted.names) or "none"
        raise BundleError(
            f"it is not signed and trusted keys are configured ({names}); rebuild it "
            f"with `quack bundle --sign`",
            bundle=bundle,
            path=str(sig_path),
        ) from None
    except OSError as e:
        raise BundleError(
            f"cannot read its signature {sig_path} ({e.strerror or e})", bundle=bundle, path=str(sig_path)
        ) from None
    signer, sig = parse_signature(data, str(sig_path))
    try:
        trusted.verify(signer, index_bytes, sig)
    except SignatureError as e:
        raise BundleError(f"its index signature is refused: {e}", bundle=bundle, path=str(sig_path)) from None
    return signer


__all__ = ["trusted_keys", "signature_bytes", "parse_signature", "verify_index", "KeyFileError"]
