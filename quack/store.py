"""The on-disk cache of compiled kernels (layout: docs/cache-layout.md).

    <root>/v1/<stamp>/<kernel>/<srcfp>/<key>.o        the artifact (CuTe DSL export_to_c)
                                       <key>.json     metadata, written last
                                       <key>.so       derived: the .o linked for fast loading
                                       <key>.so.json  sidecar tying the .so to the .o's digest
                                       <key>.lock     per-key lock (filelock)
    <root>/quarantine/  corrupt entries moved aside     <root>/journal.jsonl  usage journal
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Protocol

from quack import fsutil, keys

LAYOUT = "v1"
META_FORMAT = 1


class CacheWarning(UserWarning):
    """A cache problem quack recovered from (the entry is rebuilt)."""


class LockTimeout(Exception):
    """Another process held the key's lock past the time-out."""

    def __init__(self, path: str, timeout: float):
        super().__init__(f"lock {path} still held after {timeout:.0f} s")
        self.path = path
        self.timeout = timeout


@dataclasses.dataclass(frozen=True)
class EntryRef:
    """Where one (kernel, params, arch) lives: everything a path needs."""

    kernel: str
    key: str
    arch: str
    srcfp: str

    @property
    def stamp(self) -> str:
        return keys.toolchain_stamp(self.arch)


@dataclasses.dataclass
class Entry:
    ref: EntryRef
    meta: dict
    obj_path: Path
    so_path: Path | None  # verified .so, if there is one


class Store(Protocol):
    """What the runtime and the builder need of a cache.

    lookup: a verified entry or None; corrupt entries are quarantined with a
      CacheWarning, never raised. May raise CacheError (unsafe root).
    lock: context manager; raises LockTimeout.
    publish: raises OSError (e.g. ENOSPC) after removing its temp files.
    """

    def lookup(self, ref: EntryRef) -> Entry | None: ...
    def lock(self, ref: EntryRef, timeout: float | None = None): ...
    def tmp_obj(self, ref: EntryRef) -> Path: ...
    def publish(self, ref: EntryRef, tmp_obj: Path, meta: dict) -> Entry: ...


class DiskStore:
    def __init__(self, root: Path, *, fsync: bool = True, lock_timeout: float = 600.0):
        self.root = Path(root)
        self.fsync = fsync
        self.lock_timeout = lock_timeout
        self._checked = False

    # -- paths -----------------------------------------------------------------
    def entry_dir(self, ref: EntryRef) -> Path:
        return (self.root / LAYOUT / keys.safe_component(ref.stamp) / keys.safe_component(ref.kernel)
                / keys.safe_component(ref.srcfp))

    def paths(self, ref: EntryRef) -> dict[str, Path]:
        d = self.entry_dir(ref)
        k = keys.safe_component(ref.key)
        return {"obj": d / f"{k}.o", "meta": d / f"{k}.json", "so": d / f"{k}.so",
                "so_meta": d / f"{k}.so.json", "lock": d / f"{k}.lock"}

    def check_root(self) -> None:
        if not self._checked:
            fsutil.check_root(self.root)
            self._checked = True

    def _ensure(self, ref: EntryRef) -> Path:
        self.check_root()
        return fsutil.ensure_dir(self.entry_dir(ref), self.root)

    # -- reading ---------------------------------------------------------------
    def lookup(self, ref: EntryRef) -> Entry | None:
        self.check_root()
        p = self.paths(ref)
        try:
            meta_bytes = fsutil.read_nofollow(p["meta"])
        except FileNotFoundError:
            return None  # not built (or publish interrupted before metadata: debris, a miss)
        except OSError as e:
            return self._bad(ref, f"metadata unreadable ({e})")
        problem, meta = self._check(ref, meta_bytes, p["obj"])
        if problem:
            # Check, lock, check again: a concurrent rebuild may have swapped files
            # between our two reads; only quarantine what is wrong under the lock.
            try:
                with self.lock(ref, timeout=min(self.lock_timeout, 10.0)):
                    try:
                        meta_bytes = fsutil.read_nofollow(p["meta"])
                    except FileNotFoundError:
                        return None
                    except OSError as e:
                        meta_bytes = b""
                        problem = f"metadata unreadable ({e})"
                    if meta_bytes:
                        problem, meta = self._check(ref, meta_bytes, p["obj"])
                    if problem:
                        return self._bad(ref, problem)
            except LockTimeout:
                warnings.warn(f"quack: cache entry {ref.kernel} key {ref.key[:16]} looks corrupt "
                              f"({problem}) and its lock is held; not using it (it will be recompiled)",
                              CacheWarning, stacklevel=3)
                return None
        return Entry(ref, meta, p["obj"], self._verified_so(p, meta))

    def _check(self, ref: EntryRef, meta_bytes: bytes, obj: Path) -> tuple[str, dict]:
        try:
            meta = json.loads(meta_bytes)
            if not isinstance(meta, dict):
                raise ValueError("not an object")
        except ValueError as e:
            return f"metadata is not valid JSON ({e})", {}
        for field, want in (("format", META_FORMAT), ("key", ref.key), ("kernel", ref.kernel),
                            ("arch", ref.arch)):
            if meta.get(field) != want:
                return f"metadata {field}={meta.get(field)!r}, expected {want!r} (foreign entry)", meta
        try:
            data = fsutil.read_nofollow(obj)
        except FileNotFoundError:
            return "object file missing", meta
        except OSError as e:
            return f"object file unreadable ({e})", meta
        if len(data) != meta.get("size"):
            return f"object file is {len(data)} bytes, metadata says {meta.get('size')} (truncated)", meta
        if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            return "object file checksum mismatch (corrupt or swapped)", meta
        return "", meta

    def _verified_so(self, p: dict[str, Path], meta: dict) -> Path | None:
        try:
            side = json.loads(fsutil.read_nofollow(p["so_meta"]))
            data = fsutil.read_nofollow(p["so"])
        except (OSError, ValueError):
            return None
        if (side.get("o_sha256") != meta.get("sha256")
                or hashlib.sha256(data).hexdigest() != side.get("sha256")):
            return None  # stale or damaged derived file: relinked from the verified .o
        return p["so"]

    def _bad(self, ref: EntryRef, reason: str) -> None:
        where = self.quarantine(ref, reason)
        warnings.warn(f"quack: cache entry {ref.kernel} key {ref.key[:16]} was corrupt ({reason}); "
                      f"moved to {where} and it will be recompiled", CacheWarning, stacklevel=3)
        return None

    def quarantine(self, ref: EntryRef, reason: str) -> Path:
        qdir = fsutil.ensure_dir(self.root / "quarantine", self.root)
        tag = f"{keys.safe_component(ref.stamp)}-{keys.safe_component(ref.key)}-{int(time.time() * 1000)}"
        stem = keys.safe_component(ref.key)
        for name, path in self.paths(ref).items():
            if name == "lock":
                continue
            try:
                os.replace(path, qdir / f"{tag}{path.name[len(stem):]}")
            except FileNotFoundError:
                pass
            except OSError:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        fsutil.write_atomic(qdir / f"{tag}.reason", reason.encode(), fsync=False)
        return qdir / tag

    # -- writing ---------------------------------------------------------------
    @contextmanager
    def lock(self, ref: EntryRef, timeout: float | None = None) -> Iterator[None]:
        import filelock

        self._ensure(ref)
        t = self.lock_timeout if timeout is None else timeout
        lk = filelock.FileLock(str(self.paths(ref)["lock"]), timeout=t, mode=0o600)
        try:
            lk.acquire()
        except filelock.Timeout:
            raise LockTimeout(str(self.paths(ref)["lock"]), t) from None
        try:
            yield
        finally:
            lk.release()

    def tmp_obj(self, ref: EntryRef) -> Path:
        self._ensure(ref)
        return fsutil.tmp_beside(self.paths(ref)["obj"])

    def publish(self, ref: EntryRef, tmp_obj: Path, meta: dict) -> Entry:
        """Move a finished temp .o into place, metadata last. Caller holds the lock."""
        p = self.paths(ref)
        try:
            data = fsutil.read_nofollow(tmp_obj)
            meta = dict(meta, format=META_FORMAT, key=ref.key, kernel=ref.kernel, arch=ref.arch,
                        stamp=ref.stamp, srcfp=ref.srcfp, size=len(data),
                        sha256=hashlib.sha256(data).hexdigest(), created=meta.get("created", time.time()))
            # An older entry's metadata must go first: a reader pairing it with the
            # new .o would see a checksum mismatch.
            for old in ("meta", "so_meta"):
                try:
                    os.unlink(p[old])
                except FileNotFoundError:
                    pass
            fsutil.publish_file(tmp_obj, p["obj"], fsync=self.fsync)
            fsutil.write_atomic(p["meta"], json.dumps(meta, sort_keys=True, indent=1).encode(),
                                fsync=self.fsync)
        except BaseException:
            try:
                os.unlink(tmp_obj)
            except FileNotFoundError:
                pass
            raise
        return Entry(ref, meta, p["obj"], None)

    def write_so(self, entry: Entry, tmp_so: Path) -> Path:
        p = self.paths(entry.ref)
        data = fsutil.read_nofollow(tmp_so)
        fsutil.publish_file(tmp_so, p["so"], fsync=False)
        side = {"o_sha256": entry.meta["sha256"], "sha256": hashlib.sha256(data).hexdigest()}
        fsutil.write_atomic(p["so_meta"], json.dumps(side).encode(), fsync=False)
        return p["so"]

    def touch(self, entry: Entry) -> None:
        """Record use (LRU for ``quack cache clean --max-size``): the metadata's mtime."""
        try:
            os.utime(self.paths(entry.ref)["meta"], follow_symlinks=False)
        except OSError:
            pass  # read-only cache: use still works, LRU order just ages
