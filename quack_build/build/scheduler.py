"""The build scheduler: compile what is not cached through an executor (a pool of warm
workers by default, see quack_build.build.executors), report progress, log failures,
record the compiles in the usage journal.

A build is a ``BuildSession`` over planned tasks and a store, configured by one
``BuildOptions``; ``BuildSession.run`` goes through named steps: pull from the remote
tier, start the executor, the compile loop (submit a window, apply each event),
the interrupt or failure path, the result. The records it fills in (statuses, Task,
BuildResult, Reporter) are quack_build.build.results; planning (what is cached,
longest first) quack_build.build.plan; the trace file quack_build.build.trace.

The build process never imports torch or cutlass: workers fork from quack's
forkserver (cutlass imported and one compile done there) and run
``quack.compile.worker.worker_build``."""

from __future__ import annotations

import dataclasses
import os
import stat
import time
from pathlib import Path
from typing import Any, Callable

from quack.cache import fsutil, journal, orphans
from quack.cache.store import DiskStore
from quack.compile import builder
from quack.errors import PreloadError
from quack_build.build import failures, interrupts
from quack_build.build.executors.base import DONE, NOTE, STARTED, Event, Executor, WorkItem
from quack_build.build.plan import order_longest_first, past_compile_times
from quack_build.build.results import (
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


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    """How to run a build.

    jobs: local workers (an executor passed in decides its own count). reporter: the
    progress display (default: none). keep_going: go on after a failed compile. force:
    rebuild what is cached (and skip the remote pull). log_dir: where failed compiles'
    full text goes (None: nowhere). plan_s: seconds the planning took (counted in the
    wall time). order: "longest" (longest first, from past compile times) or "given".
    settings: quack.settings (default: the current ones). remote: a
    quack.remote.tier.RemoteTier to pull from before and push to after; on_pulled:
    called with each task pulled. executor: where to compile (default: the local pool
    of ``jobs`` workers)."""

    jobs: int
    reporter: Reporter | None = None
    keep_going: bool = False
    force: bool = False
    log_dir: Path | None = None
    plan_s: float = 0.0
    order: str = "longest"
    settings: Any = None
    remote: Any = None
    on_pulled: Callable[[Task], None] | None = None
    executor: Executor | None = None


#: How long an interrupted build waits for the workers it killed to be gone before it
#: sweeps their temp files (a SIGKILLed process ends in milliseconds; one stuck in the
#: kernel, on a hung network filesystem, may not: its files are then reported left).
WORKERS_GONE_S = 3.0


def _remove_partial(store: DiskStore, t: Task, ours: set[int], gone: set[int]) -> list[str]:
    """After an interrupt: what the killed worker left for this key (an object
    published without metadata, its temp files), by the one rule of
    quack.cache.orphans with no grace; a temp file of one of this build's workers
    that has ended (``gone``) without asking whether its pid lives. A key whose lock
    another process holds is left alone. Returns the paths of what this build's writers
    (``ours``: every worker it started) still left for the key, for the summary."""
    ref = builder.entry_ref(t.cfg.spec, t.cfg.params, t.cfg.arch)
    d = store.paths(ref)["obj"].parent
    orphans.sweep_dir(d, stems={ref.key}, grace=0.0, writers_gone=gone)
    return _partial_files(d, ref.key, ours, mine=not t.awaited)


def _partial_files(d: Path, key: str, ours: set[int], *, mine: bool) -> list[str]:
    """The regular files of ``key`` in ``d`` that an interrupted write of this build
    left: a temp file named for one of its workers (``ours``); and, for a key it was
    building (``mine``; not one awaited on another process's lock), an object without
    metadata or a .so without its sidecar."""
    try:
        names = set(os.listdir(d))
    except OSError:
        return []
    out = []
    for name in sorted(names):
        if name.split(".", 1)[0] != key:
            continue
        try:
            if not stat.S_ISREG(os.lstat(d / name).st_mode):
                continue
        except OSError:
            continue
        pid = fsutil.tmp_owner_pid(name)
        if pid is not None:
            left = pid in ours
        elif name.endswith(".o"):
            left = mine and f"{key}.json" not in names
        elif name.endswith(".so"):
            left = mine and f"{key}.so.json" not in names
        else:
            left = False
        if left:
            out.append(str(d / name))
    return out


class BuildSession:
    """One build: compile every task not cached through the executor; ``run`` returns
    the result (check ``.ok``). Keys go to the executor in the order given (longest
    first by default); at most ``jobs`` + 2 are outstanding at once, so fail-fast and
    Ctrl-C stop promptly and progress polling stays O(jobs). ``run`` raises
    ExecutorError when the executor cannot start, PreloadError when a ``[build] preload``
    module cannot be found (local executor).

    With a remote tier: the keys missing locally are pulled first, and what is compiled
    (here or on a cluster: this process publishes it) is pushed when the tier may
    write. Neither ever fails the build."""

    def __init__(self, tasks: list[Task], store: DiskStore, options: BuildOptions):
        from quack import settings as qs

        self.tasks = tasks
        self.store = store
        self.opts = options
        self.settings = options.settings or qs.get()
        self.rep: Reporter = options.reporter or NullReporter()
        self.remote = options.remote
        self.jobs = options.jobs
        self.t_begin = time.time() - options.plan_s
        self.ex: Any = options.executor
        self.log_path: Path | None = None
        self.queue: list[Task] = []
        self.inflight: dict[str, Task] = {}
        self.slots: list[int] = []
        self.stop = False

    def run(self) -> BuildResult:
        if not self._pull():
            return self._interrupted_before_compiling()
        todo = [t for t in self.tasks if t.status not in (CACHED, REMOTE)]
        if todo and self.opts.order == "longest":
            todo = order_longest_first(todo, past_compile_times(self.store.root, todo))
        if todo:
            t_compile = self._start_executor(todo)
        else:
            self.jobs = max(1, self.jobs)
            t_compile = time.time()
        res = BuildResult(self.tasks, self.jobs, plan_s=self.opts.plan_s, t0=self.t_begin)
        self.rep.planned(self.tasks, todo, self.jobs)
        self._note_pulled(res)
        if not todo:
            res.wall_s = time.time() - self.t_begin
            res.missing_after = _missing(self.tasks, self.store)
            _remote_done(res, self.remote)
            self.rep.close()
            return res
        self.queue = list(reversed(todo))  # pop() from the end = longest first
        self.slots = list(range(self.jobs - 1, -1, -1))
        try:
            self._compile_loop()
            self.ex.close()
        except KeyboardInterrupt:
            self._interrupt(res)
        except BaseException:  # the executor lost (ExecutorError) or a bug: stop the workers, the display
            self.ex.cancel()
            self.ex.close()
            self.rep.close()
            raise
        finally:
            self._fill_result(res, t_compile)
        res.wall_s = time.time() - self.t_begin
        # Interrupted, it was left [] beside "not_built": 6, and --json read as "nothing
        # missing". Then it comes from the tasks alone: no store reads in a stop that must
        # end within seconds (and may meet a second Ctrl-C).
        res.missing_after = _missing(self.tasks, None if res.interrupted else self.store)
        _journal_compiles(self.store.root, self.tasks)
        _remote_done(res, self.remote)
        self.rep.close()
        return res

    # -- the steps of run ---------------------------------------------------------------

    def _pull(self) -> bool:
        """Pull the keys missing locally from the remote tier; False when interrupted."""
        if self.remote is None or self.opts.force:
            return True
        from quack_build.build.remote import pull

        try:
            pull(self.tasks, self.store, self.remote, on_pulled=self.opts.on_pulled)
        except KeyboardInterrupt:
            # What was pulled is published; the rest is not built. (This used to go on
            # to compile everything: the Ctrl-C was swallowed and the build exited 0.)
            return False
        return True

    def _start_executor(self, todo: list[Task]) -> float:
        """Start the executor for ``todo``; returns when the compile phase began."""
        if self.ex is None:
            from quack_build.build.executors.local import LocalExecutor

            self.ex = LocalExecutor(self.jobs, settings=self.settings)
        if self.ex.name == "local":
            # A [build] preload module this process cannot find stops the build here, before
            # the forkserver's seconds of start-up and before any key (PreloadError, which
            # the CLI reports). Not for Ray: the modules must be on the nodes, not here, and
            # an actor that cannot import one fails its start naming it.
            from quack.compile import preload

            preload.check(self.settings.preload, self.settings.sources.get("preload", ""))
        t_start = time.time()
        self.ex.start(len(todo))
        # A library the executor started may have replaced the build's signal handlers
        # (ray.init installs a SIGTERM handler that exits 15 without the cleanup below).
        interrupts.reassert()
        self.jobs = self.ex.jobs
        if hasattr(self.ex, "describe"):
            self.rep.note(self.ex.describe())
        return t_start

    def _note_pulled(self, res: BuildResult) -> None:
        if self.remote is not None:
            res.remote_url = self.remote.url
            n = res.count(REMOTE)
            if n:
                self.rep.note(f"{n} pulled from the remote cache {self.remote.url} (signatures verified)")

    def _compile_loop(self) -> None:
        # After a failure without --keep-going (stop) nothing more is submitted: the loop
        # ends when the in-flight keys have, and what is left queued is reported not built.
        while self.inflight or (self.queue and not self.stop):
            self._submit_window()
            for ev in self.ex.poll(0.1):
                self._on_event(ev)
            self.rep.tick()

    def _submit_window(self) -> None:
        window = self.jobs + 2
        # A key awaited on another process's lock occupies no worker: counted in the window,
        # a few such keys (another build compiling them) left this build's workers idle.
        busy = sum(1 for t in self.inflight.values() if not t.awaited)
        while self.queue and not self.stop and busy < window:
            busy += 1
            t = self.queue.pop()
            t.status = "queued"
            self.inflight[t.cfg.key] = t
            c = t.cfg
            self.ex.submit(
                WorkItem(
                    c.key,
                    c.kernel,
                    c.spec.module,
                    c.plain_params,
                    c.arch,
                    self.opts.force,
                    spec=c.spec,
                    bound=c.params,
                )
            )

    def _on_event(self, ev: Event) -> None:
        if ev.kind == NOTE:
            self.rep.note(ev.text)
            return
        t = self.inflight.get(ev.key)
        if t is None:
            return
        now_w = time.time()
        if ev.kind == STARTED:
            self._on_started(t, ev, now_w)
            return
        del self.inflight[ev.key]
        if t.slot >= 0:
            self.slots.append(t.slot)
        if not t.start:
            t.start = now_w
        if ev.kind == DONE:
            self._on_done(t, ev, now_w)
        else:
            self._on_failed(t, ev, now_w)
        self.rep.finished(t)

    def _on_started(self, t: Task, ev: Event, now_w: float) -> None:
        if t.status == "running" and t.slot >= 0:  # a retry on another worker
            self.slots.append(t.slot)
        t.status = "running"
        t.start = ev.t_start or now_w
        t.pid = ev.pid
        t.lane = ev.lane
        t.awaited = ev.awaited
        # An awaited key (another process holds its lock) takes no worker's slot in the display.
        t.slot = self.slots.pop() if self.slots and not ev.awaited else -1
        self.rep.started(t)

    def _on_done(self, t: Task, ev: Event, now_w: float) -> None:
        t.status = COMPILED if ev.compiled else SHARED
        t.compile_s = ev.compile_s
        t.pid = ev.pid or t.pid
        t.wall_s = ev.wall_s or (now_w - t.start)
        t.end = t.start + ev.wall_s if ev.wall_s else now_w
        if self.remote is not None and t.status == COMPILED:
            from quack_build.build.remote import push_task

            t.pushed = push_task(t, self.store, self.remote)

    def _on_failed(self, t: Task, ev: Event, now_w: float) -> None:
        err = ev.error
        t.status = FAILED
        t.end = now_w
        t.wall_s = max(0.0, t.end - t.start)
        t.error = failures.first_line(err)
        # The cache could not take the object (disk full, read-only): the key compiled, the
        # store failed; the summary says so instead of counting it as a compile failure.
        t.failure = failures.cause(err)
        t.detail = getattr(err, "detail", None) or str(err)
        self.log_path = failures.log_failure(self.opts.log_dir, self.log_path, t)
        # A preload that fails to import fails every key a worker gets: stop
        # even with --keep-going (nothing can compile).
        if not self.opts.keep_going or isinstance(err, PreloadError):
            self.stop = True

    def _interrupt(self, res: BuildResult) -> None:
        """Ctrl-C in the compile phase: kill the workers, sweep what they left."""
        res.interrupted = True
        self.rep.note("interrupted: stopping the workers")
        self.ex.cancel()
        self.ex.close()
        ours, gone = self._workers_gone()
        for key, t in self.inflight.items():
            t.status = INTERRUPTED
            t.end = time.time()
            if not t.pid and hasattr(self.ex, "worker_pid"):
                t.pid = self.ex.worker_pid(key)
            res.partial_left.extend(_remove_partial(self.store, t, ours, gone))
        for t in self.queue:
            t.status = INTERRUPTED

    def _workers_gone(self) -> tuple[set[int], set[int]]:
        """(every worker the executor started, those of them seen gone). The executor
        killed them (``cancel``); wait, bounded, until they have really ended: its join()
        is no proof (a forkserver's worker is the forkserver's child: with the forkserver
        dead, join() returned at once), and a temp file's sweep decided by "is its pid
        alive" took a dying worker (a zombie) for a live writer and left the file."""
        pids = getattr(self.ex, "worker_pids", None)
        ours = set(pids()) if callable(pids) else set()
        if not ours:
            return ours, set()
        return ours, ours - fsutil.wait_gone(ours, WORKERS_GONE_S)

    def _fill_result(self, res: BuildResult, t_compile: float) -> None:
        """The compile phase's timings and the executor's figures; what never ran is skipped."""
        ex = self.ex
        # Keys awaited on another process's lock ran on no worker of this build: they start
        # at once (their "start" is the submit), which put the first start before the pool's.
        ran = [
            t
            for t in self.tasks
            if t.start and t.end and t.status in (COMPILED, SHARED, FAILED) and not t.awaited
        ]
        if ran:
            first_start = min(t.start for t in ran)
            res.compile_wall_s = max(t.end for t in ran) - first_start
            res.pool_start_s = max(0.0, first_start - t_compile)
        else:
            res.compile_wall_s = time.time() - t_compile
        res.log_path = failures.log_with_content(self.log_path)
        res.executor = ex.name
        res.preload = tuple(self.settings.preload)
        res.preload_s = float(getattr(ex, "preload_s", 0.0) or 0.0)
        res.executor_stats = ex.stats() if hasattr(ex, "stats") else {}
        for t in self.tasks:
            if t.status in ("todo", "queued", "running"):
                t.status = SKIPPED

    def _interrupted_before_compiling(self) -> BuildResult:
        """The result of a build interrupted before any compile started (in the pull)."""
        todo = [t for t in self.tasks if t.status not in (CACHED, REMOTE)]
        res = BuildResult(self.tasks, max(1, self.jobs), plan_s=self.opts.plan_s, t0=self.t_begin)
        res.interrupted = True
        for t in todo:
            t.status = INTERRUPTED
        self.rep.note("interrupted: nothing compiled")
        res.wall_s = time.time() - self.t_begin
        res.missing_after = _missing(self.tasks, None)
        _remote_done(res, self.remote)
        self.rep.close()
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
        if res.remote.get("replaced"):
            remote.warn_replaced()  # one warning: how many refused objects were replaced, and why


def _missing(tasks: list[Task], store: DiskStore | None) -> list[str]:
    """Keys not in the cache after the build (exit 0 only if none): those not built, and
    each other one the store no longer holds (``store`` None: the statuses alone)."""
    out = []
    for t in tasks:
        if t.status in (FAILED, SKIPPED, INTERRUPTED):
            out.append(t.cfg.key)
            continue
        if (
            store is not None
            and store.lookup(builder.entry_ref(t.cfg.spec, t.cfg.params, t.cfg.arch)) is None
        ):
            out.append(t.cfg.key)
    return out
