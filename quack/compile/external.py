"""A key another process is compiling (another xdist worker, a ``quack build``).

A key whose per-key lock another process holds is not submitted: the pool awaits it
("external" pending) until its .o appears, the lock is released without one (then it
is new again), or the time-out passes: the smaller of lock_timeout and compile_timeout
(quack.compile.pool; quack.compile.dispatch says what follows each). The other process
is seen only through the store's files: the key's lock (a flock) and the metadata a
publish writes last (and, for an error that names it, the system's list of locks)."""

from __future__ import annotations

import os

from quack.compile.tasks import Task

PUBLISHED, RELEASED, TIMED_OUT = "published", "released", "timed_out"


def lock_held(path) -> bool:
    """Does some process hold this flock (filelock's Unix lock) right now? False for
    a lock file that is not a regular file (planted: no process can hold it)."""
    import fcntl
    import stat

    # O_NONBLOCK: a FIFO planted at the lock path would otherwise block this open until
    # a writer came (quack build hung awaiting the key); opened at once, it is refused.
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False  # the key's own attempt at the lock reports the planted file
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def holder_pid(path) -> int:
    """The pid of the process holding this flock, as the system lists it (Linux's
    /proc/locks: the process that took the lock), for an error that names it; 0 when
    unknown (no such listing, the file gone, no holder found)."""
    try:
        st = os.stat(path, follow_symlinks=False)
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            listing = f.read(1 << 20)
    except OSError:
        return 0
    for line in listing.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 4242 fe:00:2364327 0 EOF"; a waiter's line has "->"
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        try:
            major, minor, ino = fields[5].split(":")
            if (int(major, 16), int(minor, 16), int(ino)) == (
                os.major(st.st_dev),
                os.minor(st.st_dev),
                st.st_ino,
            ):
                return max(0, int(fields[4]))
        except ValueError:
            continue
    return 0


def claim(spec, params, arch, s, *, take: bool = True) -> tuple[int | None, tuple[str, str]] | None:
    """Lock the key now for a compile this process will hand to a worker (``Store.claim``).
    Returns (the claim's descriptor, or None when another process holds the key; (lock
    path, metadata path)), or None when the key is free but not claimed: ``take`` False
    (the pool holds its most claims; the worker takes the lock itself, as without a
    claim) or the cache can't say (unusable, a planted lock file: the worker's own
    attempt reports that)."""
    try:
        from quack.cache.store import local_store
        from quack.compile import builder, claims

        store = local_store(s)
        ref = builder.entry_ref(spec, params, arch)
        p = store.paths(ref)
        where = (str(p["lock"]), str(p["meta"]))
        if not take:
            return (None, where) if lock_held(where[0]) else None
        fd = store.claim(ref)
    except Exception:  # noqa: BLE001 - an unusable cache is the worker's to report
        return None
    return (claims.track(fd) if fd is not None else None), where


def check(t: Task, now: float) -> str | None:
    """What became of an awaited key: PUBLISHED, RELEASED (new again), TIMED_OUT,
    or None (still awaited)."""
    # submit sets all three for every external task
    assert t.obj_meta is not None and t.external_lock is not None and t.started is not None
    if os.path.exists(t.obj_meta):
        return PUBLISHED
    if not lock_held(t.external_lock):
        # The other process let go. Published in the meantime? Else it failed:
        # new again, the next call compiles it here.
        return PUBLISHED if os.path.exists(t.obj_meta) else RELEASED
    if now - t.started > t.timeout:
        return TIMED_OUT
    return None
