"""Parsing JSON that may be hostile: cache metadata and sidecars, the usage journal, the
remote stats file, a bundle's index, signature and metadata files, a remote object's
header.

``json.loads`` recurses once per nesting level, so 100,000 ``[`` (100 KB, within every
size cap those readers apply, and outside what a bundle's signature covers) end in
RecursionError. That is no ValueError: it escaped every reader's ``except ValueError``
and crashed the kernel call, ``quack cache stats`` or the remote tier. ``safe_loads``
raises ValueError for such input, so it is malformed like any other: a miss, a skipped
line, a refused bundle or object.

The depth is measured only after the parser gave up (a metadata read is on every local
hit's path): input nested deeper than ``MAX_DEPTH`` is the input's fault (ValueError);
shallower input that still hit the limit means the caller's own stack was nearly
exhausted, which is re-raised as it is, not blamed on the file.

This module imports nothing from quack, so any module can import it."""

from __future__ import annotations

import json
import math
from typing import Any

#: Deeper than any format quack writes (its metadata nests 3 levels) by far; input that
#: made the parser recurse out and is nested deeper than this is malformed.
MAX_DEPTH = 64


def safe_loads(data: bytes | bytearray | str, *, finite: bool = False) -> Any:
    """``json.loads(data)``, but input nested too deeply for the parser raises ValueError
    (like any malformed JSON) instead of RecursionError. ``finite``: ``NaN``, ``Infinity``
    and numbers that overflow to infinity (``1e999``), which ``json.loads`` accepts though
    they are not JSON, raise ValueError too (for input that is re-serialized canonically,
    ``allow_nan=False``, as a signed header is)."""
    kw: dict[str, Any] = {"parse_constant": _no_constant, "parse_float": _finite_float} if finite else {}
    try:
        return json.loads(data, **kw)
    except RecursionError:
        if nested_deeper_than(data, MAX_DEPTH):
            raise ValueError(f"JSON nested more than {MAX_DEPTH} levels deep") from None
        raise  # the caller's own stack ran out, not the input's fault: not malformed


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    f = float(text)
    if not math.isfinite(f):
        raise ValueError(f"number {text[:40]} is out of range")
    return f


def nested_deeper_than(data: bytes | bytearray | str, limit: int) -> bool:
    """Whether the arrays and objects of ``data`` (JSON text, in any encoding json reads)
    nest more than ``limit`` deep. Brackets inside strings don't count; the scan stops at
    the first level past ``limit``, so it is bounded by the input's length."""
    if isinstance(data, (bytes, bytearray)):
        try:
            text = bytes(data).decode(json.detect_encoding(data), "surrogatepass")
        except (UnicodeDecodeError, LookupError):
            return False  # json.loads reports undecodable input itself, as ValueError
    else:
        text = data
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return True
        elif ch in "]}":
            depth -= 1
    return False
