"""The remote tier in the build: pull before compiling, push after; and the
explicit ``quack cache pull|push``.

A build never fails because of the remote: every problem is a miss (the key
is compiled) or a failed push (reported in the summary), and the tier switches
itself off after a connection error or a time-out (quack.remote.tier)."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import warnings
from typing import Callable

from quack.compile import builder
from quack.errors import CacheError, CacheWarning, LockTimeout, RemoteWarning
from quack.runtime import tiers

PULL_THREADS = 8
REMOTE = "remote"  # a Task status: pulled from the remote, verified, published locally


@dataclasses.dataclass
class SyncReport:
    url: str
    total: int = 0
    local: int = 0  # already in the local cache
    pulled: int = 0
    pushed: int = 0
    exists: int = 0  # push: the remote had a valid object for it already
    replaced: int = 0  # push: the remote had a refused object for it, replaced (compare-and-swap)
    missing: int = 0  # pull: absent from the remote; push: not in the local cache
    refused: int = 0  # pull: on the remote, but refused (signature, checksum, size...)
    remote_errors: int = 0  # pull: the fetch failed with a remote error (time-out, 503, ...)
    not_asked: int = 0  # pull: never asked for, the remote having gone off (or Ctrl-C)
    failed: int = 0  # pull: verified but not stored locally (disk full...); push: not stored remotely
    skipped: int = 0  # push: not tried, pushing having been switched off (remote full, denied, off)
    errors: list = dataclasses.field(default_factory=list)  # pull: why each failed, one line each
    wall_s: float = 0.0
    offline: bool = False
    counters: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["wall_s"] = round(self.wall_s, 3)
        return d


def pull(
    tasks,
    store,
    remote,
    *,
    on_pulled: Callable | None = None,
    threads: int = PULL_THREADS,
    failures: list | None = None,
    unexpected: list | None = None,
) -> int:
    """Fetch every task not cached locally from the remote; a verified object is
    published into ``store`` and its task marked REMOTE. Returns how many were
    pulled. A few threads overlap the network round trips and the local store's
    fsyncs (the per-entry cost is mostly the durable publish); once the remote
    is off, the remaining tasks are not asked for.

    A verified object the local store can't take (disk full, read-only) is a local
    failure, not a miss: appended to ``failures`` as (task, error) when given (``quack
    cache pull`` reports them), else warned about once (the build compiles the key).
    A fetch that raised (against its contract) is warned about once, and appended to
    ``unexpected`` when given (``quack cache pull`` counts it as a remote error).

    The threads are daemons and this thread only waits on an event: Ctrl-C (or
    SIGTERM turned into KeyboardInterrupt) ends the wait at once and is raised; a
    fetch still in flight cannot keep the process alive (issue 30: a pull blocked
    on a FIFO held the build for ever, and a pool's shutdown joined it)."""
    todo = [t for t in tasks if t.status == "todo"]
    if not todo:
        return 0
    lock = threading.Lock()
    stop = threading.Event()
    local_failures: list = []
    remote_failures: list = []

    def one(t) -> bool:
        if remote.offline or stop.is_set():
            return False
        ref = builder.entry_ref(t.cfg.spec, t.cfg.params, t.cfg.arch)
        t0 = time.time()
        try:
            got = remote.fetch(ref)
        except Exception as e:  # noqa: BLE001
            # fetch's contract is never to raise; should a remote problem get through anyway
            # (a client library's own exception did), the key is compiled, the build goes on:
            # _run_daemons would re-raise it and fail the whole build.
            with lock:
                remote_failures.append(e)
            return False
        if got is None:
            return False
        try:
            tiers.store_fetched(store, got)
        except (CacheError, LockTimeout, OSError) as e:
            with lock:
                local_failures.append((t, e))
            return False
        t.status = REMOTE
        t.start, t.end = t0, time.time()
        t.wall_s = t.end - t0
        if on_pulled is not None:
            on_pulled(t)
        return True

    # The first fetch alone: a dead remote is found (and switched off) once,
    # not by every thread at the same time.
    n = _run_daemons(one, todo[:1], 1, stop)
    if len(todo) > 1 and not remote.offline:
        n += _run_daemons(one, todo[1:], threads, stop)
    if unexpected is not None:
        unexpected.extend(remote_failures)
    if remote_failures:
        e = remote_failures[0]
        warnings.warn(
            f"quack: remote cache {remote.url}: {len(remote_failures)} fetch(es) failed "
            f"unexpectedly (first: {type(e).__name__}: {e}); compiling those keys instead",
            RemoteWarning,
            stacklevel=2,
        )
    if failures is not None:
        failures.extend(local_failures)
    elif local_failures:
        t, e = local_failures[0]
        warnings.warn(
            f"quack: {len(local_failures)} object(s) pulled from the remote cache could not be "
            f"stored locally (first: {t.cfg.kernel}: {why(e)}); compiling them instead",
            CacheWarning,
            stacklevel=2,
        )
    return n


def why(e: BaseException) -> str:
    """A local write failure in one line with the system's own words for it (``No space
    left on device``), which the store's friendlier label (``disk full``) leaves out."""
    code = getattr(e, "code", 0) or getattr(e, "errno", 0) or 0
    text = str(e)
    if code and os.strerror(code) not in text:
        text = f"[Errno {code}] {os.strerror(code)}: {text}"
    return text


def _run_daemons(fn: Callable, items: list, threads: int, stop: threading.Event) -> int:
    """``sum(fn(x) for x in items)`` on up to ``threads`` daemon threads. The wait ends
    when every thread has (each ``fn`` is bounded by the remote time-out and the store's
    lock time-out) or on KeyboardInterrupt, which sets ``stop`` and is re-raised without
    waiting for the threads. An error in ``fn`` (a bug) is re-raised here."""
    it = iter(items)
    lock = threading.Lock()
    done = threading.Event()
    state = {"n": 0, "live": max(1, min(threads, len(items)))}
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            while not stop.is_set():
                with lock:
                    x = next(it, None)
                if x is None:
                    break
                if fn(x):
                    with lock:
                        state["n"] += 1
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            errors.append(e)
            stop.set()
        finally:
            with lock:
                state["live"] -= 1
                if state["live"] == 0:
                    done.set()

    for _ in range(state["live"]):
        threading.Thread(target=worker, name="quack-pull", daemon=True).start()
    try:
        # A timed wait, polled: a signal whose C handler ran just before this thread blocked
        # (or on another thread) does not interrupt an untimed wait, whose Python handler then
        # runs only when the wait ends; the hung fetches of issue 30 end only at their
        # time-out. Each return to Python runs a pending handler: Ctrl-C acts within 0.25 s.
        while not done.wait(0.25):
            pass
    except BaseException:
        stop.set()  # the threads finish the fetch in hand and take no more
        raise
    if errors:
        raise errors[0]
    return state["n"]


def push_task(t, store, remote) -> str:
    """After a compile: sign and push the task's entry (``pushed`` / ``exists``
    / ``replaced`` / ``failed`` / ``skipped`` / ``off``; quack.remote.tier.RemoteTier.push)."""
    entry = store.lookup(builder.entry_ref(t.cfg.spec, t.cfg.params, t.cfg.arch))
    if entry is None:
        return "failed"
    return remote.push(store, entry)


def pull_configs(configs, store, remote) -> SyncReport:
    """``quack cache pull``: every configuration missing locally, from the remote."""
    from quack_build.build.plan import plan
    from quack_build.build.results import CACHED

    t0 = time.time()
    tasks = plan(configs, store)
    rep = SyncReport(remote.url, total=len(tasks), local=sum(1 for t in tasks if t.status == CACHED))
    failures: list = []
    unexpected: list = []
    before = remote.counters.to_json()
    rep.pulled = pull(tasks, store, remote, failures=failures, unexpected=unexpected)
    after = remote.counters.to_json()
    rep.failed = len(failures)
    rep.errors = [f"{t.cfg.kernel} key {t.cfg.key[:16]}: {why(e)}" for t, e in failures]
    # Each fetch the tier made is counted once, as what it was (a hit is pulled or failed
    # here): "not available" is absent only; errors and refusals used to be folded into it,
    # so a remote answering 503 to everything read as an empty one.
    rep.missing = after["misses"] - before["misses"]
    rep.refused = after["rejected"] - before["rejected"]
    rep.remote_errors = after["errors"] - before["errors"] + len(unexpected)
    asked = rep.pulled + rep.failed + rep.missing + rep.refused + rep.remote_errors
    rep.not_asked = max(0, rep.total - rep.local - asked)
    rep.offline = remote.offline
    rep.counters = after
    rep.wall_s = time.time() - t0
    return rep


def push_configs(configs, store, remote) -> SyncReport:
    """``quack cache push``: every configuration in the local cache, to the remote."""
    t0 = time.time()
    rep = SyncReport(remote.url, total=len(configs))
    for c in configs:
        entry = store.lookup(builder.entry_ref(c.spec, c.params, c.arch))
        if entry is None:
            rep.missing += 1
            continue
        rep.local += 1
        r = remote.push(store, entry)
        if r == "pushed":
            rep.pushed += 1
        elif r == "exists":
            rep.exists += 1
        elif r == "replaced":
            rep.replaced += 1
        elif r == "failed":
            rep.failed += 1
        else:  # skipped (or off): not tried after an earlier failure switched pushing off
            rep.skipped += 1
    if rep.replaced:
        remote.warn_replaced()
    rep.offline = remote.offline
    rep.counters = remote.counters.to_json()
    rep.wall_s = time.time() - t0
    return rep
