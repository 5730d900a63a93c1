"""The source-fingerprint memo: fingerprints that outlive the process.

A kernel's fingerprint (keys.source_fingerprint) parses the kernel's module and
the helpers it imports and hashes their bytes: 5-20 ms per family, paid again
by every fresh process. The memo keeps, per (module, its file), the fingerprint
with the stat signature (size, mtime_ns, ctime_ns, inode, device) of every file
it covers and of the directories they live in (a module appearing there could
change what an import resolves to). A lookup re-stats them; any difference is a
miss and the fingerprint is computed again. ctime can't be set back by a user
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

from quack.cache import fsutil, keys
from quack.errors import CacheError, CacheWarning

FORMAT = 2  # 1: every record in one file <root>/srcfp/<tag>.memo (removed when seen)
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
    files, dirs = rec.get("files"), rec.get("dirs")
    if not isinstance(files, list) or not files or not isinstance(dirs, list):
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
    def _id(module: str, origin: Path | str) -> str:
        return f"{module}@{os.fspath(origin)}"

    def path(self, module: str, origin: Path | str) -> Path:
        """The file of the record of ``module`` loaded from ``origin``."""
        ident = self._id(module, os.path.abspath(origin))
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

    def _read(self, module: str, origin: Path | str) -> dict | None:
        """The record on disk (None when absent, unreadable, another toolchain's or
        damaged: damage is one warning per process)."""
        if not self._usable_dir():
            return None
        path = self.path(module, origin)
        try:
            doc = json.loads(fsutil.read_nofollow(path))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            self._damaged(path, f"unreadable ({e})")
            return None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            self._damaged(path, "not a fingerprint memo record of this format")
            return None
        if doc.get("toolchain") != keys.toolchain():
            return None  # another toolchain behind the same tag (a Python patch release)
        if doc.get("id") != self._id(module, os.path.abspath(origin)) or not _valid_record(doc):
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

    def lookup(self, module: str, origin: Path) -> tuple[dict[str, Path], str] | None:
        try:
            k = self._id(module, os.path.abspath(origin))
            with self._lock:
                if k not in self._records:
                    self._records[k] = self._read(module, origin)
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
            for path, *sig in rec["dirs"]:
                if _sig(path) != sig:
                    self._miss(module, f"directory {path} changed")
                    return None
            if files.get(module) != Path(origin):
                self._miss(module, "record names another file")
                return None
            self.hits += 1
            log.debug("source fingerprint of %s from the memo", module)
            return files, rec["fp"]
        except Exception as e:  # noqa: BLE001 - a memo problem must only cost the recompute
            self._miss(module, f"memo error {type(e).__name__}: {e}")
            return None

    def _miss(self, module: str, why: str) -> None:
        self.misses += 1
        log.debug("source fingerprint of %s computed (%s)", module, why)

    def record(self, module: str, files: dict[str, Path], fp: str, started_ns: int) -> None:
        try:
            limit = started_ns - RACY_NS
            fl, dirs = [], {}
            for name, path in sorted(files.items()):
                p = os.path.abspath(path)
                sig = _sig(p)
                if sig is None or max(sig[1], sig[2]) >= limit:
                    return  # gone, or changed too recently to be sure what was read
                fl.append([name, p, *sig])
                d = os.path.dirname(p)
                if d not in dirs:
                    dsig = _sig(d)
                    if dsig is None or max(dsig[1], dsig[2]) >= limit:
                        return
                    dirs[d] = [d, *dsig]
            origin = files.get(module)
            if origin is None:
                return
            k = self._id(module, os.path.abspath(origin))
            # (No time stamp: the record's age, for pruning, is its file's mtime.)
            rec = {"fp": fp, "files": fl, "dirs": list(dirs.values())}
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
                module, _, origin = k.partition("@")
                doc = {"format": FORMAT, "toolchain": keys.toolchain(), "id": k, **rec}
                data = json.dumps(doc, separators=(",", ":")).encode()
                fsutil.write_atomic(self.path(module, origin), data, fsync=False)
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
