"""The signed object format of the remote cache, and where objects live.

One object per key::

    QUACK-OBJECT 1\\n
    {header, canonical JSON, one line}\\n
    <the .o bytes>

The header carries ``format, key, kernel, params, arch, stamp, srcfp, size,
sha256, signer, signature`` (plus ``compile_s`` and ``created``, informative).
The signature is Ed25519 over the canonical JSON of every header field except
``signature`` itself; since that includes ``size`` and ``sha256``, it covers
the bytes too (as a Nix narinfo signs the NAR hash, not the NAR).

Remote names: ``quack/v1/<stamp>/<kernel>/<srcfp>/<key>``. The source
fingerprint is a path component, as in the local layout, because the key does
not include it: without it an edited kernel would find the remote slot taken
by the pre-edit object forever (first writer wins), and two branches with
different kernel sources would fight over one name.

A reader verifies, in this order (the issue's order; cheapest refusal of a
forgery first, and nothing about an unauthenticated header is believed before
its signature checks): signature by a trusted key; the header's key is the key
asked for (an object copied under another name is refused); toolchain stamp
and source fingerprint; size and SHA-256 of the bytes. Every failure raises
:class:`quack.errors.ObjectRejected` with a short ``reason``."""

from __future__ import annotations

import base64
import binascii
import hashlib
import time

from quack.cache import keys
from quack.errors import ObjectRejected, SignatureError
from quack.remote.base import MAX_BODY, MAX_HEADER
from quack.safejson import safe_loads
from quack.signing import SigningKey, TrustedKeys

MAGIC = b"QUACK-OBJECT 1\n"
FORMAT = 1
PREFIX = "quack/v1"
# A header is a few hundred bytes; a bound (MAX_HEADER, quack.remote.backend) keeps a
# hostile object from making the reader scan or parse megabytes before refusing it.
# MAX_BODY caps the .o bytes: a writer never signs more, a backend never reads more.
SIGNED_FIELDS = (
    "format",
    "key",
    "kernel",
    "params",
    "arch",
    "stamp",
    "srcfp",
    "size",
    "sha256",
    "signer",
    "compile_s",
    "created",
)
REASONS = (
    "unsigned",
    "malformed",
    "untrusted",
    "bad-signature",
    "wrong-key",
    "wrong-stamp",
    "wrong-source",
    "size",
    "checksum",
)


def object_name(ref) -> str:
    """Where ``ref`` (a quack.cache.entry.EntryRef: validated components) lives remotely."""
    return f"{PREFIX}/{ref.stamp}/{ref.kernel}/{ref.srcfp}/{ref.key}"


def _signed_bytes(header: dict) -> bytes:
    return keys.canonical_json({k: header[k] for k in SIGNED_FIELDS if k in header}).encode()


def pack(ref, params: dict, data: bytes, signer: SigningKey, *, compile_s: float | None = None) -> bytes:
    """The signed object for ``ref`` holding ``data`` (the .o bytes). ValueError over
    MAX_BODY: no reader would take it (the backends refuse larger values unread)."""
    if len(data) > MAX_BODY:
        raise ValueError(f"{ref.kernel} key {ref.key[:16]}: {len(data)} bytes, over the {MAX_BODY}-byte cap")
    header = {
        "format": FORMAT,
        "key": ref.key,
        "kernel": ref.kernel,
        "params": params,
        "arch": ref.arch,
        "stamp": ref.stamp,
        "srcfp": ref.srcfp,
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "signer": signer.name,
        "created": round(time.time(), 3),
    }
    if compile_s is not None:
        header["compile_s"] = round(float(compile_s), 4)
    header["signature"] = base64.b64encode(signer.sign(_signed_bytes(header))).decode("ascii")
    return MAGIC + keys.canonical_json(header).encode() + b"\n" + bytes(data)


def reject(ref, reason: str, detail: str, signer: str = "") -> ObjectRejected:
    return ObjectRejected(
        f"remote object for {ref.kernel} key {ref.key[:16]} refused ({reason}): {detail}",
        key=ref.key,
        reason=reason,
        signer=signer,
    )


def parse_header(blob: bytes) -> tuple[dict, memoryview]:
    """Split an object into (header, body) without trusting either. Raises
    ObjectRejected(reason=malformed) with ``key`` empty."""
    view = memoryview(blob)
    if not bytes(view[: len(MAGIC)]) == MAGIC:
        raise ObjectRejected("not a quack remote object (bad magic)", reason="malformed")
    end = bytes(view[len(MAGIC) : len(MAGIC) + MAX_HEADER + 1]).find(b"\n")
    if end < 0:
        raise ObjectRejected("object header unterminated or over 64 KiB", reason="malformed")
    try:
        # finite: NaN / Infinity / 1e999 are refused here, as malformed; the signed bytes
        # (canonical JSON, allow_nan=False) could not be made of them anyway.
        header = safe_loads(bytes(view[len(MAGIC) : len(MAGIC) + end]), finite=True)
    except ValueError as e:
        raise ObjectRejected(f"object header is not JSON ({e})", reason="malformed") from None
    if not isinstance(header, dict):
        raise ObjectRejected("object header is not a JSON object", reason="malformed")
    return header, view[len(MAGIC) + end + 1 :]


def unpack(blob: bytes, ref, trusted: TrustedKeys) -> tuple[bytes, dict]:
    """Verify ``blob`` as the object for ``ref``; return (.o bytes, header).
    Raises ObjectRejected; never returns unverified bytes."""
    try:
        header, body = parse_header(blob)
    except ObjectRejected as e:
        raise reject(ref, "malformed", str(e)) from None
    signer, sig_b64 = header.get("signer"), header.get("signature")
    if not sig_b64 or not signer:
        raise reject(ref, "unsigned", "the object carries no signature; unsigned objects are never accepted")
    if not isinstance(signer, str) or not isinstance(sig_b64, str):
        raise reject(ref, "malformed", "signer/signature are not strings")
    try:
        sig = base64.b64decode(sig_b64, validate=True)
    except (binascii.Error, ValueError):
        raise reject(ref, "malformed", "the signature is not base64", signer) from None
    # 1. Signature by a trusted key, over every signed header field.
    try:
        signed = _signed_bytes(header)
    except (ValueError, TypeError) as e:  # what canonical JSON can't write was never signed
        raise reject(ref, "malformed", f"the header can't be canonicalized ({e})", signer) from None
    try:
        trusted.verify(signer, signed, sig)
    except SignatureError as e:
        raise reject(ref, e.reason or "bad-signature", str(e), signer) from None
    # 2. The key asked for: a validly signed object of another key, copied here, is refused.
    if header.get("key") != ref.key or header.get("kernel") != ref.kernel or header.get("arch") != ref.arch:
        raise reject(
            ref,
            "wrong-key",
            f"the object is signed for {header.get('kernel')} key "
            f"{str(header.get('key'))[:16]} ({header.get('arch')}), not this key",
            signer,
        )
    # 3. Toolchain and kernel source: same key, but built by another cutlass or from other code.
    if header.get("stamp") != ref.stamp:
        raise reject(
            ref,
            "wrong-stamp",
            f"built with toolchain {header.get('stamp')}, this process uses {ref.stamp}",
            signer,
        )
    if header.get("srcfp") != ref.srcfp:
        raise reject(
            ref,
            "wrong-source",
            f"built from kernel source {header.get('srcfp')}, this process has {ref.srcfp}",
            signer,
        )
    if header.get("format") != FORMAT:
        raise reject(ref, "malformed", f"object format {header.get('format')!r}, expected {FORMAT}", signer)
    # 4. Size and checksum of the bytes the signature vouches for.
    if len(body) > MAX_BODY or len(body) != header.get("size"):
        raise reject(
            ref,
            "size",
            f"{len(body)} bytes, the signed header says {header.get('size')} (truncated or padded)",
            signer,
        )
    data = bytes(body)
    if hashlib.sha256(data).hexdigest() != header.get("sha256"):
        raise reject(
            ref,
            "checksum",
            "SHA-256 of the bytes does not match the signed header (altered in storage or transit)",
            signer,
        )
    return data, header
