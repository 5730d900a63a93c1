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

File: <root>/srcfp/<toolchain tag>.memo (JSON), written atomically at exit (one write
per process, merged with what other processes wrote meanwhile). A damaged file is
a miss plus one warning and is rewritten; one that can't be written costs only
time. Trust: the memo lives in the cache directory, which already holds the
objects we load; its checks (owner, mode, no symlinks) are the store's.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
import warnings
from pathlib import Path

from quack.cache import fsutil, keys
from quack.errors import CacheError, CacheWarning

FORMAT = 1
DIRNAME = "srcfp"
RACY_NS = 1_000_000_000
MAX_RECORDS = 1024  # oldest dropped first: one per (kernel module, checkout) in use

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
    if not isinstance(rec.get("t"), int):
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
        # Not .json: tools take every *.json outside logs/ for entry metadata.
        self.path = self.root / DIRNAME / f"{keys.safe_component(keys.toolchain_tag())}.memo"
        self._lock = threading.Lock()
        self._records: dict[str, dict] | None = None  # read on first lookup
        self._dirty: dict[str, dict] = {}
        self._warned = False
        self.hits = self.misses = 0

    @staticmethod
    def _id(module: str, origin: Path | str) -> str:
        return f"{module}@{os.fspath(origin)}"

    def _read(self) -> dict[str, dict]:
        """The records on disk ({} when absent, unreadable or damaged: one warning)."""
        try:
            fsutil.check_root(self.root)
            if not fsutil.check_tree(self.path.parent, self.root):
                return {}
            data = json.loads(fsutil.read_nofollow(self.path))
        except FileNotFoundError:
            return {}
        except CacheError as e:  # a planted symlink: the store refuses the cache too
            log.debug("fingerprint memo not used: %s", e)
            return {}
        except (OSError, ValueError) as e:
            self._damaged(f"unreadable ({e})")
            return {}
        if (
            not isinstance(data, dict)
            or data.get("format") != FORMAT
            or not isinstance(data.get("records"), dict)
        ):
            self._damaged("not a fingerprint memo of this format")
            return {}
        if data.get("toolchain") != keys.toolchain():
            return {}  # another toolchain behind the same tag (a Python patch release): start over
        out = {}
        for k, rec in data["records"].items():
            if _valid_record(rec):
                out[k] = rec
            else:
                self._damaged(f"record {k[:80]!r} is malformed")
        return out

    def _damaged(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"quack: the source-fingerprint memo {self.path} is damaged ({why}); "
                f"fingerprints are computed from the sources and the memo is rewritten",
                CacheWarning,
                stacklevel=5,
            )
        self._dirty.setdefault("", {})  # forces a rewrite at exit even without new records

    def lookup(self, module: str, origin: Path) -> tuple[dict[str, Path], str] | None:
        try:
            with self._lock:
                if self._records is None:
                    self._records = self._read()
                rec = self._records.get(self._id(module, origin))
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
            rec = {"fp": fp, "t": time.time_ns(), "files": fl, "dirs": list(dirs.values())}
            with self._lock:
                if self._records is None:
                    self._records = self._read()
                k = self._id(module, os.path.abspath(origin))
                self._records[k] = rec
                self._dirty[k] = rec
            _register_flush()
        except Exception as e:  # noqa: BLE001
            log.debug("not memoizing the fingerprint of %s: %s", module, e)

    def flush(self) -> bool:
        """Merge this process's records into the file (atomic replace). True if written."""
        with self._lock:
            if not self._dirty:
                return False
            dirty, self._dirty = self._dirty, {}
        dirty.pop("", None)
        try:
            if not self.root.is_dir():
                return False
            fsutil.check_root(self.root)
            fsutil.ensure_dir(self.path.parent, self.root)
            warned, self._warned = self._warned, True  # damage already reported (or not ours to)
            merged = self._read()
            self._warned = warned
            merged.update(dirty)
            if len(merged) > MAX_RECORDS:
                keep = sorted(merged.items(), key=lambda kv: kv[1]["t"])[-MAX_RECORDS:]
                merged = dict(keep)
            doc = {"format": FORMAT, "toolchain": keys.toolchain(), "records": merged}
            fsutil.write_atomic(self.path, json.dumps(doc, separators=(",", ":")).encode(), fsync=False)
            return True
        except (OSError, ValueError) as e:  # read-only / full cache: the memo only saves time
            log.debug("fingerprint memo %s not written: %s", self.path, e)
            return False


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
    """Write every memo with new records (at exit: one write per cache, off the hot path)."""
    for m in list(_memos.values()):
        m.flush()
