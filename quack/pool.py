"""The compile pool: misses compile in GPU-blind worker processes forked from a
warm forkserver; the published .o is the only result channel.

Per-key state: new -> pending -> done | failed. ``pool_scope()`` makes
``@jit_cache`` raise CompilePending on a miss instead of waiting (the pytest
plugin and autotuning use it); ``suppress_pool()`` turns that off in a block."""
from __future__ import annotations

import contextlib
import contextvars
import multiprocessing as mp
import os
import sys
import threading
import time
import types
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from quack.errors import CompileError

NEW, PENDING, DONE, FAILED = "new", "pending", "done", "failed"


def _worker_init() -> None:
    # Workers never touch a GPU: compiles are cross-compiles for a pinned arch.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def _noop() -> int:
    return os.getpid()


def worker_build(module: str, kernel: str, params: dict, arch: str, root: str, fsync: bool,
                 lock_timeout: float, force: bool) -> dict:
    """Task run in a worker: import, compile, publish. Returns a small report."""
    from quack import builder, registry
    from quack.store import DiskStore

    spec = registry.import_spec(module, kernel)
    bound = spec.bind((), params)
    store = DiskStore(Path(root), fsync=fsync, lock_timeout=lock_timeout)
    t0 = time.perf_counter()
    entry, compiled = builder.build(spec, bound, arch, store, force=force)
    return {"key": entry.ref.key, "compiled": compiled, "pid": os.getpid(),
            "compile_s": entry.meta.get("compile_s", 0.0) if compiled else 0.0,
            "wall_s": time.perf_counter() - t0, "obj": str(entry.obj_path)}


@contextlib.contextmanager
def masked_main():
    """Hide __main__ while workers start: a forkserver child would otherwise
    re-import the user's script (and run it, if it has no main guard)."""
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


_forkserver_configured = False


def _context(start_method: str):
    global _forkserver_configured
    ctx = mp.get_context(start_method)
    if start_method == "forkserver" and not _forkserver_configured:
        ctx.set_forkserver_preload(["quack._preload"])
        _forkserver_configured = True
    return ctx


class CompilePool:
    """A pool of compile workers with per-key state. Thread-safe."""

    def __init__(self, jobs: int | None = None, *, settings=None, start_method: str = "forkserver"):
        from quack import settings as _settings

        self.settings = settings or _settings.get()
        self.jobs = jobs or self.settings.compile_jobs or min(os.cpu_count() or 1, 16)
        self.start_method = start_method
        self._lock = threading.RLock()
        self._ex: ProcessPoolExecutor | None = None
        self._futures: dict[str, Future] = {}
        self._state: dict[str, str] = {}
        self._errors: dict[str, BaseException] = {}
        self._submitted_at: dict[str, float] = {}
        self.counts = {"submitted": 0, "done": 0, "failed": 0, "compiled": 0, "compile_s": 0.0}

    # -- lifecycle ---------------------------------------------------------------
    def _executor(self) -> ProcessPoolExecutor:
        if self._ex is None:
            self._ex = ProcessPoolExecutor(self.jobs, mp_context=_context(self.start_method),
                                           initializer=_worker_init)
        return self._ex

    def prewarm(self) -> None:
        """Start every worker now (imports paid in the forkserver), return at once."""
        with self._lock, masked_main():
            ex = self._executor()
            for _ in range(self.jobs):
                ex.submit(_noop)

    def shutdown(self, wait: bool = False) -> None:
        with self._lock:
            ex, self._ex = self._ex, None
        if ex is not None:
            ex.shutdown(wait=wait, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown(wait=False)

    # -- work ------------------------------------------------------------------
    def submit(self, spec, params: dict, arch: str, key: str, *, force: bool = False) -> str:
        """Queue a compile unless the key is already pending or done. Returns its state."""
        with self._lock:
            st = self._state.get(key, NEW)
            if st in (PENDING, DONE):
                return st
            # Current settings, not the pool's creation-time ones: a test or the CLI
            # may point the cache elsewhere after the pool started.
            from quack import settings as _settings

            s = _settings.get()
            args = (spec.module, spec.name, spec.plain(params), arch, str(s.cache_dir), s.fsync,
                    s.lock_timeout, force)
            with masked_main():
                try:
                    fut = self._executor().submit(worker_build, *args)
                except (BrokenProcessPool, RuntimeError):
                    self._ex = None  # a dead worker broke the pool: start a fresh one
                    fut = self._executor().submit(worker_build, *args)
            self._futures[key] = fut
            self._state[key] = PENDING
            self._errors.pop(key, None)
            self._submitted_at[key] = time.monotonic()
            self.counts["submitted"] += 1
            fut.add_done_callback(lambda f, k=key: self._finish(k, f))
            return PENDING

    def _finish(self, key: str, fut: Future) -> None:
        with self._lock:
            if self._futures.get(key) is not fut:
                return
            if fut.cancelled():
                self._state[key] = FAILED
                self._errors[key] = RuntimeError("compile cancelled (pool shut down)")
            elif fut.exception() is not None:
                exc = fut.exception()
                if isinstance(exc, BrokenProcessPool):
                    exc = RuntimeError(f"compile worker died (killed or crashed) while compiling "
                                       f"key {key[:16]}: {exc}")
                self._state[key] = FAILED
                self._errors[key] = exc
                self.counts["failed"] += 1
            else:
                r = fut.result()
                self._state[key] = DONE
                self.counts["done"] += 1
                if r.get("compiled"):
                    self.counts["compiled"] += 1
                    self.counts["compile_s"] += r.get("compile_s", 0.0)

    def state(self, key: str) -> str:
        with self._lock:
            return self._state.get(key, NEW)

    def error(self, key: str) -> BaseException | None:
        with self._lock:
            return self._errors.get(key)

    def forget(self, key: str) -> None:
        """Drop a key's state (after a failure was reported, so it may be retried)."""
        with self._lock:
            self._state.pop(key, None)
            self._errors.pop(key, None)
            self._futures.pop(key, None)

    def pending_for(self, key: str) -> float:
        with self._lock:
            t = self._submitted_at.get(key)
            return 0.0 if t is None else time.monotonic() - t

    def wait(self, key: str, timeout: float | None = None) -> dict:
        """Block until the key is done; returns the worker's report. Raises the
        worker's CompileError, RuntimeError for a dead worker, TimeoutError."""
        with self._lock:
            fut = self._futures.get(key)
        if fut is None:
            raise KeyError(key)
        try:
            return fut.result(timeout=timeout)
        except BrokenProcessPool as e:
            raise RuntimeError(f"compile worker died (killed or crashed) while compiling key "
                               f"{key[:16]}: {e}") from None
        except TimeoutError:
            raise
        except CompileError:
            raise

    def stats(self) -> dict:
        with self._lock:
            d = dict(self.counts)
            d["pending"] = sum(1 for s in self._state.values() if s == PENDING)
            d["errors"] = {k: str(e)[:500] for k, e in self._errors.items()}
            return d


# -- the process-wide pool and the "pending raises" scope -----------------------------
_default: CompilePool | None = None
_default_lock = threading.Lock()
_active: contextvars.ContextVar[CompilePool | None] = contextvars.ContextVar("quack_pool", default=None)


def default_pool() -> CompilePool:
    """The lazily started pool that compiles jit-mode misses for this process."""
    global _default
    with _default_lock:
        if _default is None:
            _default = CompilePool()
            import atexit

            atexit.register(_default.shutdown)
        return _default


def active_pool() -> CompilePool | None:
    return _active.get()


@contextlib.contextmanager
def pool_scope(pool: CompilePool | None = None):
    """In this block a miss submits to ``pool`` and raises CompilePending at once."""
    token = _active.set(pool or default_pool())
    try:
        yield _active.get()
    finally:
        _active.reset(token)


@contextlib.contextmanager
def suppress_pool():
    """In this block misses wait for their compile, even inside a pool_scope."""
    token = _active.set(None)
    try:
        yield
    finally:
        _active.reset(token)
