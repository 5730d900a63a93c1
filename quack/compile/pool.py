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
  failed with :class:`CompileTimeout` (``@jit_cache`` raises it: compiling it again
  in the caller would only move the hang there), and the slot is freed;
* ``submit`` never blocks: workers are started by the dispatcher thread, so the
  forkserver's preload (cutlass import + a warm-up compile, seconds) is never
  paid on the caller's thread;
* shutdown kills workers and returns at once: nothing waits for idle (or busy)
  workers at interpreter exit.

A key whose per-key lock another process holds (another xdist worker, a
``quack build``) is not submitted but awaited: ``quack/compile/external.py``. Past
compile_timeout the key fails with CompileTimeout naming that process (its compile ran
that long); past lock_timeout, where that is the smaller, it fails too, or, for a
runtime miss (``submit(unstored_fallback=True)``), a worker compiles it unstored,
bounded by compile_timeout like any compile: the caller never compiles it itself. So is a
runtime miss the cache can't take (read-only, full; ``submit(unstored=why)``), from the
start: into the worker's private temp directory, with no lock claimed. A key
this pool will compile is locked at ``submit`` (``Store.claim``) and the lock handed
to the worker with the task (``quack/compile/claims.py``): processes asking for one
cold key at once start one worker between them, not one each.

States are per (cache root, key): a pool used under several Settings (tests
that install their own cache directory) never confuses their entries; a key compiled
unstored from the start is filed under ``unstored_root(cache root)``.

Modules: the dispatcher thread and the worker processes it runs (start, hand out,
collect, reap, time-outs, keys awaited elsewhere) are ``quack/compile/dispatch.py``;
the worker process (its request, main loop and start) is
``quack/compile/worker.py``; the per-key states, outcomes and counters are
``quack/compile/tasks.py``; the scopes (``pool_scope``, ``suppress_pool``, the
per-attempt records) are ``quack/compile/scope.py``."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref

from quack.compile import claims, external, tasks, worker
from quack.compile.dispatch import Dispatcher
from quack.compile.tasks import DONE, FAILED, PENDING, Task, TaskInfo
from quack.compile.worker import WorkerRequest

__all__ = ["CompilePool", "configure_default", "default_pool", "unstored_root"]

log = logging.getLogger("quack.pool")


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
        self.generation = 0  # bumped on every state change (see wait_change)
        self.counts = self._book.counts  # the same dict: stats() reads it
        # The worker processes and the thread that runs them (quack/compile/dispatch.py).
        self._dispatcher = Dispatcher(
            self.jobs, self.start_method, lock=self._lock, book=self._book, changed=self._bump
        )
        _pools.add(self)

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._dispatcher.started

    @property
    def closed(self) -> bool:
        return self._dispatcher.closed

    def prewarm(self, workers: int | None = None) -> None:
        """Start the forkserver and every worker (``workers``: that many, within ``jobs``)
        now, in the background; returns at once."""
        with self._lock:
            self._dispatcher.prewarm(workers)

    def shutdown(self, wait: bool = False) -> None:
        """Kill the workers and stop. Never waits for a compile; ``wait=True`` only
        joins the (already killed) processes."""
        self._dispatcher.shutdown(wait)

    def worker_pids(self) -> list[int]:
        """The pids of every worker this pool started (those replaced or killed too)."""
        with self._lock:
            return list(self._dispatcher.pids)

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
        unstored_fallback: bool = False,
        unstored: str = "",
    ) -> str:
        """Queue a compile unless the key is pending or done. Returns its state.
        ``settings`` (default: this process's current settings) gives the cache
        the worker publishes into and the time-out. ``unstored_fallback`` (a caller that
        can load an object the cache does not hold: a runtime miss): a key whose lock
        another process holds past lock_timeout is compiled by a worker unstored, within
        compile_timeout, its object's bytes in the report (``data``), instead of failing
        (quack.compile.dispatch). ``unstored`` (why: the cache can't take the object, a
        read-only or full cache): a worker compiles the key into its private temp directory
        from the start, within compile_timeout, publishing nothing and taking no lock; its
        state is kept apart from a stored compile of the key, under
        ``unstored_root(cache_dir)`` (what poll, wait, report and forget are given)."""
        from quack import settings as _settings

        s = settings or _settings.get()
        ident = (unstored_root(s.cache_dir) if unstored else str(s.cache_dir), key)
        with self._lock:
            st = self._book.state(ident)
            if st in (PENDING, DONE):
                return st
            plain = spec.plain(params)
            limit = timeout if timeout is not None else s.compile_timeout
            args = WorkerRequest(
                spec.module,
                spec.name,
                plain,
                arch,
                str(s.cache_dir),
                s.fsync,
                s.lock_timeout,
                force,
                s.preload,
                s.sources.get("preload", ""),
                timeout=limit,
                sys_path=tuple(sys.path),  # a worker started before it grew imports through it
                unstored=bool(unstored),
            )
            task = Task(
                ident,
                key,
                s.cache_dir,
                spec.name,
                plain,
                arch,
                args,
                limit,
            )
            task.unstored_fallback = unstored_fallback
            task.unstored_why = unstored
            self._book.begin(task)
            if self.closed:
                # A shut-down pool runs nothing: the key fails now, cancelled as shutdown
                # fails the keys it finds, instead of pending for ever in a queue no thread
                # reads (wait() without a time-out never returned).
                self._book.cancel(task)
                return FAILED
            if unstored:
                # Nothing is published: no lock to claim (a read-only cache can't even
                # take the lock file), no other process to await.
                self.counts["unstored"] += 1
            elif not force:
                # Lock the key now (handed to the worker with the task): of processes
                # asking for one cold key at once, one compiles and the rest await it here,
                # instead of each starting a worker that then waits on the lock.
                got = external.claim(spec, params, arch, s, take=claims.held() < claims.MAX_HELD)
                if got is not None and got[0] is not None:
                    task.claim_fd = got[0]
                elif got is not None:
                    task.external_lock, task.obj_meta = got[1]
                    task.started = time.monotonic()
                    # Waiting on another process's lock is bounded by lock_timeout (what
                    # QUACK_LOCK_TIMEOUT sets and the docs promise), not by compile_timeout:
                    # with the latter a holder stopped mid-compile kept a runtime miss waiting
                    # 900 s whatever QUACK_LOCK_TIMEOUT said. A smaller compile_timeout still
                    # bounds it: then the holder's compile ran past it, and the key fails with
                    # a CompileTimeout that names it. The setting that applied is kept: what
                    # follows the wait's end depends on it (quack.compile.dispatch).
                    task.wait_setting = "lock_timeout" if s.lock_timeout < task.timeout else "compile_timeout"
                    task.timeout = min(task.timeout, s.lock_timeout)
                    self.counts["awaited_external"] += 1
                    log.info(
                        "pool: %s %s is being compiled by another process; awaiting it", spec.name, key[:16]
                    )
                    self._dispatcher.await_external(ident, task)
                    return PENDING
            self.counts["submitted"] += 1
            log.debug("pool: submitted %s %s", spec.name, key[:16])
            self._dispatcher.enqueue(task)
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
        Compile time-outs are the pool's job (the key fails with CompileTimeout): its
        dispatcher thread enforces them, so a wait also ends when that thread is gone
        (the key fails), never waiting for ever on a thread that cannot answer."""
        ident = self._ident(key, root)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._book.state(ident) == PENDING:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                if not self._dispatcher.alive():
                    self._dispatcher.fail_everything(
                        RuntimeError("the compile pool's dispatcher thread is gone")
                    )
                    break
                self._cond.wait(WAIT_SLICE_S if left is None else min(left, WAIT_SLICE_S))
            return self._book.poll(ident)

    def _orphan_in_child(self) -> None:
        """After ``os.fork()``, in the child (only the forking thread runs): fail what the
        parent's dispatcher held and close; nothing of it runs here."""
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._dispatcher.orphan(
            self._lock,
            f"this process (pid {os.getpid()}) was forked from the one that started the "
            f"compile pool; call again: the next miss starts a pool of this process's own",
        )

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
            d["queued"] = self._dispatcher.queued()
            d["running"] = self._dispatcher.running()
            d["workers"] = self._dispatcher.worker_count()
            d["errors"] = self._book.error_texts()
            return d


def unstored_root(root) -> str:
    """The pool's name for cache ``root`` of the keys compiled unstored from the start
    (``submit(unstored=...)``): their states never mix with those of a stored compile of
    the same key. Not a path (a NUL can't be in one)."""
    return f"{root}\0unstored"


# How often a waiter checks that the dispatcher thread still exists (its results wake it
# at once; this only bounds a wait on a thread that is gone).
WAIT_SLICE_S = 1.0

# -- the process-wide pool (its scopes: quack/compile/scope.py) ---------------------------
_default: CompilePool | None = None
_default_lock = threading.Lock()
_pools: weakref.WeakSet[CompilePool] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child (a torch DataLoader worker, a fork-based multiprocessing pool)
    inherits the parent's default pool marked started, but not its dispatcher thread nor
    its workers: a cold call queued the key for a thread that did not exist and waited for
    ever. Here every inherited pool closes (its keys fail), the default pool is forgotten
    (the child's next miss starts its own) and so is the parent's forkserver."""
    global _default, _default_lock
    _default_lock = threading.Lock()  # may have been copied held by another thread
    _default = None
    for p in list(_pools):
        p._orphan_in_child()
    worker.forget_forkserver_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


_exiting = False


def exiting() -> bool:
    """True once the default pool was shut down by the interpreter's exit (atexit)."""
    return _exiting


def _shutdown_at_exit(pool: CompilePool) -> None:
    global _exiting
    _exiting = True
    pool.shutdown()


def _check_not_exiting() -> None:
    # A kernel called from an atexit hook that runs after this pool's own one: a new pool
    # started then failed with "cannot start a compile worker: FileNotFoundError(2, ...)"
    # (multiprocessing's own exit hooks had run), which said nothing of the cause.
    if _exiting:
        raise RuntimeError(
            "quack: the interpreter is shutting down and the compile pool has shut down "
            "(its atexit hook ran): no compile can start now. Call the kernel before exit "
            "(or from an atexit hook registered after its first call, which runs earlier), "
            "or build it beforehand (`quack build`)"
        )


def default_pool() -> CompilePool:
    """The lazily created pool that compiles misses for this process (started on
    its first submit). Raises RuntimeError once the interpreter's exit shut it down."""
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _check_not_exiting()
            _default = CompilePool()
            import atexit

            atexit.register(_shutdown_at_exit, _default)
        return _default


def configure_default(jobs: int | None = None) -> CompilePool:
    """Set the default pool's size (the pytest plugin's --async-compile=N). Replaces
    an idle default pool; a started one keeps running with its size."""
    global _default
    with _default_lock:
        if _default is None or _default.closed or (not _default.started and jobs):
            _check_not_exiting()
            _default = CompilePool(jobs)
            import atexit

            atexit.register(_shutdown_at_exit, _default)
        return _default
