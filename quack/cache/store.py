"""The on-disk cache of compiled kernels (layout: docs/cache-layout.md).

<root>/v1/<stamp>/<kernel>/<srcfp>/<key>.o        the artifact (CuTe DSL export_to_c)
                                   <key>.json     metadata, written last
                                   <key>.so       derived: the .o linked for fast loading
                                   <key>.so.json  sidecar tying the .so to the .o's digest
                                   <key>.lock     per-key lock (filelock)
<root>/quarantine/  corrupt entries moved aside     <root>/journal.jsonl  usage journal
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from quack.cache import fsutil, keys, locks, orphans
from quack.cache.entry import Entry, EntryRef
from quack.cache.problems import warn_once, write_error
from quack.errors import CacheError, CacheWarning, CacheWriteError, LockTimeout
from quack.safejson import safe_loads

if TYPE_CHECKING:
    from quack.cache.contract import Inspection

LAYOUT = "v1"
SCRATCH = "tmp"  # <root>/tmp: helper tools' temp files (see DiskStore.scratch_dir)
META_FORMAT = 1


def local_store(s) -> "DiskStore":
    """The local store of settings ``s`` (``quack.settings.Settings``): the one
    writable Store of a process; jit, the pool and the CLI open it here."""
    return DiskStore(s.cache_dir, fsync=s.fsync, lock_timeout=s.lock_timeout)


class DiskStore:
    """The local cache on disk; implements quack.cache.contract.Store."""

    def __init__(self, root: Path, *, fsync: bool = True, lock_timeout: float = 600.0):
        root = Path(os.path.abspath(os.fspath(root)))
        if "\0" in os.fspath(root):
            raise CacheError(f"cache directory {os.fspath(root)!r} contains a NUL byte", path="")
        self.root = root
        self.fsync = fsync
        self.lock_timeout = lock_timeout
        self._checked = False

    # -- paths -----------------------------------------------------------------
    def entry_dir(self, ref: EntryRef) -> Path:
        d = (
            self.root
            / LAYOUT
            / keys.safe_component(ref.stamp)
            / keys.safe_component(ref.kernel)
            / keys.safe_component(ref.srcfp)
        )
        return fsutil.under_root(d, self.root)

    def paths(self, ref: EntryRef) -> dict[str, Path]:
        d = self.entry_dir(ref)
        k = keys.safe_component(ref.key)
        return {
            "obj": d / f"{k}.o",
            "meta": d / f"{k}.json",
            "so": d / f"{k}.so",
            "so_meta": d / f"{k}.so.json",
            "lock": d / f"{k}.lock",
        }

    def check_root(self) -> None:
        if not self._checked:
            fsutil.check_root(self.root)
            self._checked = True

    def _ensure(self, ref: EntryRef) -> Path:
        self.check_root()
        try:
            return fsutil.ensure_dir(self.entry_dir(ref), self.root)
        except CacheError:
            raise
        except OSError as e:
            raise write_error(e, self.root, f"creating {self.entry_dir(ref)}") from None

    def writable(self) -> bool:
        """Can this process create entries here? (False on a read-only mount, a
        directory without write permission, or a root that can't be created.)"""
        try:
            self.check_root()
        except OSError:
            return False
        p = self.root
        while not os.path.lexists(p):
            if p.parent == p:
                return False
            p = p.parent
        return os.access(p, os.W_OK) and not _read_only_fs(p)

    # -- reading ---------------------------------------------------------------
    def lookup(self, ref: EntryRef, *, locked: bool = False) -> Entry | None:
        """The verified entry at ``ref``, or None (a miss). A corrupt entry is moved to
        quarantine with one CacheWarning. ``locked``: the caller holds the key's lock (an
        flock is per open file: taking it again here would wait on the caller)."""
        self.check_root()
        p = self.paths(ref)
        # No symlinked or planted component between the root and the entry (raises
        # CacheError); a missing directory is a plain miss.
        if not fsutil.check_tree(p["obj"].parent, self.root):
            return None
        problem, meta = self._read(ref, p)
        if problem == "":
            return self._entry(p, ref, meta)
        if problem is None and (locked or not os.path.lexists(p["obj"])):
            return None  # not built: the common miss, decided without the lock
        if locked:
            return self._bad(ref, problem or "")
        # Check, lock, check again. A .o without metadata is a publish in progress
        # (publish removes the old metadata before renaming the new .o in: a reader
        # that took it for a miss got KernelNotPrebuilt during `quack build --force`)
        # or an interrupted one's debris; a problem may be a rebuild swapping files
        # between our reads. The publisher holds the lock: wait for it, look again.
        try:
            with self.lock(ref, timeout=min(self.lock_timeout, 10.0)):
                problem, meta = self._read(ref, p)
                if problem:
                    return self._bad(ref, problem)
                return None if problem is None else self._entry(p, ref, meta)
        except LockTimeout:
            if problem:
                warnings.warn(
                    f"quack: cache entry {ref.kernel} key {ref.key[:16]} looks corrupt "
                    f"({problem}) and its lock is held; not using it (treated as a miss)",
                    CacheWarning,
                    stacklevel=3,
                )
            return None
        except CacheWriteError:  # no lock can be taken (a read-only cache): what we read stands
            return self._bad(ref, problem) if problem else None

    def _read(self, ref: EntryRef, p: dict[str, Path]) -> tuple[str | None, dict]:
        """(problem, metadata) of the files now: problem "" if valid, None if no metadata."""
        try:
            meta_bytes = fsutil.read_nofollow(p["meta"])
        except FileNotFoundError:
            return None, {}
        except OSError as e:  # unreadable, or not a regular file (a planted FIFO)
            return f"metadata unreadable ({e})", {}
        return self._check(ref, meta_bytes, p["obj"])

    def _entry(self, p: dict[str, Path], ref: EntryRef, meta: dict) -> Entry:
        return Entry(ref, meta, p["obj"], self._verified_so(p, meta.get("sha256"), warn=True))

    def inspect(self, ref: EntryRef) -> Inspection:
        """Check one entry without changing anything (``quack verify``): no
        quarantine, no lock, no touch. Raises CacheError for an unsafe root."""
        from quack.cache.contract import CORRUPT, MISSING, OK, Inspection

        self.check_root()
        p = self.paths(ref)
        if not fsutil.check_tree(p["obj"].parent, self.root):
            return Inspection(MISSING, "", {}, p["obj"])
        problem, meta = self._read(ref, p)
        if problem is None:
            return Inspection(MISSING, "", {}, p["obj"])
        if problem:
            return Inspection(CORRUPT, problem, meta, p["obj"])
        so, so_problem = self._so_state(p, meta.get("sha256"))
        return Inspection(OK, "", meta, p["obj"], so, so_problem)

    def derived_so(self, ref: EntryRef, o_sha256: str) -> Path | None:
        """A verified .so at ``ref``'s place linked from an object with digest ``o_sha256``
        (an installed bundle's object: the .so is kept here, the object stays in the
        bundle). None if absent, stale or damaged; never raises."""
        try:
            if not fsutil.check_tree(self.entry_dir(ref), self.root):
                return None
        except (CacheError, OSError):
            return None
        return self._verified_so(self.paths(ref), o_sha256, warn=True)

    def _check(self, ref: EntryRef, meta_bytes: bytes, obj: Path) -> tuple[str, dict]:
        try:
            meta = safe_loads(meta_bytes)
            if not isinstance(meta, dict):
                raise ValueError("not an object")
        except ValueError as e:
            return f"metadata is not valid JSON ({e})", {}
        for field, want in (
            ("format", META_FORMAT),
            ("key", ref.key),
            ("kernel", ref.kernel),
            ("arch", ref.arch),
            # A stale fingerprint or toolchain directory copied or synced over the
            # current one: same key, other sources or toolchain. It loaded as current.
            ("srcfp", ref.srcfp),
            ("stamp", ref.stamp),
        ):
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

    def _verified_so(self, p: dict[str, Path], o_sha256, *, warn: bool = False) -> Path | None:
        """The .so if its sidecar ties it to the .o digest ``o_sha256`` and its bytes match,
        else None (the loader relinks it). Absent or stale is silent; damaged (truncated,
        tampered, planted) is one CacheWarning if ``warn``: it used to go unsaid."""
        so, problem = self._so_state(p, o_sha256)
        if problem and warn:  # once: quack build looks an entry up twice (plan, then report)
            warn_once(
                f"damaged-so:{p['so']}:{problem}",
                f"quack: the linked kernel {p['so']} is damaged ({problem}); not loading it: "
                f"it is linked again from its verified .o when the kernel loads",
                stacklevel=5,
            )
        return so

    def _so_state(self, p: dict[str, Path], o_sha256) -> tuple[Path | None, str]:
        """(the verified .so or None, why a .so that is there is not usable: "" when it is
        absent, stale, or fine). Reads only."""
        try:  # the sidecar first: a .so it names was renamed in before it was written
            side = safe_loads(fsutil.read_nofollow(p["so_meta"]))
            data = fsutil.read_nofollow(p["so"])
        except FileNotFoundError:
            return None, ""
        except OSError as e:  # planted: a FIFO, a symlink (ELOOP under O_NOFOLLOW); unreadable
            what = "a symbolic link (never followed)" if e.errno == errno.ELOOP else e.strerror or e
            return None, f"{what}: {e.filename}"
        except ValueError as e:
            return None, f"{p['so_meta']} is not valid JSON ({e})"
        if not isinstance(side, dict):
            return None, f"{p['so_meta']} is not a JSON object"
        if side.get("o_sha256") != o_sha256:
            return None, ""  # stale
        if hashlib.sha256(data).hexdigest() != side.get("sha256"):
            return None, f"its checksum does not match {p['so_meta'].name}: truncated or tampered"
        return p["so"], ""

    def _bad(self, ref: EntryRef, reason: str) -> Entry | None:
        try:
            where = f"moved to {self.quarantine(ref, reason)}"
        except OSError as e:  # read-only cache: can't move it, but never load it either
            where = f"could not be moved aside ({e})"
        warnings.warn(
            f"quack: cache entry {ref.kernel} key {ref.key[:16]} was corrupt ({reason}); "
            f"{where}; treated as a miss (quack build, or a call in jit mode, rebuilds it)",
            CacheWarning,
            stacklevel=3,
        )
        return None

    def quarantine(self, ref: EntryRef, reason: str) -> Path:
        qdir = fsutil.ensure_dir(self.root / "quarantine", self.root)
        tag = f"{keys.safe_component(ref.stamp)}-{keys.safe_component(ref.key)}-{int(time.time() * 1000)}"
        stem = keys.safe_component(ref.key)
        removed = []
        for name, path in self.paths(ref).items():
            if name == "lock":
                continue
            try:
                is_dir = stat.S_ISDIR(os.lstat(path).st_mode)
            except OSError:
                continue  # not there
            if is_dir:
                # A directory planted at a file's name is removed, not moved: moved into
                # quarantine/ it made every `quack cache clean` fail on it ("Is a
                # directory", exit 1) and `stats` count it for ever. Nothing inside is
                # followed (fsutil.remove_tree); what can't be removed is left, and the
                # next lookup says so again.
                try:
                    fsutil.remove_tree(path)
                    removed.append(path.name)
                except OSError:
                    pass
                continue
            try:  # a regular file, a link or a FIFO: moved as it is, never followed nor opened
                os.replace(path, qdir / f"{tag}{path.name[len(stem) :]}")
            except FileNotFoundError:
                pass
            except OSError:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        if removed:
            reason += f" ({', '.join(removed)}: a directory, removed rather than kept here)"
        fsutil.write_atomic(qdir / f"{tag}.reason", reason.encode(), fsync=False)
        return qdir / tag

    # -- writing ---------------------------------------------------------------
    @contextmanager
    def lock(self, ref: EntryRef, timeout: float | None = None) -> Iterator[None]:
        self._ensure(ref)
        with locks.hold(
            self.paths(ref)["lock"], self.lock_timeout if timeout is None else timeout, self.root
        ):
            yield

    def claim(self, ref: EntryRef) -> int | None:
        """The key's lock taken now, without waiting, as a descriptor the caller owns
        (quack.cache.locks.try_claim); None when another process holds it."""
        self._ensure(ref)
        return locks.try_claim(self.paths(ref)["lock"], self.root)

    def tmp_obj(self, ref: EntryRef) -> Path:
        """A fresh, already-created (O_EXCL, no-follow) temp file for the .o."""
        self._ensure(ref)
        try:
            return fsutil.reserve_tmp(self.paths(ref)["obj"])
        except OSError as e:
            raise write_error(e, self.root, f"creating a temp file in {self.entry_dir(ref)}") from None

    def publish(self, ref: EntryRef, tmp_obj: Path, meta: dict) -> Entry:
        """Move a finished temp .o into place, metadata last. Caller holds the lock."""
        p = self.paths(ref)
        try:
            data = fsutil.read_nofollow(tmp_obj)
            meta = dict(
                meta,
                format=META_FORMAT,
                key=ref.key,
                kernel=ref.kernel,
                arch=ref.arch,
                stamp=ref.stamp,
                srcfp=ref.srcfp,
                size=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
                created=meta.get("created", time.time()),
            )
            # An older entry's metadata must go first: a reader pairing it with the
            # new .o would see a checksum mismatch.
            for old in ("meta", "so_meta"):
                try:
                    os.unlink(p[old])
                except FileNotFoundError:
                    pass
            # Durability order: temp written + fsynced, renamed, directory fsynced;
            # then the metadata the same way. A crash anywhere leaves either the old
            # state, or a .o without metadata (a miss; swept as debris).
            fsutil.publish_file(tmp_obj, p["obj"], fsync=self.fsync)
            fsutil.write_atomic(
                p["meta"], json.dumps(meta, sort_keys=True, indent=1).encode(), fsync=self.fsync
            )
        except BaseException as e:
            try:
                os.unlink(tmp_obj)
            except FileNotFoundError:
                pass
            if isinstance(e, OSError) and not isinstance(e, CacheError):
                # The .o may be in place without metadata: take it back out so nothing
                # partial is left (a .o without metadata is only a miss, but tidy).
                if not os.path.lexists(p["meta"]):
                    try:
                        os.unlink(p["obj"])
                    except OSError:
                        pass
                raise write_error(e, self.root, f"publishing {ref.kernel} key {ref.key[:16]}") from None
            raise
        return Entry(ref, meta, p["obj"], None)

    def write_so(self, entry: Entry, tmp_so: Path) -> Path:
        p = self.paths(entry.ref)
        data = fsutil.read_nofollow(tmp_so)
        fsutil.publish_file(tmp_so, p["so"], fsync=False)
        side = {"o_sha256": entry.meta["sha256"], "sha256": hashlib.sha256(data).hexdigest()}
        fsutil.write_atomic(p["so_meta"], json.dumps(side).encode(), fsync=False)
        return p["so"]

    def scratch_dir(self) -> Path:
        """``<root>/tmp`` (0700, no symlinked component): where helper tools write their
        temp files (the linker's ``cc*.o``, ``cc*.res``), so one killed mid-way leaves its
        debris inside the cache, swept by ``quack cache clean``, never in /tmp.
        Raises CacheError (unsafe root, planted link) or CacheWriteError."""
        self.check_root()
        try:
            return fsutil.ensure_dir(self.root / SCRATCH, self.root)
        except CacheError:
            raise
        except OSError as e:
            raise write_error(e, self.root, f"creating {self.root / SCRATCH}") from None

    def sweep_debris(self, *, grace: float = orphans.GRACE, dry_run: bool = False) -> list[Path]:
        """Remove what interrupted writers left, by the one rule of
        quack.cache.orphans (temps of dead writers or over an hour old; objects
        without metadata whose key lock is free; all at least ``grace`` s old).
        Never removes lock files, never follows a symlink. Returns the removed
        (or, dry run, removable) paths."""
        base = self.root / LAYOUT
        removed: list[Path] = []
        if not fsutil.check_tree(self.root, self.root) or not os.path.lexists(base):
            return removed
        fsutil.check_tree(base, self.root)
        now = time.time()
        for dirpath, _dirnames, _filenames in os.walk(base, followlinks=False):
            removed += [
                p for p, _, _ in orphans.sweep_dir(Path(dirpath), grace=grace, now=now, dry_run=dry_run)
            ]
        return removed

    def touch(self, entry: Entry) -> None:
        """Record use (LRU for ``quack cache clean --max-size``): the metadata's mtime."""
        try:
            os.utime(self.paths(entry.ref)["meta"], follow_symlinks=False)
        except OSError:
            pass  # read-only cache: use still works, LRU order just ages


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False
