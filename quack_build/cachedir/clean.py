"""``quack cache clean``: remove stale fingerprints, quarantined entries, debris and old
build logs; on request every entry, those unused for a while, or the least recently
used beyond a size; safely while other processes use the cache (``Cleaner``). What is
there comes from quack_build.cachedir.walk's walk."""

from __future__ import annotations

import dataclasses
import os
import stat
import time
from pathlib import Path
from typing import Callable

from quack.cache import fsutil, orphans
from quack.cache.store import LAYOUT
from quack_build.cachedir.walk import (
    DIRECTORY,
    LOG_NAME,
    SCRATCH_MAX_AGE,
    FpDir,
    KeyFiles,
    planted,
    quarantine_files,
    scratch_files,
    walk,
)


@dataclasses.dataclass
class Removal:
    path: Path
    bytes: int
    why: str


@dataclasses.dataclass
class CleanReport:
    removed: list = dataclasses.field(default_factory=list)  # Removal
    busy: list = dataclasses.field(default_factory=list)  # (path, why) skipped: in use
    errors: list = dataclasses.field(default_factory=list)  # (path, error)

    @property
    def freed(self) -> int:
        return sum(r.bytes for r in self.removed)


class Cleaner:
    """Removes cache files safely while other processes use the cache.

    - An entry is removed only under its per-key lock, taken without waiting:
      a key being compiled or published is skipped ("busy"). Readers are safe
      anyway (an unlinked file stays readable through open descriptors).
    - Lock files are unlinked only in stale directories (a current
      fingerprint's lock may be waited on by a process about to compile).
    - Debris (temps of dead writers, objects without metadata) goes by the one
      rule of quack.cache.orphans."""

    def __init__(self, root: Path, *, dry_run: bool = False, log: Callable[[Removal], None] | None = None):
        self.root = Path(root)
        self.dry_run = dry_run
        self.report = CleanReport()
        self.log = log
        # A file two rules reach (a .so without its sidecar in an entry --all removes)
        # is removed, and counted, once: a dry run listed it twice.
        self._done: set[Path] = set()

    def _unlink(self, path: Path, size: int, why: str) -> None:
        def unlink() -> int:
            os.unlink(path)
            return size

        self._remove(path, why, unlink, lambda: size)

    def _rmtree(self, path: Path, why: str) -> None:
        """Remove a directory planted where the cache has a file, with what it holds;
        no link in it is followed (quack.cache.fsutil.remove_tree). Unlinking it failed
        ("Is a directory") and made every clean exit 1."""
        self._remove(path, why, lambda: fsutil.remove_tree(path), lambda: fsutil.tree_bytes(path))

    def _remove(self, path: Path, why: str, remove: Callable[[], int], size: Callable[[], int]) -> None:
        """Remove ``path`` once (``remove()`` -> the bytes freed; a dry run only measures:
        ``size()``), recorded and logged; gone already is nothing, a failure an error."""
        if path in self._done:
            return
        self._done.add(path)
        if self.dry_run:
            freed = size()
        else:
            try:
                freed = remove()
            except FileNotFoundError:
                return
            except OSError as e:
                self.report.errors.append((path, e.strerror or str(e)))
                return
        r = Removal(path, freed, why)
        self.report.removed.append(r)
        if self.log:
            self.log(r)

    def remove_key(self, d: FpDir, kf: KeyFiles, why: str, *, drop_lock: bool) -> bool:
        lock_path = d.path / f"{kf.key}.lock"
        lk = None
        if not self.dry_run:
            try:
                lk = orphans.try_lock(lock_path)
            except OSError as e:  # not "busy": a read-only cache, no permission, a full disk
                self.report.errors.append((lock_path, e.strerror or str(e)))
                return False
            if lk is None:
                self.report.busy.append((d.path / f"{kf.key}.o", "locked by another process"))
                return False
        try:
            # Metadata first: a reader never pairs stale metadata with a missing object.
            for suf in (".json", ".so.json", ".so", ".o"):
                if suf in kf.sizes:
                    self._unlink(d.path / f"{kf.key}{suf}", kf.sizes[suf], why)
            if drop_lock and (lk is not None or ".lock" in kf.sizes):
                self._unlink(lock_path, 0, why)
        finally:
            if lk is not None:
                lk.release()
        return True

    def remove_dir(self, d: FpDir, why: str) -> None:
        """A whole stale fingerprint directory: entries under their locks, then the rest."""
        now = time.time()
        all_done = True
        for kf in d.keys.values():
            all_done &= self.remove_key(d, kf, why, drop_lock=True)
        for path, pid, size, mtime in d.tmps:
            if orphans.tmp_is_orphan(pid, mtime, now):
                self._unlink(path, size, "orphaned temp file")
            else:
                all_done = False
                self.report.busy.append((path, f"temp file of live process {pid}"))
        if all_done and not self.dry_run:
            _rmdirs(d.path, self.root)

    def debris(self, d: FpDir, *, drop_locks: bool) -> None:
        """Temp files of dead writers, interrupted publishes (quack.cache.orphans),
        and with ``drop_locks`` lock files of keys that have no other file."""
        orphans.sweep_dir(d.path, remove=self._unlink)  # _unlink itself honours dry_run
        if not drop_locks:
            return
        for kf in list(d.keys.values()):
            if not [s for s in kf.sizes if s != ".lock"]:  # (a bundle's derived .so has data: kept)
                self._unlink(d.path / f"{kf.key}.lock", 0, "orphaned lock file")

    def quarantine(self) -> None:
        for path, size, _ in quarantine_files(self.root):
            try:
                is_dir = stat.S_ISDIR(os.lstat(path).st_mode)
            except FileNotFoundError:
                continue
            except OSError:
                is_dir = False  # the unlink reports why
            if is_dir:  # a planted directory an older quack moved here whole
                self._rmtree(path, "quarantined (corrupt) entry")
            else:
                self._unlink(path, size, "quarantined (corrupt) entry")
        if not self.dry_run:
            try:
                os.rmdir(self.root / "quarantine")
            except OSError:
                pass


def _rmdirs(path: Path, root: Path) -> None:
    """rmdir ``path`` and then its empty parents, up to the layout directory."""
    stop = (Path(root) / LAYOUT).resolve()
    p = Path(path)
    while p.resolve() != stop and stop in p.resolve().parents:
        try:
            os.rmdir(p)
        except OSError:
            return
        p = p.parent


LOG_MAX_AGE = 7 * 86400.0


def unwritable(root: Path) -> str:
    """Why nothing can be removed from the cache directory ``root`` ("" when it can be
    written): "read-only file system" or "permission denied". Asked before cleaning:
    otherwise each key's lock failed to open, and every entry was reported busy."""
    try:
        if os.statvfs(root).f_flag & os.ST_RDONLY:
            return "read-only file system"
    except OSError:
        pass
    if not os.access(root, os.W_OK | os.X_OK):
        return "permission denied"
    return ""


def clean(
    root: Path,
    current_srcfp: dict[str, str] | None = None,
    *,
    remove_all: bool = False,
    max_size: int | None = None,
    older_than: float | None = None,
    dry_run: bool = False,
    log: Callable[[Removal], None] | None = None,
) -> CleanReport:
    """``quack cache clean``: stale fingerprints, quarantine and debris by default;
    ``remove_all`` every entry; ``older_than`` entries unused for that many seconds;
    ``max_size`` least recently used entries until the cache fits."""
    c = Cleaner(root, dry_run=dry_run, log=log)
    now = time.time()
    # Planted links and files first (what the store refuses and its messages tell the
    # user to clean): unlinked, never followed; a directory at a file's name is removed
    # with what it holds, following no link in it.
    for path, what in planted(root):
        if what == DIRECTORY:
            c._rmtree(path, f"planted {what} (no link in it followed)")
            continue
        link = what == "symbolic link"
        try:
            size = 0 if link else os.lstat(path).st_size
        except OSError:
            continue
        if link or not os.path.isdir(path):
            c._unlink(path, size, f"planted {what} (never {'followed' if link else 'opened'})")
    kept: list[tuple[FpDir, KeyFiles]] = []
    for d in walk(root, current_srcfp):
        if d.status == "stale":
            c.remove_dir(d, f"stale fingerprint ({d.why})")
            continue
        c.debris(d, drop_locks=False)
        for kf in d.keys.values():
            if kf.bundle_so and (remove_all or older_than is not None and now - kf.last_use > older_than):
                c.remove_key(d, kf, "derived .so of a bundle entry (relinked on next use)", drop_lock=False)
            if not kf.complete:
                continue
            if remove_all:
                c.remove_key(d, kf, "--all", drop_lock=False)
            elif older_than is not None and now - kf.last_use > older_than:
                c.remove_key(d, kf, f"unused for {(now - kf.last_use) / 86400:.1f} days", drop_lock=False)
            else:
                kept.append((d, kf))
    c.quarantine()
    for path, size, mtime in scratch_files(root):
        if now - mtime > SCRATCH_MAX_AGE:
            c._unlink(path, size, "temp file of a killed link")
    logs = Path(root) / "logs"
    if logs.is_dir() and not logs.is_symlink():  # a planted link (or file) is unlinked above
        for e in os.scandir(logs):
            if not LOG_NAME.fullmatch(e.name):
                continue  # not a build log of ours: a shared root's other tool (issue 27)
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if remove_all or now - st.st_mtime > LOG_MAX_AGE:
                c._unlink(Path(e.path), st.st_size, "old build log")
    if max_size is not None:
        total = sum(kf.bytes for _, kf in kept)
        for d, kf in sorted(kept, key=lambda x: x[1].last_use):
            if total <= max_size:
                break
            if c.remove_key(d, kf, "--max-size (least recently used)", drop_lock=False):
                total -= kf.bytes
    return c.report
