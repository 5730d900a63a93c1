"""Key locks this process took for compiles it hands to its workers (``Store.claim``).

A claimed key's lock lives in an open descriptor: the pool holds it from ``submit``
until the task's worker has its own copy (sent over the worker's pipe), or until the
task ends without one (failed, cancelled). Closing every copy releases the lock, so a
worker that dies releases it and a coordinator that dies leaves it with the worker,
which publishes under it.

A ``fork`` copies every descriptor: a child forked while a claim is held (a
``multiprocessing`` fork worker, a DataLoader worker, any ``os.fork``) would hold the
key's lock for its whole life, and another process awaiting the key would wait on it
until its time-out whenever the compile fails to publish. The child closes its copies
at once (``os.register_at_fork``)."""

from __future__ import annotations

import os
import threading

#: Claims held at once, at most: one open descriptor per key queued here. A pool given
#: hundreds of keys at once (`quack tune`'s candidates, a plugin run's deferred misses)
#: would otherwise hold one per queued key, against a descriptor limit often 1024; past
#: this many, a key is queued unclaimed and its worker takes the lock itself, as it did
#: before claims (another process may then start a worker of its own for it).
MAX_HELD = 64

_held: set[int] = set()
_lock = threading.Lock()


def track(fd: int) -> int:
    """Remember a claim's descriptor (closed in forked children); returns it."""
    with _lock:
        _held.add(fd)
    return fd


def release(fd: int) -> None:
    """Close this process's copy of a claim (idempotent per descriptor number)."""
    with _lock:
        if fd not in _held:
            return
        _held.discard(fd)
    try:
        os.close(fd)
    except OSError:
        pass


def held() -> int:
    """How many claims this process holds (tests, stats)."""
    with _lock:
        return len(_held)


def _close_in_child() -> None:
    # After fork only the forking thread exists: no other thread can hold _lock's
    # critical section mid-update in the child, but the lock object may be copied held.
    global _lock
    _lock = threading.Lock()
    for fd in list(_held):
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)
