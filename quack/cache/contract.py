"""The contracts every cache tier is written against.

Two kinds of tier:

* ``Store``: the local, writable cache (``DiskStore``). jit, the compile pool,
  the builder, the loader, ``quack verify`` and the CLI use only what is
  declared here. Exactly one per process (the settings' cache directory).
* ``ReadTier``: a read-only source of verified objects consulted after the local
  store misses and before anything compiles (installed bundles, a remote cache,
  a shared read-only directory). ``fetch(ref)`` returns a ``Fetched`` object or
  None and never raises for a cache problem. A hit is published into the local
  ``Store`` through its one atomic ``publish`` (quack.runtime.tiers), so every
  later lookup in any process is a local hit.

Error policy (house rule): a cache problem (corrupt, tampered, unreachable)
becomes a miss plus ONE warning, never a crash, never a wrong load. Only the
local store's *writes* raise, with ``CacheWriteError`` naming the cache.

This module imports nothing that imports quack.compile, quack.runtime or
quack.testing (import-linter checks it)."""

from __future__ import annotations

import dataclasses
import hashlib
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from quack.cache.entry import Entry, EntryRef

#: ``Inspection.status`` values.
Status = Literal["ok", "missing", "corrupt"]
OK: Status = "ok"
MISSING: Status = "missing"
CORRUPT: Status = "corrupt"


@dataclasses.dataclass(frozen=True)
class Inspection:
    """What ``Store.inspect`` found for one key, without changing anything.

    status: ``"ok"`` (metadata names this key, the .o has the recorded size and
    SHA-256), ``"missing"`` (no metadata) or ``"corrupt"`` (``problem`` says why).
    ``so`` is the derived shared object if its sidecar ties it to this very .o;
    ``so_problem`` says why a .so that is there is not (truncated, tampered, planted:
    the runtime warns, skips it and links a new one), "" if it is absent, stale or fine."""

    status: Status
    problem: str
    meta: dict[str, Any]
    obj: Path
    so: Path | None = None
    so_problem: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def problem_file(self) -> Path:
        """The file a corrupt entry's ``problem`` is about: its metadata (``<key>.json``)
        for a metadata problem, else its object."""
        return self.obj.with_suffix(".json") if self.problem.startswith("metadata") else self.obj


@runtime_checkable
class Store(Protocol):
    """The local cache: verified reads, per-key locks, atomic publishes.

    Raises, by method (every error is a quack.errors class; CacheError and
    CacheWriteError are OSErrors too):

    - ``root``: the cache directory (absolute).
    - ``paths(ref)``: {"obj", "meta", "so", "so_meta", "lock"} -> Path, nothing
      created. Raises CacheError if a path would leave the root.
    - ``writable()``: can this process publish here? Never raises.
    - ``lookup(ref, locked=False)``: a verified Entry or None. A corrupt entry is
      quarantined with one CacheWarning and is a miss; an entry being republished is
      awaited on its lock (the old or the new one, never a gap). ``locked``: the
      caller holds the key's lock already (never taken again). Raises CacheError only
      for an unsafe root (symlinked, foreign-owned, world-writable) or a planted lock.
    - ``inspect(ref)``: an Inspection; read-only (never quarantines, never
      takes a lock). Raises CacheError for an unsafe root, like lookup.
    - ``lock(ref, timeout)``: a context manager holding the key's lock. Raises
      LockTimeout (held elsewhere past ``timeout``), CacheError (planted
      symlink), CacheWriteError (cannot create it).
    - ``claim(ref)``: the key's lock taken now, without waiting, as an open
      descriptor the caller owns (the same lock as ``lock``; handed to another
      process with the descriptor), or None when another process holds it.
      Raises CacheError (planted lock file), CacheWriteError (cannot create it).
    - ``tmp_obj(ref)``: a fresh private temp file next to the entry. Raises
      CacheWriteError.
    - ``publish(ref, tmp_obj, meta)``: moves the temp .o into place, metadata
      last (caller holds the lock); returns the Entry. Raises CacheWriteError
      after removing what it wrote.
    - ``write_so(entry, tmp_so)``: the derived .so, sidecar last. Raises OSError.
    - ``derived_so(ref, o_sha256)``: a verified .so at ``ref``'s place whose sidecar ties
      it to an object with that digest (an in-place tier's object, which stays in its
      tier), or None. Never raises.
    - ``touch(entry)``: record use (LRU). Never raises.
    """

    @property
    def root(self) -> Path: ...

    def paths(self, ref: EntryRef) -> dict[str, Path]: ...

    def writable(self) -> bool: ...

    def lookup(self, ref: EntryRef, *, locked: bool = False) -> Entry | None: ...

    def inspect(self, ref: EntryRef) -> Inspection: ...

    def lock(self, ref: EntryRef, timeout: float | None = None) -> AbstractContextManager[None]: ...

    def claim(self, ref: EntryRef) -> int | None: ...

    def tmp_obj(self, ref: EntryRef) -> Path: ...

    def publish(self, ref: EntryRef, tmp_obj: Path, meta: dict[str, Any]) -> Entry: ...

    def write_so(self, entry: Entry, tmp_so: Path) -> Path: ...

    def derived_so(self, ref: EntryRef, o_sha256: str) -> Path | None: ...

    def touch(self, entry: Entry) -> None: ...


@dataclasses.dataclass(frozen=True)
class Fetched:
    """A verified object from a read-only tier.

    ``data`` are the .o's bytes, already checked against the tier's own record
    (``sha256``); ``meta`` is the metadata to publish with it (params,
    compile_s, ...: the local store recomputes size, sha256 and the identity
    fields). ``source`` names where it came from, for the log."""

    ref: EntryRef
    data: bytes
    meta: dict[str, Any]
    source: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


@runtime_checkable
class ListsSearched(Protocol):
    """A tier that can say what it searched (KernelNotPrebuilt lists it)."""

    def searched(self) -> tuple[str, ...]: ...


@runtime_checkable
class ReadTier(Protocol):
    """A read-only tier between the local store and the compiler.

    - ``name``: short, stable, shown in logs ("bundles", "remote", ...).
    - ``fetch(ref)``: a Fetched whose bytes the tier has verified, or None.
      Never raises for a cache problem (unreachable server, missing, corrupt or
      tampered object, bad signature): that is None plus at most one
      CacheWarning per problem (``quack.cache.problems.warn_once``). May raise
      only for a programming error (a bug), which the chain reports.

    The chain publishes a hit into the local store and loads it from there; a store
    that can't take it (read-only, full) has it loaded from a private copy of
    ``data`` instead (``quack.runtime.loader.load_fetched``).
    """

    name: str

    def fetch(self, ref: EntryRef) -> Fetched | None: ...


@runtime_checkable
class InPlaceTier(Protocol):
    """A read-only tier whose objects already lie on this machine, immutable (installed
    bundles): the chain verifies and loads them where they are instead of publishing a
    copy, so it serves a read-only or disabled local cache too.

    - ``name``: as ReadTier's.
    - ``open(ref)``: an Entry whose ``obj_path`` (and ``so_path``, if any) lie in the
      tier, their bytes just checked against the tier's signed or checksummed record;
      ``meta`` has ``sha256`` and ``source`` (e.g. ``"bundle:NAME"``). None for a miss.
      Never raises for a cache problem (None plus at most one CacheWarning).

    The chain loads what ``open`` returns with ``quack.runtime.loader.load_in_place``
    (the entry's own .so, else one derived into the local store or a private temp
    directory).
    """

    name: str

    def open(self, ref: EntryRef) -> Entry | None: ...
