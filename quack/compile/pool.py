"""The compile pool: misses compile in GPU-blind worker processes forked from a
warm forkserver; the published .o is the only result channel.

Per-key state: new -> pending -> done | failed. ``pool_scope()`` makes
``@jit_cache`` raise CompilePending on a miss instead of waiting (the pytest
plugin and autotuning use it); ``suppress_pool()`` turns that off in a block.

Design (why not ProcessPoolExecutor): the pool runs its own workers, one
task at a time each, from a dispatcher thread. It therefore knows which key
each worker holds, so

* a worker that dies (killed, segfault, OOM killer) fails *its* key only, with
  the signal in the message, and is replaced; the other keys carry on;
* a compile running past its time-out (a wedged worker) is killed, its key
  failed with :class:`CompileTimeout` (``@jit_cache`` then compiles in-process),
  and the slot is freed;
* ``submit`` never blocks: workers are started by the dispatcher thread, so the
  forkserver's preload (cutlass import + a warm-up compile, seconds) is never
  paid on the caller's thread;
* shutdown kills workers and returns at once: nothing waits for idle (or busy)
  workers at interpreter exit.

A key whose per-key lock another process holds (another xdist worker, a
``quack build``) is not submitted but awaited: ``quack/compile/external.py``.

States are per (cache root, key): a pool used under several Settings (tests
that install their own cache directory) never confuses their entries.

Modules: the worker process (its request, main loop and start) is
``quack/compile/worker.py``; the per-key states, outcomes and counters are
``quack/compile/tasks.py``; the scopes (``pool_scope``, ``suppress_pool``, the
per-attempt records) are ``quack/compile/scope.py``. The names callers used to
import from here still are."""

from __future__ import annotations

import logging
import os
import threading
import time
from multiprocessing import connection as mpc

from quack.compile import external, tasks, worker
from quack.compile.external import lock_held
from quack.compile.scope import (  # re-exported: callers import them from here
    active_pool,
    note_not_prebuilt,
    note_pending,
    pool_scope,
    recording_not_prebuilt,
    recording_pending,
    suppress_pool,
)
from quack.compile.tasks import DONE, FAILED, NEW, PENDING, Task, TaskInfo
from quack.compile.worker import WorkerRequest, masked_main, worker_build
from quack.errors import CompileTimeout

__all__ = [
    "DONE",
    "FAILED",
    "NEW",
    "PENDING",
    "CompilePool",
    "TaskInfo",
    "WorkerRequest",
    "active_pool",
    "configure_default",
    "default_pool",
    "lock_held",
    "masked_main",
    "note_not_prebuilt",
    "note_pending",
    "pool_scope",
    "recording_not_prebuilt",
    "recording_pending",
    "suppress_pool",
    "worker_build",
]

EXTERNAL_POLL_S = 0.1
log = logging.getLogger("quack.pool")


# -- the pool --------------------------------------------------------------------------------
class _Worker:
    __slots__ = ("proc", "conn", "task")

    def __init__(self, proc, conn):
        self.proc, self.conn = proc, conn
        self.task: Task | None = None


class CompilePool:
    """A pool of compile workers with per-key state. Thread-safe; ``submit``
    never blocks. Nothing starts until the first submit (or ``prewarm``)."""

    def __init__(self, jobs: int | None = None, *, settings=None, start_method: str | None = None):
        from quack import settings as _settings

        self.settings = settings or _settings.get()
        self.jobs = jobs or self.settings.compile_jobs or min(os.cpu_count() or 1, 16)
        self.start_method = start_method or self.settings.pool_start
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._book = tasks.TaskBook()  # per-key states, outcomes, counters
        self._queue: list[Task] = []
        self._external: dict[tuple, Task] = {}
        self._workers: list[_Worker] = []
        self._want_workers = 0
        self._thread: threading.Thread | None = None
        self._wake_r: int = -1
        self._wake_w: int | None = None
        self._closed = False
        self.generation = 0  # bumped on every state change (see wait_change)
        self.counts = self._book.counts  # the same dict: stats() reads it

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._thread is not None

    def _ensure_thread(self) -> None:
        if self._thread is None:
            if self._closed:
                raise RuntimeError("compile pool is shut down")
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_w, False)
            self._thread = threading.Thread(target=self._run, name="quack-compile-pool", daemon=True)
            self._thread.start()

    def _wake(self) -> None:
        if self._wake_w is not None:
            try:
                os.write(self._wake_w, b"x")
            except (BlockingIOError, OSError):
                pass

    def prewarm(self) -> None:
        """Start the forkserver and every worker now, in the background; returns at once."""
        with self._lock:
            self._want_workers = self.jobs
            self._ensure_thread()
            self._wake()

    def shutdown(self, wait: bool = False) -> None:
        """Kill the workers and stop. Never waits for a compile; ``wait=True`` only
        joins the (already killed) processes."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers, self._workers = self._workers, []
            for t in list(self._queue) + [w.task for w in workers if w.task] + list(self._external.values()):
                self._book.cancel(t)
            self._queue.clear()
            self._external.clear()
            self._bump()
            self._wake()
        for w in workers:
            try:
                w.proc.kill()
            except Exception:  # noqa: BLE001
                pass
            try:
                w.conn.close()
            except Exception:  # noqa: BLE001
                pass
        if wait:
            for w in workers:
                w.proc.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown(wait=False)

    # -- identity ----------------------------------------------------------------------------
    def _ident(self, key: str, root=None) -> tuple:
        if root is None:
            from quack import settings as _settings

            root = _settings.get().cache_dir
        return (str(root), key)

    def _bump(self) -> None:
        self.generation += 1
        self._cond.notify_all()

    # -- work --------------------------------------------------------------------------------
    def submit(
        self,
        spec,
        params: dict,
        arch: str,
        key: str,
        *,
        settings=None,
        force: bool = False,
        timeout: float | None = None,
    ) -> str:
        """Queue a compile unless the key is pending or done. Returns its state.
        ``settings`` (default: this process's current settings) gives the cache
        the worker publishes into and the time-out."""
        from quack import settings as _settings

        s = settings or _settings.get()
        ident = (str(s.cache_dir), key)
        with self._lock:
            st = self._book.state(ident)
            if st in (PENDING, DONE):
                return st
            plain = spec.plain(params)
            args = WorkerRequest(
                spec.module, spec.name, plain, arch, str(s.cache_dir), s.fsync, s.lock_timeout, force
            )
            task = Task(
                ident,
                key,
                s.cache_dir,
                spec.name,
                plain,
                arch,
                args,
                timeout if timeout is not None else s.compile_timeout,
            )
            self._book.begin(task)
            if not force:
                ext = external.paths(spec, params, arch, s)
                if ext is not None and external.lock_held(ext[0]):
                    task.external_lock, task.obj_meta = ext
                    task.started = time.monotonic()
                    self._external[ident] = task
                    self.counts["awaited_external"] += 1
                    log.info(
                        "pool: %s %s is being compiled by another process; awaiting it", spec.name, key[:16]
                    )
                    self._ensure_thread()
                    self._bump()
                    self._wake()
                    return PENDING
            self._queue.append(task)
            self.counts["submitted"] += 1
            log.debug("pool: submitted %s %s", spec.name, key[:16])
            self._ensure_thread()
            self._bump()
            self._wake()
            return PENDING

    def state(self, key: str, root=None) -> str:
        with self._lock:
            return self._book.state(self._ident(key, root))

    def poll(self, key: str, root=None) -> tuple[str, BaseException | None]:
        """(state, error) of a key."""
        ident = self._ident(key, root)
        with self._lock:
            return self._book.poll(ident)

    def error(self, key: str, root=None) -> BaseException | None:
        with self._lock:
            return self._book.error(self._ident(key, root))

    def report(self, key: str, root=None) -> dict | None:
        with self._lock:
            return self._book.report(self._ident(key, root))

    def forget(self, key: str, root=None) -> None:
        """Drop a key's state (after a failure was reported, so it may be retried)."""
        ident = self._ident(key, root)
        with self._lock:
            self._book.forget(ident)  # not a pending key: that would let a second compile start

    def task_info(self, key: str, root=None) -> TaskInfo | None:
        """The pool's record of a key's current task (None if it has none)."""
        with self._lock:
            t = self._book.task(self._ident(key, root))
            return None if t is None else t.info()

    def pending_for(self, key: str, root=None) -> float:
        with self._lock:
            t = self._book.task(self._ident(key, root))
            return 0.0 if t is None or t.started is None else time.monotonic() - t.started

    def wait(self, key: str, timeout: float | None = None, root=None) -> tuple[str, BaseException | None]:
        """Block until the key is no longer pending (or ``timeout``); returns (state, error).
        Compile time-outs are the pool's job (the key fails with CompileTimeout)."""
        ident = self._ident(key, root)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._book.state(ident) == PENDING:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
            return self._book.poll(ident)

    def wait_change(self, since: int, timeout: float | None = None) -> int:
        """Block until ``generation`` moves past ``since`` (any key changed state)."""
        with self._lock:
            if self.generation == since:
                self._cond.wait(timeout)
            return self.generation

    def stats(self) -> dict:
        with self._lock:
            d: dict[str, object] = dict(self.counts)
            d["compile_s"] = round(self.counts["compile_s"], 3)
            d["pending"] = self._book.pending()
            d["queued"] = len(self._queue)
            d["running"] = sum(1 for w in self._workers if w.task is not None)
            d["workers"] = len(self._workers)
            d["errors"] = self._book.error_texts()
            return d

    # -- the dispatcher thread ---------------------------------------------------------------
    def _finish(self, task: Task, ok: bool, payload) -> None:
        """Record a task's outcome and wake the waiters; caller holds the lock."""
        if self._book.finish(task, ok, payload):
            self._bump()

    def _spawn(self) -> _Worker:
        proc, parent = worker.start_worker(self.start_method)
        with self._lock:
            self.counts["workers_started"] += 1
        log.debug("pool: started worker pid %s (%s)", proc.pid, self.start_method)
        return _Worker(proc, parent)

    def _run(self) -> None:
        """The dispatcher thread's loop, until shutdown: (1) under the lock, settle
        time-outs and keys awaited elsewhere, hand queued keys to idle workers and
        decide what to wait on; (2) start one worker outside the lock if one is
        needed; else (3) wait for a result, a death, a wake-up or a deadline, and
        collect what arrived."""
        while True:
            with self._lock:
                if self._closed:
                    break
                now = time.monotonic()
                self._check_deadlines(now)
                self._check_external(now)
                self._dispatch()
                need = self._workers_needed()
                objs = self._wait_objects()
                timeout = self._next_timeout(now)
            if need > 0:
                if not self._start_worker():
                    break  # shut down while it started
                continue
            ready = self._wait_ready(objs, timeout)
            with self._lock:
                if self._closed:
                    break
                self._collect(ready)

    def _dispatch(self) -> None:
        """Send queued tasks to idle workers, oldest first; caller holds the lock."""
        idle = [w for w in self._workers if w.task is None]
        while self._queue and idle:
            w = idle.pop()
            t = self._queue.pop(0)
            try:
                w.conn.send((worker_build, t.request))
            except (OSError, ValueError):
                self._queue.insert(0, t)
                continue  # a dead worker; its sentinel reports it when collected
            w.task, t.started, t.pid = t, time.monotonic(), w.proc.pid

    def _workers_needed(self) -> int:
        """How many workers to start (queued work or a prewarm), within ``jobs``;
        caller holds the lock."""
        return min(
            max(len(self._queue), self._want_workers - len(self._workers)),
            self.jobs - len(self._workers),
        )

    def _wait_objects(self) -> list:
        """The wake pipe, and each worker's pipe and process sentinel; caller holds the lock."""
        objs: list = [self._wake_r]
        for w in self._workers:
            objs.append(w.conn)
            objs.append(w.proc.sentinel)
        return objs

    def _start_worker(self) -> bool:
        """Start one worker, outside the lock (the first start waits for the forkserver).
        A worker that can't start fails what is queued. Returns False if the pool was
        shut down meanwhile (the new worker is killed)."""
        try:
            w = self._spawn()
        except Exception as e:  # noqa: BLE001 - can't start workers: fail what is queued
            with self._lock:
                for t in self._queue:
                    self._finish(t, False, tasks.cannot_start_error(t, e))
                self._queue.clear()
                self._want_workers = 0
            return True
        with self._lock:
            if self._closed:
                w.proc.kill()
                return False
            self._workers.append(w)
        return True

    @staticmethod
    def _wait_ready(objs: list, timeout: float | None) -> list:
        """Block until one of ``objs`` is ready or ``timeout`` passes (outside the lock)."""
        try:
            return mpc.wait(objs, timeout)
        except OSError:
            return []

    def _collect(self, ready: list) -> None:
        """Drain the wake pipe, record each result that arrived and reap dead workers
        (a worker that died mid-task fails its key); caller holds the lock."""
        if self._wake_r in ready:
            try:
                os.read(self._wake_r, 4096)
            except OSError:
                pass
        for w in list(self._workers):
            if w.conn in ready:
                try:
                    status, payload = w.conn.recv()
                except (EOFError, OSError):
                    self._reap(w)  # died mid-task: its key fails
                    continue
                done, w.task = w.task, None
                if done is not None:
                    self._finish(done, status == "ok", payload)
            if w.proc.sentinel in ready:
                self._reap(w)

    def _reap(self, w: _Worker) -> None:
        if w not in self._workers:
            return
        self._workers.remove(w)
        if w.proc.exitcode is None:
            try:
                w.proc.kill()
            except Exception:  # noqa: BLE001
                pass
        w.proc.join(1.0)
        try:
            w.conn.close()
        except Exception:  # noqa: BLE001
            pass
        t, w.task = w.task, None
        if t is not None:
            self.counts["worker_deaths"] += 1
            log.warning(
                "pool: worker pid %s died (exit %s) compiling %s %s; replaced",
                w.proc.pid,
                w.proc.exitcode,
                t.kernel,
                t.key[:16],
            )
            self._finish(t, False, tasks.worker_died_error(t, w.proc.exitcode))

    def _check_deadlines(self, now: float) -> None:
        for w in list(self._workers):
            t = w.task
            if t is not None and t.started is not None and now - t.started > t.timeout:
                try:
                    w.proc.kill()
                except Exception:  # noqa: BLE001
                    pass
                w.task = None
                self._reap(w)
                self.counts["timeouts"] += 1
                log.warning("pool: %s %s ran past %.0f s; worker killed", t.kernel, t.key[:16], t.timeout)
                self._finish(t, False, CompileTimeout(t.kernel, t.key, now - t.started))

    def _check_external(self, now: float) -> None:
        for ident, t in list(self._external.items()):
            what = external.check(t, now)
            if what is None:
                continue
            del self._external[ident]
            if what == external.PUBLISHED:
                self._finish(t, True, {"key": t.key, "compiled": False, "external": True})
            elif what == external.RELEASED:
                self._book.renew(ident)
                self._bump()
            else:
                assert t.started is not None  # submit sets it for every external task
                self.counts["timeouts"] += 1
                self._finish(t, False, CompileTimeout(t.kernel, t.key, now - t.started, external=True))

    def _next_timeout(self, now: float) -> float | None:
        cands = [
            t.started + t.timeout - now
            for w in self._workers
            if (t := w.task) is not None and t.started is not None
        ]
        if self._external:
            cands.append(EXTERNAL_POLL_S)
        return max(0.0, min(cands)) + 0.01 if cands else None


# -- the process-wide pool (its scopes: quack/compile/scope.py) ---------------------------
_default: CompilePool | None = None
_default_lock = threading.Lock()


def default_pool() -> CompilePool:
    """The lazily created pool that compiles misses for this process (started on
    its first submit)."""
    global _default
    with _default_lock:
        if _default is None or _default._closed:
            _default = CompilePool()
            import atexit

            atexit.register(_default.shutdown)
        return _default


def configure_default(jobs: int | None = None) -> CompilePool:
    """Set the default pool's size (the pytest plugin's --async-compile=N). Replaces
    an idle default pool; a started one keeps running with its size."""
    global _default
    with _default_lock:
        if _default is None or _default._closed or (not _default.started and jobs):
            _default = CompilePool(jobs)
            import atexit

            atexit.register(_default.shutdown)
        return _default
