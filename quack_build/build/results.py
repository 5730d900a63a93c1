"""A build's records: the statuses a key can end in, the per-key Task, the Reporter
protocol progress goes through (and NullReporter), and the whole build's BuildResult
(counts, timings, ``to_json``). quack_build.build.scheduler fills them in; the display,
trace and remote sync read them."""

from __future__ import annotations

import dataclasses
from typing import Protocol

from quack_build.manifest.config import BuildConfig

CACHED, COMPILED, SHARED, FAILED, SKIPPED, INTERRUPTED = (
    "cached",
    "compiled",
    "cached-by-other",
    "failed",
    "not-built",
    "interrupted",
)
REMOTE = "remote"  # pulled from the remote cache, verified, published locally (quack_build.build.remote)


@dataclasses.dataclass
class Task:
    cfg: BuildConfig
    status: str = "todo"
    est_s: float | None = None
    compile_s: float = 0.0
    wall_s: float = 0.0
    start: float = 0.0
    end: float = 0.0
    pid: int = 0
    slot: int = -1
    error: str = ""
    detail: str = ""
    lane: str = ""  # the worker's name in the trace and display ("" = by pid)
    awaited: bool = False  # another process held its lock: this build waited, no worker of it ran
    # A FAILED key's cause: "compile" (the kernel), "store" (it compiled; the cache could not
    # take the object: disk full, read-only), "lock" (another process held its lock past
    # lock_timeout); the summary reports each apart.
    failure: str = ""
    pushed: str = ""  # after a compile, with a remote: pushed / exists / replaced / failed / skipped / off
    corrupt: str = ""  # a dry run's plan: the entry is corrupt (why); a build quarantines and rebuilds it

    def to_json(self) -> dict:
        d: dict[str, object] = {
            "kernel": self.cfg.kernel,
            "params": self.cfg.plain_params,
            "arch": self.cfg.arch,
            "key": self.cfg.key,
            "status": self.status,
        }
        if self.cfg.sizes:  # the problem sizes whose tuned configuration this is
            d["sizes"] = list(self.cfg.sizes)
        if self.pushed:
            d["remote_push"] = self.pushed
        if self.status in (COMPILED, SHARED, FAILED):
            d.update(compile_s=round(self.compile_s, 4), wall_s=round(self.wall_s, 4), worker=self.pid)
            if self.lane:
                d["lane"] = self.lane
        if self.est_s is not None and self.status not in (CACHED,):
            d["estimate_s"] = round(self.est_s, 3)
        if self.awaited:
            d["awaited"] = True
        if self.failure:
            d["failure"] = self.failure
        if self.error:
            d["error"] = self.error
        if self.corrupt:
            d["corrupt"] = self.corrupt
        return d


class Reporter(Protocol):
    def planned(self, tasks: list[Task], todo: list[Task], jobs: int) -> None: ...
    def started(self, task: Task) -> None: ...
    def finished(self, task: Task) -> None: ...
    def note(self, text: str) -> None: ...
    def tick(self) -> None: ...
    def close(self) -> None: ...


class NullReporter:
    def planned(self, tasks, todo, jobs):
        pass

    def started(self, task):
        pass

    def finished(self, task):
        pass

    def note(self, text):
        pass

    def tick(self):
        pass

    def close(self):
        pass


@dataclasses.dataclass
class BuildResult:
    tasks: list[Task]
    jobs: int
    wall_s: float = 0.0
    plan_s: float = 0.0
    compile_wall_s: float = 0.0
    pool_start_s: float = 0.0
    preload: tuple = ()  # [build] preload modules
    preload_s: float = 0.0  # of pool_start_s: importing them (per worker start, the longest)
    interrupted: bool = False
    executor: str = "local"
    executor_stats: dict = dataclasses.field(default_factory=dict)  # a cluster's: nodes, retries, ...
    t0: float = 0.0
    log_path: str = ""
    trace_path: str = ""
    missing_after: list = dataclasses.field(default_factory=list)
    # after an interrupt: files this build's interrupted writes left in the cache (temp
    # files of a worker that had not ended in time); the summary says so
    partial_left: list = dataclasses.field(default_factory=list)
    remote_url: str = ""  # empty: no remote configured
    remote: dict = dataclasses.field(default_factory=dict)  # the tier's counters for this build
    remote_offline: bool = False
    # whose tuning rows chose the default configurations (quack.tuning.gpu_choice): a build
    # keys for one GPU model, and a process on another model misses (docs/tuning.md)
    tune_gpu: tuple = ((), "")  # (models, why); no models: each table's default GPU

    def count(self, status: str) -> int:
        return sum(1 for t in self.tasks if t.status == status)

    @property
    def compile_s(self) -> float:
        return sum(t.compile_s for t in self.tasks if t.status == COMPILED)

    @property
    def busy_s(self) -> float:
        """Seconds this build's workers spent on keys. Not the keys awaited on another
        process's lock: no worker of this build ran them, and counted they made a build
        that waited on another report "parallel efficiency 150% of 2 workers"."""
        return sum(t.wall_s for t in self.tasks if t.status in (COMPILED, SHARED, FAILED) and not t.awaited)

    @property
    def efficiency(self) -> float | None:
        """Busy worker time over jobs x (first compile start .. last compile end): the
        pool's one-time start-up (forkserver import + warm-up) is reported apart. None
        when no worker of this build ran a key (all cached, or all awaited elsewhere)."""
        if self.compile_wall_s <= 0 or self.jobs <= 0 or self.busy_s <= 0:
            return None
        return self.busy_s / (self.jobs * self.compile_wall_s)

    @property
    def ok(self) -> bool:
        return (
            not self.interrupted
            and not self.missing_after
            and self.count(FAILED) == 0
            and self.count(SKIPPED) == 0
        )

    def to_json(self) -> dict:
        eff = self.efficiency
        compiled = self.count(COMPILED)
        return {
            "ok": self.ok,
            "total": len(self.tasks),
            "cached": self.count(CACHED),
            "compiled": compiled,
            "cached_by_other": self.count(SHARED),
            "failed": self.count(FAILED),
            "failed_to_store": sum(1 for t in self.tasks if t.status == FAILED and t.failure == "store"),
            "not_built": self.count(SKIPPED) + self.count(INTERRUPTED),
            "interrupted": self.interrupted,
            "jobs": self.jobs,
            "executor": self.executor,
            **({"executor_stats": self.executor_stats} if self.executor_stats else {}),
            "compile_s": round(self.compile_s, 3),
            "wall_s": round(self.wall_s, 3),
            "plan_s": round(self.plan_s, 3),
            "pool_start_s": round(self.pool_start_s, 3),
            "preload": list(self.preload),
            "preload_s": round(self.preload_s, 3),
            "compile_wall_s": round(self.compile_wall_s, 3),
            "keys_per_s": round(compiled / self.compile_wall_s, 3) if self.compile_wall_s > 0 else None,
            "efficiency": round(eff, 4) if eff is not None else None,
            "missing_after": self.missing_after,
            "partial_left": self.partial_left,
            "log": self.log_path or None,
            "trace": self.trace_path or None,
            "remote_hits": self.count(REMOTE),
            "remote_pushed": int(self.remote.get("pushed", 0)),
            "remote_push_failed": int(self.remote.get("push_failed", 0)),
            "remote_push_skipped": int(self.remote.get("push_skipped", 0)),
            "remote_rejected": int(self.remote.get("rejected", 0)),
            "remote_replaced": int(self.remote.get("replaced", 0)),
            "remote": (
                {"url": self.remote_url, "offline": self.remote_offline, **self.remote}
                if self.remote_url
                else None
            ),
            "tune_gpu": {"models": list(self.tune_gpu[0]), "source": self.tune_gpu[1]},
            "keys": [t.to_json() for t in self.tasks],
        }
