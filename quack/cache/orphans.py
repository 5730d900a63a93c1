"""The one routine that removes what interrupted writers left in a cache
directory, and its one age rule. Used by ``DiskStore.sweep_debris``,
``quack cache clean`` (quack_build.cachedir.walk) and ``quack build`` after Ctrl-C
(quack_build.build.scheduler).

The rule: a file an interrupted writer left is debris once it is at least
``grace`` seconds old and its writer is provably gone:

* a temp file ``<name>.tmp-<pid>-<rand>``: its writer's pid is dead; or, since
  no lock covers a temp file (and a pid may live in another pid namespace),
  whoever wrote it, once it is over ``TMP_MAX_AGE``;
* an object without metadata (an interrupted publish): its key's lock is free
  (taken without waiting; a publish holds it between its two renames). It is
  removed under that lock, with the derived .so and sidecar;
* a derived .so without its sidecar ``.so.json`` (a link whose sidecar write failed,
  e.g. the disk filled between the two): unverifiable, so never loaded, and nothing
  else removes it. Removed under its key's lock, like an object without metadata.

``grace`` (default ``GRACE``, a minute) spares files whose writer may just
have died and whose pid may be reused; callers that know the writer is dead
(the build that killed its own workers, tests) pass 0, and the build names its
workers' pids (``writers_gone``) once it has seen them end. Lock files are never
removed here, symlinks are never followed or removed."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Callable, Collection

from quack.cache import fsutil

TMP_MAX_AGE = 3600.0  # a temp file this old is debris whoever wrote it
GRACE = 60.0  # a gone writer's file is spared this long

#: (path, size in bytes, why) for each file removed (or, dry run, removable).
Remover = Callable[[Path, int, str], None]


def tmp_is_orphan(pid: int, mtime: float, now: float, grace: float = GRACE) -> bool:
    """The age rule for a temp file written by ``pid`` last modified at ``mtime``."""
    age = now - mtime
    if age > TMP_MAX_AGE:
        return True
    return age >= grace and not fsutil.pid_alive(pid)


def _unlink_quiet(path: Path, size: int, why: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def sweep_dir(
    d: Path,
    *,
    stems: Collection[str] | None = None,
    grace: float = GRACE,
    now: float | None = None,
    remove: Remover | None = None,
    dry_run: bool = False,
    writers_gone: Collection[int] = (),
) -> list[tuple[Path, int, str]]:
    """Remove the debris of one fingerprint directory (only keys in ``stems``, if
    given). ``remove`` does the unlinking (default: quiet unlink; a dry run calls
    nothing). ``writers_gone``: pids the caller knows ended (the build's own workers,
    killed and waited for): their temp files are debris whatever their age, without
    asking whether the pid lives (it may already name another process). Returns
    (path, size, why) for each file removed or removable."""
    now = time.time() if now is None else now
    out: list[tuple[Path, int, str]] = []

    def drop(path: Path, size: int, why: str) -> None:
        out.append((path, size, why))
        if not dry_run:
            (remove or _unlink_quiet)(path, size, why)

    try:
        names = sorted(os.listdir(d))
    except OSError:
        return out
    present = set(names)
    seen: set[str] = set()
    for name in names:
        path = d / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
            continue  # never ours; `quack verify` reports it, we never follow it
        pid = fsutil.tmp_owner_pid(name)
        stem = name.split(".", 1)[0]
        if stems is not None and stem not in stems:
            continue
        if pid is not None:
            if pid in writers_gone or tmp_is_orphan(pid, st.st_mtime, now, grace):
                drop(path, st.st_size, "orphaned temp file")
        elif stem in seen or now - st.st_mtime < grace:
            continue
        elif name.endswith(".o") and f"{stem}.json" not in present:
            # An object without metadata. (A .so + .so.json without either is an
            # installed bundle's derived .so, linked into the cache: not debris.)
            seen.add(stem)
            why = "interrupted publish (object without metadata)"
            _remove_under_lock(d, stem, f"{stem}.json", (".so.json", ".so", ".o"), why, drop)
        elif name.endswith(".so") and f"{stem}.so.json" not in present:
            seen.add(stem)
            why = "interrupted link (.so without its .so.json)"
            _remove_under_lock(d, stem, f"{stem}.so.json", (".so",), why, drop)
    return out


def _remove_under_lock(
    d: Path,
    stem: str,
    absent: str,
    suffixes: tuple[str, ...],
    why: str,
    drop: Callable[[Path, int, str], None],
) -> None:
    """Drop the regular files ``<stem><suffix>`` of a key whose file ``absent`` is
    missing (an object without metadata; a .so without its sidecar) only if no one
    holds the key's lock and ``absent`` is still absent under it (a publish or link in
    progress writes it under the lock, or within the grace)."""
    import filelock

    lock = d / f"{stem}.lock"
    try:
        if not stat.S_ISREG(os.lstat(lock).st_mode):
            return
    except FileNotFoundError:
        pass
    lk = filelock.FileLock(str(lock), timeout=0, mode=0o600)
    try:
        lk.acquire()
    except (filelock.Timeout, OSError):
        return  # held, or a cache we can't write (the runtime's sweep): left for later
    try:
        if os.path.lexists(d / absent):
            return
        for suffix in suffixes:
            p = d / f"{stem}{suffix}"
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                drop(p, st.st_size, why)
    finally:
        lk.release()


def try_lock(lock_path: Path):
    """A held ``filelock.FileLock`` on ``lock_path``, or None if another process
    holds it. Never waits; the caller releases it. A lock that can't be taken for
    another reason (a read-only cache, no permission, a full disk) raises its OSError:
    taken for "held by another process", it made `quack cache clean` on a read-only
    cache report every entry as in use and exit 0."""
    import filelock

    lk = filelock.FileLock(str(lock_path), timeout=0, mode=0o600)
    try:
        lk.acquire()
    except filelock.Timeout:
        return None
    return lk
