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
``quack build``) is not submitted: it is awaited ("external" pending) until its
.o appears, the lock is released without one (then it is new again), or the
time-out passes.

States are per (cache root, key): a pool used under several Settings (tests
that install their own cache directory) never confuses their entries."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
import types
from multiprocessing import connection as mpc
from pathlib import Path

from quack.compile import scope
from quack.errors import CacheError, CompileError, CompileTimeout, LockTimeout

NEW, PENDING, DONE, FAILED = "new", "pending", "done", "failed"
EXTERNAL_POLL_S = 0.1
log = logging.getLogger("quack.pool")


@dataclasses.dataclass(frozen=True)
class WorkerRequest:
    """One compile task as sent to a worker (pickled over its pipe): what to
    import, which configuration, and the cache to publish into."""

    module: str
    kernel: str
    params: dict
    arch: str
    root: str
    fsync: bool
    lock_timeout: float
    force: bool = False


@dataclasses.dataclass(frozen=True)
class TaskInfo:
    """The pool's public view of one key's task (``CompilePool.task_info``).

    ``started``: time.monotonic() when a worker took it (or, for a key another
    process is compiling, when the pool began awaiting it); None while queued.
    ``pid``: the worker's pid once started; None for queued or external keys."""

    kernel: str
    key: str
    arch: str
    submitted: float
    started: float | None
    pid: int | None
    external: bool


def _worker_died_error(task: "_Task", exitcode) -> CompileError:
    if exitcode is not None and exitcode < 0:
        try:
            how = f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"killed by signal {-exitcode}"
    else:
        how = f"exited with status {exitcode}"
    return CompileError(
        task.kernel,
        task.params,
        task.arch,
        f"compile worker pid {task.pid} {how} while compiling key {task.key[:16]} "
        f"(crash, out of memory, or killed); the pool replaced it",
        transient=True,
    )


# -- worker side ---------------------------------------------------------------------------
def _noop() -> int:
    return os.getpid()


def worker_build(req: WorkerRequest) -> dict:
    """Task run in a worker: import, compile, publish. Returns a small report."""
    from quack import registry
    from quack.cache.store import DiskStore
    from quack.compile import builder

    spec = registry.import_spec(req.module, req.kernel)
    bound = spec.bind((), req.params)
    store = DiskStore(Path(req.root), fsync=req.fsync, lock_timeout=req.lock_timeout)
    t0 = time.perf_counter()
    entry, compiled = builder.build(spec, bound, req.arch, store, force=req.force)
    return {
        "key": entry.ref.key,
        "compiled": compiled,
        "pid": os.getpid(),
        "compile_s": entry.meta.get("compile_s", 0.0) if compiled else 0.0,
        "wall_s": time.perf_counter() - t0,
        "obj": str(entry.obj_path),
    }


def _worker_main(conn) -> None:
    """A compile worker: GPU-blind, one task at a time from ``conn`` until EOF."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # The parent's SIGINT (Ctrl-C in the terminal) reaches the whole process group;
    # the parent decides what happens to compiles, not the keyboard.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        fn, req = msg
        try:
            result = ("ok", fn(req))
        except CompileError as e:
            result = ("err", e)
        except (CacheError, LockTimeout) as e:  # the cache's problem: the caller runs uncached
            result = ("err", e)
        except BaseException as e:  # noqa: BLE001 - everything goes back as text
            detail = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            result = (
                "err",
                CompileError(
                    getattr(req, "kernel", "?"), getattr(req, "params", {}), getattr(req, "arch", "?"), detail
                ),
            )
        try:
            conn.send(result)
        except Exception:  # noqa: BLE001 - unpicklable result: send text instead
            conn.send(("err", CompileError("?", {}, "?", repr(result[1])[:4000])))


# -- spawning without re-running the user's script ---------------------------------------
@contextlib.contextmanager
def masked_main():
    """Hide __main__ while workers start: a forkserver child would otherwise
    re-import the user's script (and run it, if it has no main guard).
    (The pool's own spawns use a thread-local filter instead; this is for
    callers that start processes themselves.)"""
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


_tls = threading.local()
_MAIN_KEYS = ("init_main_from_path", "init_main_from_name", "main_path")


def _install_prep_filter() -> None:
    """Drop __main__ from multiprocessing's preparation data for processes the
    pool starts (only on the pool's own thread: thread-safe, unlike swapping
    sys.modules['__main__'] under a running test)."""
    from multiprocessing import spawn

    orig = spawn.get_preparation_data
    if getattr(orig, "_quack_filter", False):
        return

    def get_preparation_data(name):
        d = orig(name)
        if getattr(_tls, "neutral", False):
            for k in _MAIN_KEYS:
                d.pop(k, None)
        return d

    get_preparation_data._quack_filter = True  # type: ignore[attr-defined]
    spawn.get_preparation_data = get_preparation_data


_forkserver_configured = False


def _context(start_method: str):
    global _forkserver_configured
    ctx = mp.get_context(start_method)
    if start_method == "forkserver" and not _forkserver_configured:
        ctx.set_forkserver_preload(["quack.compile._preload"])
        _forkserver_configured = True
    return ctx


def _block_sigint_for_children() -> None:
    """Block SIGINT in the dispatcher thread (never the main thread): processes it
    starts (the forkserver, workers) inherit the mask, so a terminal's Ctrl-C, sent to
    the whole process group, cannot interrupt them mid-start with a traceback; the
    main thread still receives it. multiprocessing's resource tracker unblocks SIGINT
    in the calling thread when it starts, so it is started first."""
    if threading.current_thread() is threading.main_thread():
        return
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


# -- the pool --------------------------------------------------------------------------------
class _Task:
    __slots__ = (
        "ident",
        "key",
        "root",
        "kernel",
        "params",
        "arch",
        "request",
        "timeout",
        "submitted",
        "started",
        "pid",
        "external_lock",
        "obj_meta",
    )

    def __init__(self, ident, key, root, kernel, params, arch, request: WorkerRequest, timeout):
        self.ident, self.key, self.root = ident, key, root
        self.kernel, self.params, self.arch, self.request, self.timeout = (
            kernel,
            params,
            arch,
            request,
            timeout,
        )
        self.submitted = time.monotonic()
        self.started: float | None = None
        self.pid: int | None = None
        self.external_lock: str | None = None  # lock path, for a key another process is compiling
        self.obj_meta: str | None = None  # its metadata path (written last by a publish)


class _Worker:
    __slots__ = ("proc", "conn", "task")

    def __init__(self, proc, conn):
        self.proc, self.conn = proc, conn
        self.task: _Task | None = None


def lock_held(path) -> bool:
    """Does some process hold this flock (filelock's Unix lock) right now?"""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


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
        self._state: dict[tuple, str] = {}
        self._errors: dict[tuple, BaseException] = {}
        self._tasks: dict[tuple, _Task] = {}
        self._reports: dict[tuple, dict] = {}
        self._queue: list[_Task] = []
        self._external: dict[tuple, _Task] = {}
        self._workers: list[_Worker] = []
        self._want_workers = 0
        self._thread: threading.Thread | None = None
        self._wake_r: int = -1
        self._wake_w: int | None = None
        self._closed = False
        self.generation = 0  # bumped on every state change (see wait_change)
        self.counts = {
            "submitted": 0,
            "done": 0,
            "failed": 0,
            "compiled": 0,
            "compile_s": 0.0,
            "awaited_external": 0,
            "timeouts": 0,
            "worker_deaths": 0,
            "workers_started": 0,
        }

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
                if self._state.get(t.ident) == PENDING:
                    self._state[t.ident] = FAILED
                    self._errors[t.ident] = CompileError(
                        t.kernel, t.params, t.arch, "compile cancelled (pool shut down)", transient=True
                    )
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
            st = self._state.get(ident, NEW)
            if st in (PENDING, DONE):
                return st
            plain = spec.plain(params)
            args = WorkerRequest(
                spec.module, spec.name, plain, arch, str(s.cache_dir), s.fsync, s.lock_timeout, force
            )
            task = _Task(
                ident,
                key,
                s.cache_dir,
                spec.name,
                plain,
                arch,
                args,
                timeout if timeout is not None else s.compile_timeout,
            )
            self._errors.pop(ident, None)
            self._reports.pop(ident, None)
            self._tasks[ident] = task
            self._state[ident] = PENDING
            if not force:
                ext = self._external_paths(spec, params, arch, s)
                if ext is not None and lock_held(ext[0]):
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

    @staticmethod
    def _external_paths(spec, params, arch, s):
        try:
            from quack.cache.store import local_store
            from quack.compile import builder

            p = local_store(s).paths(builder.entry_ref(spec, params, arch))
            return str(p["lock"]), str(p["meta"])
        except Exception:  # noqa: BLE001 - an unusable cache is the worker's to report
            return None

    def state(self, key: str, root=None) -> str:
        with self._lock:
            return self._state.get(self._ident(key, root), NEW)

    def poll(self, key: str, root=None) -> tuple[str, BaseException | None]:
        """(state, error) of a key."""
        ident = self._ident(key, root)
        with self._lock:
            return self._state.get(ident, NEW), self._errors.get(ident)

    def error(self, key: str, root=None) -> BaseException | None:
        with self._lock:
            return self._errors.get(self._ident(key, root))

    def report(self, key: str, root=None) -> dict | None:
        with self._lock:
            return self._reports.get(self._ident(key, root))

    def forget(self, key: str, root=None) -> None:
        """Drop a key's state (after a failure was reported, so it may be retried)."""
        ident = self._ident(key, root)
        with self._lock:
            if self._state.get(ident) == PENDING:
                return  # still running: forgetting would let a second compile start
            self._state.pop(ident, None)
            self._errors.pop(ident, None)
            self._tasks.pop(ident, None)
            self._reports.pop(ident, None)

    def task_info(self, key: str, root=None) -> TaskInfo | None:
        """The pool's record of a key's current task (None if it has none)."""
        with self._lock:
            t = self._tasks.get(self._ident(key, root))
            if t is None:
                return None
            return TaskInfo(
                t.kernel, t.key, t.arch, t.submitted, t.started, t.pid, t.external_lock is not None
            )

    def pending_for(self, key: str, root=None) -> float:
        with self._lock:
            t = self._tasks.get(self._ident(key, root))
            return 0.0 if t is None or t.started is None else time.monotonic() - t.started

    def wait(self, key: str, timeout: float | None = None, root=None) -> tuple[str, BaseException | None]:
        """Block until the key is no longer pending (or ``timeout``); returns (state, error).
        Compile time-outs are the pool's job (the key fails with CompileTimeout)."""
        ident = self._ident(key, root)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._state.get(ident) == PENDING:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
            return self._state.get(ident, NEW), self._errors.get(ident)

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
            d["pending"] = sum(1 for s in self._state.values() if s == PENDING)
            d["queued"] = len(self._queue)
            d["running"] = sum(1 for w in self._workers if w.task is not None)
            d["workers"] = len(self._workers)
            d["errors"] = {k[1]: str(e)[:2000] for k, e in self._errors.items()}
            return d

    # -- the dispatcher thread ---------------------------------------------------------------
    def _finish(self, task: _Task, ok: bool, payload) -> None:
        """Record a task's outcome; caller holds the lock."""
        ident = task.ident
        if self._tasks.get(ident) is not task:
            return
        if ok:
            self._state[ident] = DONE
            self._reports[ident] = payload
            self.counts["done"] += 1
            if payload.get("compiled"):
                self.counts["compiled"] += 1
                self.counts["compile_s"] += payload.get("compile_s", 0.0)
        else:
            self._state[ident] = FAILED
            self._errors[ident] = payload
            self.counts["failed"] += 1
            log.info(
                "pool: %s %s failed: %s",
                task.kernel,
                task.key[:16],
                str(payload).strip().splitlines()[-1][:200] if str(payload).strip() else "",
            )
        self._bump()

    def _spawn(self) -> _Worker:
        _block_sigint_for_children()
        ctx = _context(self.start_method)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker_main, args=(child,), daemon=True, name="quack-compile")
        _install_prep_filter()
        _tls.neutral = True
        try:
            proc.start()
        finally:
            _tls.neutral = False
            child.close()
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
                    self._finish(
                        t,
                        False,
                        CompileError(
                            t.kernel,
                            t.params,
                            t.arch,
                            f"cannot start a compile worker: {e!r}",
                            transient=True,
                        ),
                    )
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
            self._finish(t, False, _worker_died_error(t, w.proc.exitcode))

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
            # submit sets all three for every external task
            assert t.obj_meta is not None and t.external_lock is not None and t.started is not None
            if os.path.exists(t.obj_meta):
                del self._external[ident]
                self._finish(t, True, {"key": t.key, "compiled": False, "external": True})
            elif not lock_held(t.external_lock):
                # The other process let go. Published in the meantime? Else it failed:
                # new again, the next call compiles it here.
                del self._external[ident]
                if os.path.exists(t.obj_meta):
                    self._finish(t, True, {"key": t.key, "compiled": False, "external": True})
                else:
                    self._tasks.pop(ident, None)
                    self._state.pop(ident, None)
                    self._bump()
            elif now - t.started > t.timeout:
                del self._external[ident]
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


# -- the process-wide pool and the "pending raises" scope -----------------------------
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


# Per-attempt logs the pytest plugin sets: CompilePending raised (even if the test
# swallowed it with ``except BaseException``), and prebuilt-mode misses.


@contextlib.contextmanager
def recording_pending():
    """Collect, in the yielded list, every CompilePending raised in this block
    (even one a test swallowed). Enter it inside ``pool_scope``, which starts
    each scope with no recording."""
    with scope.PENDING_LOG.bound([]) as log:
        yield log


@contextlib.contextmanager
def recording_not_prebuilt():
    """Collect (KernelNotPrebuilt, settings) for every prebuilt-mode miss in this block."""
    with scope.MISS_LOG.bound([]) as log:
        yield log


def note_pending(exc) -> None:
    log = scope.PENDING_LOG.get()
    if log is not None:
        log.append(exc)


def note_not_prebuilt(exc, settings) -> None:
    log = scope.MISS_LOG.get()
    if log is not None:
        log.append((exc, settings))


def active_pool(root=None) -> CompilePool | None:
    """The pool of the enclosing pool_scope, or None. A scope limited to one cache
    root (the pytest plugin's: the session's default cache) is not active for a
    miss in another root (a test's private cache): that miss waits instead."""
    pool = scope.ACTIVE.get()
    if pool is not None and root is not None:
        only = scope.SCOPE_ROOT.get()
        if only is not None and only != str(root):
            return None
    return pool


@contextlib.contextmanager
def pool_scope(pool: CompilePool | None = None, *, root=None):
    """In this block a miss submits to ``pool`` and raises CompilePending at once
    (only for misses in cache ``root``, if given)."""
    with (
        scope.ACTIVE.bound(pool or default_pool()) as active,
        scope.SCOPE_ROOT.bound(None if root is None else str(root)),
        scope.PENDING_LOG.bound(None),  # a nested scope's pendings are its owner's business
    ):
        yield active


@contextlib.contextmanager
def suppress_pool():
    """In this block misses wait for their compile, even inside a pool_scope."""
    with scope.ACTIVE.bound(None):
        yield
