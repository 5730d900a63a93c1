"""Publishing what a remote worker compiled: the coordinator is the cache's only writer.

A remote worker returns the object's bytes with its size, SHA-256, key, source
fingerprint and toolchain stamp; this checks all of them against the coordinator's
own and publishes through the store's normal atomic publish (temp file, rename,
metadata last) under the key's lock. A Publisher does that on a few threads, off the
coordinator's loop."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from quack.errors import ExecutorError, LockTimeout
from quack_build.build.executors.base import DONE, FAILED, Event, WorkItem

# Publishing (verify, lock, write, fsync x2, .so) is I/O-bound: threads overlap the fsyncs,
# so the one coordinator keeps up with many nodes (see benchmarks/bench_ray.py).
PUBLISH_THREADS = 8
# A publish waiting for a key's lock (another process compiling it) retries at this period
# and gives up once the publisher is cancelled: Ctrl-C must not wait out lock_timeout.
LOCK_POLL_S = 0.2


class PublishCancelled(ExecutorError):
    """A publish given up, before its lock and its first write, because the build stopped."""


def check_result(ref, item: WorkItem, res: dict) -> str:
    """What is wrong with ``res`` for the entry ``ref`` ("" when nothing)."""
    data = res.get("obj") or b""
    if res.get("key") != item.key:
        return f"it computed key {str(res.get('key'))[:16]}, the coordinator {item.key[:16]}"
    if res.get("srcfp") != ref.srcfp:
        return f"it compiled sources with fingerprint {res.get('srcfp')}, this checkout has {ref.srcfp}"
    if res.get("stamp") != ref.stamp:
        return f"its toolchain stamp is {res.get('stamp')!r}, the coordinator's {ref.stamp!r}"
    if len(data) != res.get("size"):
        return f"received {len(data)} bytes, it sent {res.get('size')} (truncated in transit)"
    if hashlib.sha256(data).hexdigest() != res.get("sha256"):
        return "the object's SHA-256 does not match what it sent (corrupted in transit)"
    return ""


def publish_result(
    store,
    item: WorkItem,
    res: dict,
    *,
    worker: str,
    executor: str = "ray",
    address: str = "",
    cancelled: threading.Event | None = None,
) -> bool:
    """Check ``res`` (key, srcfp, stamp, obj, size, sha256, compile_s, host, pid; optionally
    so + so_sha256, the .so the worker linked) and publish it into ``store``. True if
    published here; False if another process published the key first. ``cancelled``: once
    set, a publish still waiting for the key's lock gives up (PublishCancelled; nothing
    was written); one holding it finishes (atomic).

    Raises ExecutorError for a result that does not match (nothing is published), and
    what the Store raises (CacheError, CacheWriteError, LockTimeout)."""
    from quack.cache import fsutil
    from quack.compile import builder
    from quack.runtime import loader

    ref = builder.entry_ref(item.spec, item.bound, item.arch)
    problem = check_result(ref, item, res)
    if problem:
        raise ExecutorError(
            f"refusing the object for {item.kernel} key {item.key[:16]} from {worker}: "
            f"{problem}; nothing was published",
            executor=executor,
            address=address,
        )
    if not item.force and store.lookup(ref) is not None:
        return False
    what = f"{item.kernel} key {item.key[:16]} from {worker}"
    with _lock(store, ref, cancelled, what=what, executor=executor):
        if not item.force and store.lookup(ref, locked=True) is not None:
            return False
        tmp = store.tmp_obj(ref)
        try:
            write_into(tmp, res["obj"])
            meta = {
                "params": item.params,
                "compile_s": res.get("compile_s", 0.0),
                "host": res.get("host", ""),
                "pid": res.get("pid", 0),
                "created": time.time(),
                "executor": executor,
            }
            entry = store.publish(ref, tmp, meta)
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
        so = res.get("so")
        if so is not None and hashlib.sha256(so).hexdigest() == res.get("so_sha256"):
            tmp_so = fsutil.reserve_tmp(store.paths(ref)["so"])
            try:
                write_into(tmp_so, so)
                store.write_so(entry, tmp_so)
            except OSError:
                pass  # a derived file: the loader links the .o on first use
            finally:
                if os.path.lexists(tmp_so):
                    os.unlink(tmp_so)
        else:
            loader.link_entry(store, entry)
    return True


@contextlib.contextmanager
def _lock(store, ref, cancelled: threading.Event | None, *, what: str, executor: str) -> Iterator[None]:
    """The key's lock, as ``store.lock(ref)`` takes it (waiting up to the store's
    lock_timeout for another holder), in waits of LOCK_POLL_S that stop once
    ``cancelled`` is set (PublishCancelled)."""
    if cancelled is None:
        with store.lock(ref):
            yield
        return
    limit = float(getattr(store, "lock_timeout", 600.0))
    deadline = time.monotonic() + limit
    with contextlib.ExitStack() as held:
        while True:
            if cancelled.is_set():
                raise PublishCancelled(
                    f"publishing {what} given up: the build stopped while another process held "
                    f"the key's lock; nothing was written",
                    executor=executor,
                )
            left = deadline - time.monotonic()
            try:
                held.enter_context(store.lock(ref, timeout=max(0.0, min(LOCK_POLL_S, left))))
                break
            except LockTimeout as e:
                if left <= LOCK_POLL_S:
                    raise LockTimeout(e.path, limit) from None
        yield


def write_into(tmp: Path, data: bytes) -> None:
    """Fill a temp file the store reserved (O_EXCL, ours): no symlink is followed."""
    fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


class Publisher:
    """Publishes remote results on PUBLISH_THREADS threads (``open`` starts them), so the
    coordinator hands its actors their next key before the result is verified, locked,
    written and fsynced. ``counts``: published (entries this build wrote), publish_s."""

    def __init__(self, store, *, executor: str = "ray"):
        self.store = store
        self.executor = executor
        self.address = ""
        self.counts: dict[str, Any] = {"published": 0, "publish_s": 0.0}
        self._threads: Any = None  # ThreadPoolExecutor, from open()
        self._futures: set = set()  # each gives a list of events
        self._counts_lock = threading.Lock()
        self._cancelled = threading.Event()  # set: publishes waiting for a lock give up

    def open(self, address: str) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.address = address
        self._threads = ThreadPoolExecutor(PUBLISH_THREADS, thread_name_prefix="quack-publish")

    @property
    def pending(self) -> bool:
        """Whether some result is still being (or waiting to be) published."""
        return bool(self._futures)

    def submit(self, item: WorkItem, res: dict, *, worker: str, lane: str, pid: int) -> None:
        """Queue ``res`` (from ``worker``) for publishing; its events come from ``done``."""
        if self._threads is None:
            raise ExecutorError("the publisher is shut down", executor=self.executor, address=self.address)
        self._futures.add(self._threads.submit(self._finish, item, res, worker, lane, pid))

    def done(self) -> list[Event]:
        """The events of the results published (or refused) since the last call."""
        out: list[Event] = []
        for f in [f for f in self._futures if f.done()]:
            self._futures.discard(f)
            out += f.result()  # _finish never raises: a failure is a FAILED event
        return out

    def cancel(self) -> None:
        """Drop what is not yet being written, without waiting: a publish waiting for a
        key's lock (another process holds it, for up to lock_timeout) gives up within
        LOCK_POLL_S; those writing finish (atomic). ``shutdown`` waits for them."""
        self._cancelled.set()

    def shutdown(self) -> None:
        """Cancel (above), let the publishes in progress finish (each is atomic) and drop
        the queued ones: nothing more is published once this returns."""
        self.cancel()
        if self._threads is not None:
            self._threads.shutdown(wait=True, cancel_futures=True)
            self._threads = None
            # A cancelled future never had events, and its result() raises CancelledError:
            # kept, it would leave ``pending`` true for ever and make ``done`` raise.
            self._futures = {f for f in self._futures if not f.cancelled()}

    def _finish(self, item: WorkItem, res: dict, worker: str, lane: str, pid: int) -> list[Event]:
        """In a publisher thread: publish one result; the events for it (never raises)."""
        p0 = time.perf_counter()
        try:
            compiled = publish_result(
                self.store,
                item,
                res,
                worker=worker,
                executor=self.executor,
                address=self.address,
                cancelled=self._cancelled,
            )
            if compiled:
                with self._counts_lock:
                    self.counts["published"] += 1
        except Exception as e:  # noqa: BLE001 - ExecutorError, CacheError, OSError, LockTimeout
            return [Event(FAILED, item.key, lane=lane, pid=pid, error=e)]
        finally:
            with self._counts_lock:
                self.counts["publish_s"] += time.perf_counter() - p0
        return [
            Event(
                DONE,
                item.key,
                lane=lane,
                pid=pid,
                compiled=compiled,
                compile_s=float(res.get("compile_s") or 0.0) if compiled else 0.0,
            )
        ]
