"""The source-fingerprint memo: fingerprints that outlive the process.

A kernel's fingerprint (keys.source_fingerprint) parses the kernel's module and
the helpers it imports and hashes their bytes: 5-20 ms per family, paid again
by every fresh process. The memo keeps, per (module, its file, the kernel's
depends_on), the fingerprint with the stat signature (size, mtime_ns, ctime_ns,
inode, device) of every file it covers, of the directories they live in (a module
appearing there could change what an import resolves to) and of the METADATA file of
every installed distribution it names with its version (an upgrade renames the
dist-info directory, a reinstall rewrites the file). A lookup re-stats them, never
re-walks the imports; any difference is a miss and the fingerprint is computed again. ctime can't be set back by a user
(utime, ``cp -p``, ``git`` keep or choose mtime, never ctime), so an edit that
keeps size and mtime is still seen.

Racy edits: a file changed within RACY_NS of the computation could have changed
while it was read, in the same timestamp tick; such a result is used by this
process but not recorded, so the next process computes it again.

File: one per record, <root>/srcfp/<toolchain tag>/<hash of module@file>.memo (JSON),
written atomically at exit (one write per new record), read one file per lookup: a
cache shared by many checkouts (one record each) costs a fresh process what one
record costs. (A single file of every record, the first layout, cost 14-19 ms to read
and check at 1024 records, on every first kernel of every process.) A damaged record
is a miss plus one warning and is rewritten; one that can't be written costs only
time. Trust: the memo lives in the cache directory, which already holds the
objects we load; its checks (owner, mode, no symlinks) are the store's.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import threading
import warnings
from pathlib import Path

from quack.cache import fsutil, keys, sources
from quack.errors import CacheError, CacheWarning
from quack.safejson import safe_loads

# 1: every record in one file <root>/srcfp/<tag>.memo (removed when seen). 2: files
# of the kernel's own package only. 3: every file outside the standard library and the
# installed distributions, and those distributions (issue 24): an older record is a plain
# miss, rewritten, since it covers less than a fingerprint must.
FORMAT = 3
DIRNAME = "srcfp"
RACY_NS = 1_000_000_000
MAX_RECORDS = 1024  # per toolchain; the oldest files go first: one per (kernel module, checkout)
SUFFIX = ".memo"  # not .json: tools take every *.json outside logs/ for entry metadata

log = logging.getLogger("quack.fpmemo")


def _sig(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _valid_record(rec) -> bool:
    """Shape check of one record as read from disk: anything else is damage."""
    if not isinstance(rec, dict) or not isinstance(rec.get("fp"), str) or len(rec["fp"]) != 16:
        return False
    files, dirs, dists = rec.get("files"), rec.get("dirs"), rec.get("dists")
    if not isinstance(files, list) or not files or not isinstance(dirs, list) or not isinstance(dists, list):
        return False
    for d in dists:
        if not (
            isinstance(d, list)
            and len(d) == 8
            and all(isinstance(x, str) for x in d[:3])
            and all(isinstance(x, int) for x in d[3:])
        ):
            return False
    for f in files:
        if not (
            isinstance(f, list)
            and len(f) == 7
            and isinstance(f[0], str)
            and isinstance(f[1], str)
            and all(isinstance(x, int) for x in f[2:])
        ):
            return False
    for d in dirs:
        if not (
            isinstance(d, list)
            and len(d) == 6
            and isinstance(d[0], str)
            and all(isinstance(x, int) for x in d[1:])
        ):
            return False
    return True


class DiskFingerprintMemo:
    """keys.FingerprintMemo kept in a cache directory. Thread-safe; never raises."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.dir = self.root / DIRNAME / keys.safe_component(keys.toolchain_tag())
        self._lock = threading.Lock()
        self._records: dict[str, dict | None] = {}  # id -> record read (None: none usable)
        self._dir_ok: bool | None = None  # the directory checked once (no symlinks planted)
        self._dirty: dict[str, dict] = {}
        self._warned = False
        self.hits = self.misses = 0

    @staticmethod
    def _id(module: str, origin: Path | str, depends_on: tuple[str, ...] = ()) -> str:
        # depends_on is part of the identity: two kernels of one module may declare
        # different extra files.
        deps = "".join(f"|{d}" for d in depends_on)
        return f"{module}@{os.path.abspath(origin)}{deps}"

    def path(self, module: str, origin: Path | str, depends_on: tuple[str, ...] = ()) -> Path:
        """The file of the record of ``module`` loaded from ``origin``."""
        return self._path(self._id(module, origin, tuple(depends_on)))

    def _path(self, ident: str) -> Path:
        return self.dir / (hashlib.sha256(ident.encode()).hexdigest()[:32] + SUFFIX)

    def _usable_dir(self) -> bool:
        if self._dir_ok is None:
            try:
                fsutil.check_root(self.root)
                self._dir_ok = fsutil.check_tree(self.dir, self.root)
            except CacheError as e:  # a planted symlink: the store refuses the cache too
                log.debug("fingerprint memo not used: %s", e)
                self._dir_ok = False
            except OSError as e:  # e.g. a file where the directory should be
                log.debug("fingerprint memo not used: %s", e)
                self._dir_ok = False
        return self._dir_ok

    def _read(self, ident: str) -> dict | None:
        """The record on disk (None when absent, unreadable, another toolchain's, of an
        older format or damaged: damage is one warning per process)."""
        if not self._usable_dir():
            return None
        path = self._path(ident)
        try:
            doc = safe_loads(fsutil.read_nofollow(path))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            self._damaged(path, f"unreadable ({e})")
            return None
        fmt = doc.get("format") if isinstance(doc, dict) else None
        if isinstance(fmt, int) and 0 < fmt < FORMAT:
            return None  # superseded, not damaged: computed again and rewritten
        if fmt != FORMAT:
            self._damaged(path, "not a fingerprint memo record of this format")
            return None
        if doc.get("toolchain") != keys.toolchain():
            return None  # another toolchain behind the same tag (a Python patch release)
        if doc.get("id") != ident or not _valid_record(doc):
            self._damaged(path, "the record is malformed")
            return None
        return doc

    def _damaged(self, path: Path, why: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"quack: the source-fingerprint memo {path} is damaged ({why}); "
                f"the fingerprint is computed from the sources and the record rewritten",
                CacheWarning,
                stacklevel=5,
            )

    def lookup(
        self, module: str, origin: Path, depends_on: tuple[str, ...] = ()
    ) -> tuple[sources.Coverage, str] | None:
        try:
            k = self._id(module, origin, tuple(depends_on))
            with self._lock:
                if k not in self._records:
                    self._records[k] = self._read(k)
                rec = self._records[k]
            if rec is None:
                self._miss(module, "no record")
                return None
            files: dict[str, Path] = {}
            for name, path, *sig in rec["files"]:
                if _sig(path) != sig:
                    self._miss(module, f"{path} changed")
                    return None
                files[name] = Path(path)
            dists: dict[str, tuple[str, Path]] = {}
            for name, version, path, *sig in rec["dists"]:
                if _sig(path) != sig:
                    self._miss(module, f"distribution {name} changed ({path})")
                    return None
                dists[name] = (version, Path(path))
            for path, *sig in rec["dirs"]:
                if _sig(path) != sig:
                    self._miss(module, f"directory {path} changed")
                    return None
            if files.get(module) != Path(origin):
                self._miss(module, "record names another file")
                return None
            self.hits += 1
            log.debug("source fingerprint of %s from the memo", module)
            return sources.Coverage(files, dists, {Path(d[0]) for d in rec["dirs"]}), rec["fp"]
        except Exception as e:  # noqa: BLE001 - a memo problem must only cost the recompute
            self._miss(module, f"memo error {type(e).__name__}: {e}")
            return None

    def _miss(self, module: str, why: str) -> None:
        self.misses += 1
        log.debug("source fingerprint of %s computed (%s)", module, why)

    def record(
        self, module: str, cov: sources.Coverage, fp: str, started_ns: int, depends_on: tuple[str, ...] = ()
    ) -> None:
        try:
            limit = started_ns - RACY_NS

            def fresh(p: str) -> list[int] | None:  # None: gone, or changed too recently
                sig = _sig(p)
                return None if sig is None or max(sig[1], sig[2]) >= limit else sig

            fl: list[list] = []
            dl: list[list] = []
            dirnames = {os.path.abspath(d) for d in cov.dirs}
            for name, path in sorted(cov.files.items()):
                p = os.path.abspath(path)
                sig = fresh(p)
                if sig is None:
                    return  # to be sure what was read
                fl.append([name, p, *sig])
                dirnames.add(os.path.dirname(p))
            for name, (version, meta) in sorted(cov.dists.items()):
                sig = fresh(os.path.abspath(meta))
                if sig is None:
                    return
                dl.append([name, version, os.path.abspath(meta), *sig])
            dirs: dict[str, list[int]] = {}
            for d in sorted(dirnames):
                dsig = fresh(d)
                if dsig is None:
                    return
                dirs[d] = dsig
            origin = cov.files.get(module)
            if origin is None:
                return
            k = self._id(module, origin, tuple(depends_on))
            # (No time stamp: the record's age, for pruning, is its file's mtime.)
            rec = {"fp": fp, "files": fl, "dists": dl, "dirs": [[d, *ds] for d, ds in dirs.items()]}
            with self._lock:
                self._records[k] = rec
                self._dirty[k] = rec
            _register_flush()
        except Exception as e:  # noqa: BLE001
            log.debug("not memoizing the fingerprint of %s: %s", module, e)

    def flush(self) -> bool:
        """Write this process's new records, each atomically to its own file; then drop
        the oldest files beyond MAX_RECORDS. True if a record was written."""
        with self._lock:
            if not self._dirty:
                return False
            dirty, self._dirty = self._dirty, {}
        wrote = False
        try:
            if not self.root.is_dir():
                return False
            fsutil.check_root(self.root)
            fsutil.ensure_dir(self.dir, self.root)
            for k, rec in dirty.items():
                doc = {"format": FORMAT, "toolchain": keys.toolchain(), "id": k, **rec}
                data = json.dumps(doc, separators=(",", ":")).encode()
                fsutil.write_atomic(self._path(k), data, fsync=False)
                wrote = True
            self._prune()
        except (OSError, ValueError) as e:  # read-only / full cache: the memo only saves time
            log.debug("fingerprint memo %s not written: %s", self.dir, e)
        return wrote

    def _prune(self) -> None:
        # The first layout's single file of this toolchain: its records are rewritten
        # one by one as processes compute them.
        old = self.root / DIRNAME / (self.dir.name + SUFFIX)
        if os.path.isfile(old) and not os.path.islink(old):
            old.unlink(missing_ok=True)
        names = [e for e in os.scandir(self.dir) if e.name.endswith(SUFFIX)]
        if len(names) <= MAX_RECORDS:
            return
        by_age = sorted(names, key=lambda e: e.stat(follow_symlinks=False).st_mtime_ns)
        for e in by_age[: len(names) - MAX_RECORDS]:
            try:
                os.unlink(e.path)
            except FileNotFoundError:  # another process pruned it first
                pass


_memos: dict[str, DiskFingerprintMemo] = {}
_flush_registered = False


def for_root(root: Path) -> DiskFingerprintMemo:
    """The process-wide memo of the cache at ``root``."""
    k = os.path.abspath(os.fspath(root))
    m = _memos.get(k)
    if m is None:
        m = _memos.setdefault(k, DiskFingerprintMemo(Path(k)))
    return m


def _register_flush() -> None:
    global _flush_registered
    if not _flush_registered:
        _flush_registered = True
        atexit.register(flush_all)


def flush_all() -> None:
    """Write every memo with new records (at exit: one write per record, off the hot path)."""
    for m in list(_memos.values()):
        m.flush()
