"""What names one cache entry: ``EntryRef`` (kernel, key, arch, source fingerprint),
every component checked before it becomes part of a path, and ``Entry``, a store's
verified entry (its ref, metadata and files). Used by every store and tier
(quack.cache.store, quack.bundles, quack.remote) and by the runtime (quack.runtime.jit,
quack.runtime.tiers).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from quack.cache import keys
from quack.errors import ParamError

# What may appear in a path component. Names come from the registry (same rule),
# keys are SHA-256 hex, fingerprints 16 hex (or "main"), archs sm_NN[N][a|f]. Checked
# with str operations over ASCII sets, not regular expressions: compiling four patterns
# was ~0.2 ms of every fresh process's first kernel load (issue 15). (ASCII sets: str's
# isdigit/isalnum also accept other scripts' digits and letters.)
_HEX = frozenset("0123456789abcdef")
_DIGITS = frozenset("0123456789")
_LOWER = frozenset("abcdefghijklmnopqrstuvwxyz")
_NAME_CHARS = _LOWER | _DIGITS | {"_"}
KERNEL_FORM = "^[a-z][a-z0-9_]{0,63}$"


def _is_kernel_name(v: str) -> bool:
    return 1 <= len(v) <= 64 and v[0] in _LOWER and _NAME_CHARS.issuperset(v)


def _is_key(v: str) -> bool:
    return len(v) == 64 and _HEX.issuperset(v)


def _is_srcfp(v: str) -> bool:
    return v == "main" or (len(v) == 16 and _HEX.issuperset(v))


def _is_arch(v: str) -> bool:
    if not v.startswith("sm_"):
        return False
    rest = v[3:]
    if rest[-1:] in ("a", "f"):
        rest = rest[:-1]
    return 2 <= len(rest) <= 3 and _DIGITS.issuperset(rest)


def _check_field(what: str, value, ok: Callable[[str], bool], form: str) -> None:
    if not isinstance(value, str) or not ok(value):
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise ParamError(
            f"refusing {what} {shown} for a cache path: expected {form}",
            kernel=value if what == "kernel name" and isinstance(value, str) else "",
            param=what,
        )


# EntryRef and Entry are dataclasses (fields, replace, asdict work) whose methods are
# written out here instead of generated: the generated ones are exec'd source, ~0.6 ms
# of every fresh process's first kernel load (issue 15). Same behaviour as
# @dataclass(frozen=True) and @dataclass: tests/test_store.py compares them.
@dataclasses.dataclass(init=False, repr=False, eq=False)
class EntryRef:
    """Where one (kernel, params, arch) lives: everything a path needs. Immutable."""

    kernel: str
    key: str
    arch: str
    srcfp: str

    def __init__(self, kernel: str, key: str, arch: str, srcfp: str):
        # Every component of an entry's path comes from here: refuse anything that
        # could leave the cache root ('../', '/', NUL, overlong, non-text) up front.
        _check_field("kernel name", kernel, _is_kernel_name, "a registered name matching " + KERNEL_FORM)
        _check_field("key", key, _is_key, "64 lowercase hex digits (SHA-256)")
        _check_field("arch", arch, _is_arch, "a CUDA arch like sm_90a")
        _check_field("source fingerprint", srcfp, _is_srcfp, "16 lowercase hex digits")
        d = self.__dict__
        d["kernel"], d["key"], d["arch"], d["srcfp"] = kernel, key, arch, srcfp

    def _astuple(self) -> tuple[str, str, str, str]:
        return (self.kernel, self.key, self.arch, self.srcfp)

    def __eq__(self, other):
        if other.__class__ is self.__class__:
            return self._astuple() == other._astuple()
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._astuple())

    def __repr__(self) -> str:
        return (
            f"{type(self).__qualname__}(kernel={self.kernel!r}, key={self.key!r}, "
            f"arch={self.arch!r}, srcfp={self.srcfp!r})"
        )

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name):
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")

    @property
    def stamp(self) -> str:
        return keys.toolchain_stamp(self.arch)


@dataclasses.dataclass(init=False, repr=False, eq=False)
class Entry:
    """A verified entry of a store: its ref, metadata and files."""

    ref: EntryRef
    meta: dict
    obj_path: Path
    so_path: Path | None  # verified .so, if there is one

    def __init__(self, ref: EntryRef, meta: dict, obj_path: Path, so_path: Path | None):
        self.ref, self.meta, self.obj_path, self.so_path = ref, meta, obj_path, so_path

    def __eq__(self, other):
        if other.__class__ is self.__class__:
            return (self.ref, self.meta, self.obj_path, self.so_path) == (
                other.ref,
                other.meta,
                other.obj_path,
                other.so_path,
            )
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, as @dataclass(eq=True) makes it

    def __repr__(self) -> str:
        return (
            f"{type(self).__qualname__}(ref={self.ref!r}, meta={self.meta!r}, "
            f"obj_path={self.obj_path!r}, so_path={self.so_path!r})"
        )
