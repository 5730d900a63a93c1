"""The build scheduler: plan (what is cached), order (longest first), compile in
a pool of warm workers, report progress, write a trace, summarize.

The build process never imports torch or cutlass: workers fork from quack's
forkserver (cutlass imported and one compile done there) and run
``quack.compile.worker.worker_build``."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Protocol

from quack.cache import journal, orphans
from quack.cache.store import LAYOUT, DiskStore
from quack.compile import builder
from quack_build.buildconfig import BuildConfig

CACHED, COMPILED, SHARED, FAILED, SKIPPED, INTERRUPTED = (
    "cached",
    "compiled",
    "cached-by-other",
    "failed",
    "not-built",
    "interrupted",
)
REMOTE = "remote"  # pulled from the remote cache, verified, published locally (quack_build.remote_sync)


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
    pushed: str = ""  # after a compile, with a remote: pushed / exists / failed / off

    def to_json(self) -> dict:
        d: dict[str, object] = {
            "kernel": self.cfg.kernel,
            "params": self.cfg.plain_params,
            "arch": self.cfg.arch,
            "key": self.cfg.key,
            "status": self.status,
        }
        if self.pushed:
            d["remote_push"] = self.pushed
        if self.status in (COMPILED, SHARED, FAILED):
            d.update(compile_s=round(self.compile_s, 4), wall_s=round(self.wall_s, 4), worker=self.pid)
            if self.lane:
                d["lane"] = self.lane
        if self.est_s is not None and self.status not in (CACHED,):
            d["estimate_s"] = round(self.est_s, 3)
        if self.error:
            d["error"] = self.error
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
    interrupted: bool = False
    executor: str = "local"
    executor_stats: dict = dataclasses.field(default_factory=dict)  # a cluster's: nodes, retries, ...
    t0: float = 0.0
    log_path: str = ""
    trace_path: str = ""
    missing_after: list = dataclasses.field(default_factory=list)
    remote_url: str = ""  # empty: no remote configured
    remote: dict = dataclasses.field(default_factory=dict)  # the tier's counters for this build
    remote_offline: bool = False

    def count(self, status: str) -> int:
        return sum(1 for t in self.tasks if t.status == status)

    @property
    def compile_s(self) -> float:
        return sum(t.compile_s for t in self.tasks if t.status == COMPILED)

    @property
    def busy_s(self) -> float:
        return sum(t.wall_s for t in self.tasks if t.status in (COMPILED, SHARED, FAILED))

    @property
    def efficiency(self) -> float | None:
        """Busy worker time over jobs x (first compile start .. last compile end): the
        pool's one-time start-up (forkserver import + warm-up) is reported apart."""
        if self.compile_wall_s <= 0 or self.jobs <= 0:
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
            "not_built": self.count(SKIPPED) + self.count(INTERRUPTED),
            "interrupted": self.interrupted,
            "jobs": self.jobs,
            "executor": self.executor,
            **({"executor_stats": self.executor_stats} if self.executor_stats else {}),
            "compile_s": round(self.compile_s, 3),
            "wall_s": round(self.wall_s, 3),
            "plan_s": round(self.plan_s, 3),
            "pool_start_s": round(self.pool_start_s, 3),
            "compile_wall_s": round(self.compile_wall_s, 3),
            "keys_per_s": round(compiled / self.compile_wall_s, 3) if self.compile_wall_s > 0 else None,
            "efficiency": round(eff, 4) if eff is not None else None,
            "missing_after": self.missing_after,
            "log": self.log_path or None,
            "trace": self.trace_path or None,
            "remote_hits": self.count(REMOTE),
            "remote_pushed": int(self.remote.get("pushed", 0)),
            "remote_rejected": int(self.remote.get("rejected", 0)),
            "remote": (
                {"url": self.remote_url, "offline": self.remote_offline, **self.remote}
                if self.remote_url
                else None
            ),
            "keys": [t.to_json() for t in self.tasks],
        }


# --- planning ------------------------------------------------------------------


def plan(configs: list[BuildConfig], store: DiskStore, *, force: bool = False) -> list[Task]:
    """A Task per config; cached ones (a valid entry for the current fingerprint) marked so.
    A corrupt entry is quarantined by the lookup and counts as missing."""
    return [plan_one(c, store, force=force) for c in configs]


def plan_one(c: BuildConfig, store: DiskStore, *, force: bool = False) -> Task:
    """``plan`` for one configuration."""
    t = Task(c)
    if not force and store.lookup(builder.entry_ref(c.spec, c.params, c.arch)) is not None:
        t.status = CACHED
    return t


class PastTimes:
    """key -> seconds its last compile took, looked up one key at a time (a streaming
    dry run asks as it goes): any fingerprint's metadata first (an edit changes the
    directory, not the key; the largest wins), else the usage journal. The directory
    listings and the journal are read once, when first needed."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._fp_dirs: dict[str, list[str]] = {}
        self._journal: dict[str, float] | None = None
        self._stamps: list[str] | None = None

    def _kernel_dirs(self, kernel: str) -> list[str]:
        if self._stamps is None:
            try:
                base = self.root / LAYOUT
                self._stamps = [e.path for e in os.scandir(base) if e.is_dir(follow_symlinks=False)]
            except OSError:
                self._stamps = []
        if kernel not in self._fp_dirs:
            out = []
            for st in self._stamps:
                try:
                    kd = os.path.join(st, kernel)
                    out += [e.path for e in os.scandir(kd) if e.is_dir(follow_symlinks=False)]
                except OSError:
                    continue
            self._fp_dirs[kernel] = out
        return self._fp_dirs[kernel]

    def get(self, kernel: str, key: str) -> float | None:
        best = None
        for fp in self._kernel_dirs(kernel):
            try:
                with open(os.path.join(fp, key + ".json"), "rb") as f:
                    v = json.loads(f.read()).get("compile_s")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(v, (int, float)) and v > 0:
                best = max(best or 0.0, float(v))
        if best is not None:
            return best
        if self._journal is None:
            self._journal = {}
            for r in journal.read(self.root):
                rk = r.get("key")
                v = r.get("compile_s")
                if isinstance(rk, str) and r.get("compiles") and isinstance(v, (int, float)) and v > 0:
                    self._journal.setdefault(rk, float(v))
        return self._journal.get(key)


def past_compile_times(root: Path, todo: list[Task]) -> dict[str, float]:
    """key -> seconds its last compile took, for the keys of ``todo`` (see PastTimes)."""
    pt = PastTimes(root)
    out = {}
    for t in todo:
        v = pt.get(t.cfg.kernel, t.cfg.key)
        if v is not None:
            out[t.cfg.key] = v
    return out


def order_longest_first(todo: list[Task], known: dict[str, float]) -> list[Task]:
    """Known compile times first, longest first; unknown keys get their kernel's mean
    (else the overall mean), so one slow kernel family starts early."""
    per_kernel: dict[str, list[float]] = {}
    for t in todo:
        if t.cfg.key in known:
            per_kernel.setdefault(t.cfg.kernel, []).append(known[t.cfg.key])
    allv = [v for vs in per_kernel.values() for v in vs]
    overall = sum(allv) / len(allv) if allv else None
    for t in todo:
        if t.cfg.key in known:
            t.est_s = known[t.cfg.key]
        elif t.cfg.kernel in per_kernel:
            vs = per_kernel[t.cfg.kernel]
            t.est_s = sum(vs) / len(vs)
        else:
            t.est_s = overall
    idx = {id(t): i for i, t in enumerate(todo)}
    return sorted(todo, key=lambda t: (-(t.est_s or 0.0), t.cfg.key not in known, idx[id(t)]))


# --- running -------------------------------------------------------------------


def _remove_partial(store: DiskStore, t: Task) -> None:
    """After an interrupt: what the killed worker left for this key (an object
    published without metadata, its temp files), by the one rule of
    quack.cache.orphans with no grace (we killed the writer and joined it). A
    key whose lock another process holds is left alone."""
    ref = builder.entry_ref(t.cfg.spec, t.cfg.params, t.cfg.arch)
    orphans.sweep_dir(store.paths(ref)["obj"].parent, stems={ref.key}, grace=0.0)


def run(
    tasks: list[Task],
    store: DiskStore,
    *,
    jobs: int,
    reporter: Reporter | None = None,
    keep_going: bool = False,
    force: bool = False,
    log_dir: Path | None = None,
    plan_s: float = 0.0,
    order: str = "longest",
    settings=None,
    remote=None,
    on_pulled=None,
    executor=None,
) -> BuildResult:
    """Compile every task not cached through ``executor`` (default: the local pool of
    ``jobs`` workers; see quack_build.executors); returns the result (check ``.ok``).
    Keys go to the executor in the order given (longest first by default); at most
    ``jobs`` + 2 are outstanding at once, so fail-fast and Ctrl-C stop promptly and
    progress polling stays O(jobs). Raises ExecutorError when the executor cannot start.

    With ``remote`` (a quack.remote.tier.RemoteTier): the keys missing locally are
    pulled first (``on_pulled(task)`` after each), and what is compiled (here or on a
    cluster: this process publishes it) is pushed when the tier may write. Neither ever
    fails the build."""
    from quack import settings as qs
    from quack_build import executors as qex

    s = settings or qs.get()
    rep = reporter or NullReporter()
    t_begin = time.time() - plan_s
    if remote is not None and not force:
        from quack_build.remote_sync import pull

        try:
            pull(tasks, store, remote, on_pulled=on_pulled)
        except KeyboardInterrupt:
            pass  # what was pulled is published; the rest is reported not built below
    todo = [t for t in tasks if t.status not in (CACHED, REMOTE)]
    if todo and order == "longest":
        todo = order_longest_first(todo, past_compile_times(store.root, todo))
    ex = executor
    if todo:
        if ex is None:
            from quack_build.executors.local import LocalExecutor

            ex = LocalExecutor(jobs, settings=s)
        t_start = time.time()
        ex.start(len(todo))
        jobs = ex.jobs
        if hasattr(ex, "describe"):
            rep.note(ex.describe())
    else:
        jobs = max(1, jobs)
    res = BuildResult(tasks, jobs, plan_s=plan_s, t0=t_begin)
    rep.planned(tasks, todo, jobs)
    if remote is not None:
        res.remote_url = remote.url
        n = res.count(REMOTE)
        if n:
            rep.note(f"{n} pulled from the remote cache {remote.url} (signatures verified)")
    if not todo:
        res.wall_s = time.time() - t_begin
        res.missing_after = _missing(tasks, store)
        _remote_done(res, remote)
        rep.close()
        return res
    log_path = None
    queue = list(reversed(todo))  # pop() from the end = longest first
    inflight: dict[str, Task] = {}
    slots = list(range(jobs - 1, -1, -1))
    stop = False
    t_compile = t_start
    window = jobs + 2
    try:
        # After a failure without --keep-going (stop) nothing more is submitted: the loop
        # ends when the in-flight keys have, and what is left queued is reported not built.
        while inflight or (queue and not stop):
            while queue and not stop and len(inflight) < window:
                t = queue.pop()
                t.status = "queued"
                inflight[t.cfg.key] = t
                c = t.cfg
                ex.submit(
                    qex.WorkItem(
                        c.key,
                        c.kernel,
                        c.spec.module,
                        c.plain_params,
                        c.arch,
                        force,
                        spec=c.spec,
                        bound=c.params,
                    )
                )
            for ev in ex.poll(0.1):
                if ev.kind == qex.NOTE:
                    rep.note(ev.text)
                    continue
                found = inflight.get(ev.key)
                if found is None:
                    continue
                t = found
                now_w = time.time()
                if ev.kind == qex.STARTED:
                    if t.status == "running" and t.slot >= 0:  # a retry on another worker
                        slots.append(t.slot)
                    t.status = "running"
                    t.start = ev.t_start or now_w
                    t.pid = ev.pid
                    t.lane = ev.lane
                    t.slot = slots.pop() if slots else -1
                    rep.started(t)
                    continue
                del inflight[ev.key]
                if t.slot >= 0:
                    slots.append(t.slot)
                if not t.start:
                    t.start = now_w
                if ev.kind == qex.DONE:
                    t.status = COMPILED if ev.compiled else SHARED
                    t.compile_s = ev.compile_s
                    t.pid = ev.pid or t.pid
                    t.wall_s = ev.wall_s or (now_w - t.start)
                    t.end = t.start + ev.wall_s if ev.wall_s else now_w
                    if remote is not None and t.status == COMPILED:
                        from quack_build.remote_sync import push_task

                        t.pushed = push_task(t, store, remote)
                else:
                    err = ev.error
                    t.status = FAILED
                    t.end = now_w
                    t.wall_s = max(0.0, t.end - t.start)
                    t.error = _first_line(err)
                    t.detail = getattr(err, "detail", None) or str(err)
                    log_path = _log_failure(log_dir, log_path, t)
                    if not keep_going:
                        stop = True
                rep.finished(t)
            rep.tick()
        ex.close()
    except KeyboardInterrupt:
        res.interrupted = True
        rep.note("interrupted: stopping the workers")
        ex.cancel()
        ex.close()
        for key, t in inflight.items():
            t.status = INTERRUPTED
            t.end = time.time()
            if not t.pid and hasattr(ex, "worker_pid"):
                t.pid = ex.worker_pid(key)
            _remove_partial(store, t)
        for t in queue:
            t.status = INTERRUPTED
    except BaseException:  # the executor lost (ExecutorError) or a bug: stop the workers, the display
        ex.cancel()
        ex.close()
        rep.close()
        raise
    finally:
        ran = [t for t in tasks if t.start and t.end and t.status in (COMPILED, SHARED, FAILED)]
        if ran:
            first_start = min(t.start for t in ran)
            res.compile_wall_s = max(t.end for t in ran) - first_start
            res.pool_start_s = max(0.0, first_start - t_compile)
        else:
            res.compile_wall_s = time.time() - t_compile
        res.log_path = str(log_path) if log_path else ""
        res.executor = ex.name
        res.executor_stats = ex.stats() if hasattr(ex, "stats") else {}
        for t in tasks:
            if t.status in ("todo", "queued", "running"):
                t.status = SKIPPED
    res.wall_s = time.time() - t_begin
    if not res.interrupted:
        res.missing_after = _missing(tasks, store)
    _journal_compiles(store.root, tasks)
    _remote_done(res, remote)
    rep.close()
    return res


def _journal_compiles(root, tasks: list[Task]) -> None:
    """Record the build's compiles in the usage journal (where = "build"), so `quack cache
    stats` counts them beside the run-time ones; they are not uses (prewarm skips them)."""
    t = journal.now()
    recs = [
        {
            "kernel": x.cfg.kernel,
            "key": x.cfg.key,
            "arch": x.cfg.arch,
            "params": x.cfg.plain_params,
            "hits": 0,
            "misses": 0,
            "compiles": 1,
            "compile_s": round(x.compile_s, 4),
            "where": "build",
            "t": t,
        }
        for x in tasks
        if x.status == COMPILED
    ]
    if recs:
        try:
            journal.append(Path(root), recs)
        except OSError:
            pass  # the journal is best effort; the build's result stands


def _remote_done(res: BuildResult, remote) -> None:
    if remote is not None:
        res.remote = remote.counters.to_json()
        res.remote_offline = remote.offline


def _first_line(err) -> str:
    """The failure's one line: the compiler's own first error (not CuTe's closing advice,
    no ANSI codes); the full text goes to the build log."""
    from quack.compile.diagnostics import first_error_line

    if err is None:
        return "failed"
    detail = getattr(err, "detail", None)
    if detail:
        return first_error_line(str(detail))
    return first_error_line(f"{type(err).__name__}: {err}")


def _missing(tasks: list[Task], store: DiskStore) -> list[str]:
    """Keys not in the cache after the build (exit 0 only if none)."""
    out = []
    for t in tasks:
        if t.status in (FAILED, SKIPPED, INTERRUPTED):
            out.append(t.cfg.key)
            continue
        if store.lookup(builder.entry_ref(t.cfg.spec, t.cfg.params, t.cfg.arch)) is None:
            out.append(t.cfg.key)
    return out


def _log_failure(log_dir: Path | None, log_path: Path | None, t: Task) -> Path | None:
    """Append a failed compile's full error text to this build's log file."""
    if log_dir is None:
        return log_path
    try:
        if log_path is None:
            log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            log_path = log_dir / time.strftime(f"build-%Y%m%d-%H%M%S-{os.getpid()}.log")
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(f"=== {t.cfg.label()}  key {t.cfg.key}\n--- {t.error}\n{t.detail}\n\n")
    except OSError:
        return log_path
    return log_path


# --- trace ---------------------------------------------------------------------


def write_trace(path: Path, res: BuildResult, t0: float) -> None:
    """Chrome trace-event JSON (chrome://tracing, ui.perfetto.dev): one row per worker."""
    ev = [
        {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "quack build"}},
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "scheduler"}},
    ]
    if res.plan_s:
        ev.append(
            {
                "name": "plan (expand, look up cache)",
                "cat": "plan",
                "ph": "X",
                "pid": 1,
                "tid": 0,
                "ts": 0,
                "dur": int(res.plan_s * 1e6),
            }
        )
    # One row per worker: a local pool's by pid; a cluster's by its lane (an actor's
    # node and pid: pids of different nodes may coincide).
    lanes = sorted({(t.lane, t.pid) for t in res.tasks if t.pid or t.lane}, key=lambda x: (x[0], x[1]))
    tids = {}
    for i, (lane, pid) in enumerate(lanes):
        tids[(lane, pid)] = tid = (pid if not lane else 100000 + i) or 100000 + i
        name = f"worker {i + 1} (pid {pid})" if not lane else lane
        ev.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}})
    for t in res.tasks:
        if not (t.pid or t.lane) or t.end <= 0:
            continue
        ev.append(
            {
                "name": t.cfg.kernel,
                "cat": t.status,
                "ph": "X",
                "pid": 1,
                "tid": tids[(t.lane, t.pid)],
                "ts": int((t.start - t0) * 1e6),
                "dur": max(1, int((t.end - t.start) * 1e6)),
                "args": {
                    "params": t.cfg.plain_params,
                    "arch": t.cfg.arch,
                    "key": t.cfg.key,
                    "status": t.status,
                    "compile_s": round(t.compile_s, 4),
                    **({"error": t.error} if t.error else {}),
                },
            }
        )
    doc = {
        "traceEvents": ev,
        "displayTimeUnit": "ms",
        "otherData": {
            "tool": "quack build",
            "summary": {k: v for k, v in res.to_json().items() if k != "keys"},
        },
    }
    Path(path).write_text(json.dumps(doc, indent=None), encoding="utf-8")
