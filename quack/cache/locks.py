"""A cache entry's per-key lock file (``<key>.lock``, an flock): held while waiting
(``hold``, through filelock), or taken without waiting as a descriptor the caller owns
(``try_claim``, which the compile pool hands to its worker). The two take the same
flock, so they exclude each other. A lock file is never followed through a symbolic
link nor used when it is not a regular file (planted: `quack cache clean` or rm)."""

from __future__ import annotations

import errno
import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from quack.cache.problems import write_error
from quack.errors import CacheError, LockTimeout


def open_error(e: OSError, path: Path, root: Path) -> Exception:
    """What opening a lock file raised, as the error to report: a symbolic link planted
    there (ELOOP under O_NOFOLLOW), else the cache can't be written."""
    if e.errno == errno.ELOOP:
        return CacheError(
            f"lock file is a symbolic link (planted; quack refuses to follow it: "
            f"run quack cache clean, or rm it): {path}",
            path=str(path),
        )
    return write_error(e, root, f"creating the lock {path}")


@contextmanager
def hold(path: Path, timeout: float, root: Path) -> Iterator[None]:
    """Hold the lock at ``path``, waiting up to ``timeout`` seconds for another holder.
    Raises LockTimeout, CacheError (planted lock file), CacheWriteError."""
    import filelock

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        # The remedy before the (long) path: a one-line summary cut at its end keeps it.
        raise CacheError(
            f"lock file is a symbolic link or not a regular file (planted; quack "
            f"refuses to follow it: run quack cache clean, or rm it): {path}",
            path=str(path),
        )
    lk = filelock.FileLock(str(path), timeout=timeout, mode=0o600)
    try:
        lk.acquire()
    except filelock.Timeout:
        raise LockTimeout(str(path), timeout) from None
    except OSError as e:
        raise open_error(e, path, root) from None
    try:
        yield
    finally:
        lk.release()


def try_claim(path: Path, root: Path) -> int | None:
    """The lock at ``path`` taken now, without waiting, as an open descriptor the caller
    owns (closing every copy of it releases the lock); None when another process holds
    it. For a compile handed to another process with the descriptor (the compile pool
    sends it to its worker): the key is locked from the moment this process decides to
    compile it, not from when a worker gets to it, so seven processes asking at once
    await the eighth instead of each starting a worker first.
    Raises CacheError (a planted lock file), CacheWriteError (can't create it)."""
    import fcntl

    # O_NONBLOCK: a FIFO or device planted as the lock file opens at once (then refused)
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        raise open_error(e, path, root) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CacheError(
                f"lock file is not a regular file (planted; quack refuses to use it: "
                f"run quack cache clean, or rm it): {path}",
                path=str(path),
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
    except BaseException:
        try:
            os.close(fd)
        except OSError:
            pass
        raise
    return fd
