"""The build scheduler: compile what is not cached through an executor (a pool of warm
workers by default, see quack_build.executors), report progress, log failures, record
the compiles in the usage journal.

Its parts: the records (statuses, Task, BuildResult, Reporter) are
quack_build.buildtasks; planning (what is cached, longest first) quack_build.planning;
the trace file quack_build.trace. The names callers import from here still are.

The build process never imports torch or cutlass: workers fork from quack's
forkserver (cutlass imported and one compile done there) and run
``quack.compile.worker.worker_build``."""

from __future__ import annotations

import os
import time
from pathlib import Path

from quack.cache import journal, orphans
from quack.cache.store import DiskStore
from quack.compile import builder
from quack.errors import PreloadError
from quack_build import interrupts
from quack_build.buildtasks import (
    CACHED,
    COMPILED,
    FAILED,
    INTERRUPTED,
    REMOTE,
    SHARED,
    SKIPPED,
    BuildResult,
    NullReporter,
    Reporter,
    Task,
)
from quack_build.planning import PastTimes, order_longest_first, past_compile_times, plan, plan_one
from quack_build.trace import write_trace

# The names callers import from here (their homes: buildtasks, planning, trace).
__all__ = [
    "CACHED",
    "COMPILED",
    "FAILED",
    "INTERRUPTED",
    "REMOTE",
    "SHARED",
    "SKIPPED",
    "BuildResult",
    "NullReporter",
    "PastTimes",
    "Reporter",
    "Task",
    "order_longest_first",
    "past_compile_times",
    "plan",
    "plan_one",
    "run",
    "write_trace",
]


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
    pull_interrupted = False
    if remote is not None and not force:
        from quack_build.remote_sync import pull

        try:
            pull(tasks, store, remote, on_pulled=on_pulled)
        except KeyboardInterrupt:
            # What was pulled is published; the rest is not built. (This used to go on
            # to compile everything: the Ctrl-C was swallowed and the build exited 0.)
            pull_interrupted = True
    todo = [t for t in tasks if t.status not in (CACHED, REMOTE)]
    if pull_interrupted:
        return _interrupted_before_compiling(tasks, todo, jobs, plan_s, t_begin, rep, remote)
    if todo and order == "longest":
        todo = order_longest_first(todo, past_compile_times(store.root, todo))
    ex = executor
    if todo:
        if ex is None:
            from quack_build.executors.local import LocalExecutor

            ex = LocalExecutor(jobs, settings=s)
        t_start = time.time()
        ex.start(len(todo))
        # A library the executor started may have replaced the build's signal handlers
        # (ray.init installs a SIGTERM handler that exits 15 without the cleanup below).
        interrupts.reassert()
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
                    # A preload that fails to import fails every key a worker gets: stop
                    # even with --keep-going (nothing can compile).
                    if not keep_going or isinstance(err, PreloadError):
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
        res.preload = tuple(s.preload)
        res.preload_s = float(getattr(ex, "preload_s", 0.0) or 0.0)
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


def _interrupted_before_compiling(tasks, todo, jobs, plan_s, t_begin, rep, remote) -> BuildResult:
    """The result of a build interrupted before any compile started (in the pull)."""
    res = BuildResult(tasks, max(1, jobs), plan_s=plan_s, t0=t_begin)
    res.interrupted = True
    for t in todo:
        t.status = INTERRUPTED
    rep.note("interrupted: nothing compiled")
    res.wall_s = time.time() - t_begin
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
