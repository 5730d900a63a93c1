"""The remote tier in the build: pull before compiling, push after; and the
explicit ``quack cache pull|push``.

A build never fails because of the remote: every problem is a miss (the key
is compiled) or a failed push (reported in the summary), and the tier switches
itself off after a connection error or a time-out (quack.remote.tier)."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from quack.compile import builder
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
    exists: int = 0  # push: the remote had it already
    missing: int = 0  # pull: not on the remote (or refused); push: not in the local cache
    failed: int = 0
    wall_s: float = 0.0
    offline: bool = False
    counters: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["wall_s"] = round(self.wall_s, 3)
        return d


def pull(tasks, store, remote, *, on_pulled: Callable | None = None, threads: int = PULL_THREADS) -> int:
    """Fetch every task not cached locally from the remote; a verified object is
    published into ``store`` and its task marked REMOTE. Returns how many were
    pulled. A few threads overlap the network round trips and the local store's
    fsyncs (the per-entry cost is mostly the durable publish); once the remote
    is off, the remaining tasks are not asked for."""
    todo = [t for t in tasks if t.status == "todo"]
    if not todo:
        return 0

    def one(t) -> bool:
        if remote.offline:
            return False
        ref = builder.entry_ref(t.cfg.spec, t.cfg.params, t.cfg.arch)
        t0 = time.time()
        got = remote.fetch(ref)
        if got is None or tiers.publish_fetched(store, got) is None:
            return False
        t.status = REMOTE
        t.start, t.end = t0, time.time()
        t.wall_s = t.end - t0
        if on_pulled is not None:
            on_pulled(t)
        return True

    # The first fetch alone: a dead remote is found (and switched off) once,
    # not by every thread at the same time.
    n = int(one(todo[0]))
    rest = todo[1:]
    if not rest or remote.offline:
        return n
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(
        max_workers=max(1, min(threads, len(rest))), thread_name_prefix="quack-pull"
    ) as ex:
        n += sum(ex.map(one, rest))
    return n


def push_task(t, store, remote) -> str:
    """After a compile: sign and push the task's entry (``pushed`` / ``exists``
    / ``failed`` / ``off``)."""
    entry = store.lookup(builder.entry_ref(t.cfg.spec, t.cfg.params, t.cfg.arch))
    if entry is None:
        return "failed"
    return remote.push(store, entry)


def pull_configs(configs, store, remote) -> SyncReport:
    """``quack cache pull``: every configuration missing locally, from the remote."""
    from quack_build.scheduler import CACHED, plan

    t0 = time.time()
    tasks = plan(configs, store)
    rep = SyncReport(remote.url, total=len(tasks), local=sum(1 for t in tasks if t.status == CACHED))
    rep.pulled = pull(tasks, store, remote)
    rep.missing = rep.total - rep.local - rep.pulled
    rep.offline = remote.offline
    rep.counters = remote.counters.to_json()
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
        else:
            rep.failed += 1
    rep.offline = remote.offline
    rep.counters = remote.counters.to_json()
    rep.wall_s = time.time() - t0
    return rep
