"""The compile worker process: the request it gets, its main loop, and how the
pool starts one (GPU-blind, SIGINT, SIGTERM and SIGHUP ignored, without re-running the
user's script).

A worker reads ``(fn, WorkerRequest)`` from its pipe, one task at a time, and answers
``("ok", report)`` or ``("err", exception)``; ``None`` or EOF ends it. The functions
sent and run here are pickled by reference (module and name), so they live at the top
level of this module: the forkserver child imports it to unpickle them."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
import types
from multiprocessing import reduction
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from quack.compile import lifeline
from quack.errors import CacheError, CompileError, LockTimeout, SourceChanged


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
    preload: tuple = ()  # [build] preload: imported before the first task (quack.compile.preload)
    preload_source: str = ""  # where it was set (a quack.toml, QUACK_PRELOAD), for the error
    # the pool took the key's lock and sends it right after this request (a descriptor over
    # the pipe): the worker builds under it instead of taking the lock itself
    claimed: bool = False
    # the task's compile time-out: how long it may still run if this worker's parent dies
    # mid-compile (quack.compile.lifeline)
    timeout: float | None = None
    # the caller's sys.path when it asked: a worker started earlier (pytest --quack-prewarm
    # forks them at configure time, before collection puts tests/ on sys.path) could not
    # import a kernel module found through a later entry (ModuleNotFoundError)
    sys_path: tuple = ()
    # compile into a private temp directory (never the cache) and send the object's bytes
    # back, publishing nothing: the cache can't take it (read-only, full: quack.runtime.miss)
    # or the key's lock is another process's, held past lock_timeout (quack.compile.dispatch)
    unstored: bool = False


# -- worker side ---------------------------------------------------------------------------
def worker_build(req: WorkerRequest, lock_fd: int | None = None) -> dict:
    """Task run in a worker: import, compile, publish. Returns a small report. ``lock_fd``:
    the key's lock, taken by the pool (``req.claimed``); held until this returns.
    ``req.unstored``: compile without the lock and publish nothing; the report carries
    the object's bytes."""
    from quack import registry
    from quack.cache.store import DiskStore
    from quack.compile import builder, preload
    from quack.errors import PreloadError

    try:  # before the kernel's module: it may import them at its top
        preload_s = preload.ensure(req.preload, req.preload_source)
    except PreloadError as e:
        e.kernel, e.arch = req.kernel, req.arch
        raise
    extend_sys_path(req.sys_path)
    try:
        spec = registry.import_spec(req.module, req.kernel)
    except Exception as e:  # noqa: BLE001 - whatever the module's import raised
        raise module_import_error(req, e) from None
    bound = spec.bind((), req.params)
    t0 = time.perf_counter()
    if req.unstored:  # the cache is never touched: it may be read-only or full
        data, seconds = builder.compile_unstored(spec, bound, req.arch)
        return {
            "key": spec.key(bound, req.arch),
            "compiled": True,
            "unstored": True,
            "data": data,  # the object: the caller loads a private copy of it
            "pid": os.getpid(),
            "compile_s": seconds,
            "wall_s": time.perf_counter() - t0,
            "preload_s": round(preload_s, 3),
            "claimed": False,
        }
    store = DiskStore(Path(req.root), fsync=req.fsync, lock_timeout=req.lock_timeout)
    entry, compiled = builder.build(
        spec, bound, req.arch, store, force=req.force, lock_held=lock_fd is not None, in_worker=True
    )
    return {
        "key": entry.ref.key,
        "compiled": compiled,
        "pid": os.getpid(),
        "compile_s": entry.meta.get("compile_s", 0.0) if compiled else 0.0,
        "wall_s": time.perf_counter() - t0,
        "obj": str(entry.obj_path),
        "preload_s": round(preload_s, 3),
        "claimed": lock_fd is not None,  # built under the lock the pool took at submit
    }


def extend_sys_path(entries) -> None:
    """Append the caller's sys.path entries this worker lacks (after its own, so what it
    imported already keeps its precedence)."""
    missing = [p for p in entries if isinstance(p, str) and p not in sys.path]
    if missing:
        sys.path.extend(missing)
        import importlib

        importlib.invalidate_caches()  # finders cached before the entries existed


def module_import_error(req: WorkerRequest, exc: BaseException) -> CompileError:
    """The kernel's own module failed to import here although the caller has it imported:
    a difference between the two processes (sys.path, the working directory, a file
    edited since), not a property of the key. Transient, so the caller does not remember
    it as the key's compile failure ("will not be compiled again in this process")."""
    detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return CompileError(
        req.kernel,
        req.params,
        req.arch,
        f"the compile worker could not import the kernel's module {req.module!r} "
        f"(the calling process has it; the worker's sys.path is {sys.path!r}); "
        f"not remembered as a failure of this key, the next call tries again:\n{detail}",
        transient=True,
    )


def _worker_main(conn, parent_pid: int | None = None) -> None:
    """A compile worker: GPU-blind, one task at a time from ``conn`` until EOF.
    ``parent_pid``: the process that forks it (the forkserver, or the pool's process)."""
    # Killed with its parent: a busy worker of a killed process compiled on, re-parented
    # to init, for as long as its compile took (quack.compile.lifeline). Its SIGTERM
    # handler ignores a SIGTERM while the parent lives; where it installs none, ignore it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    lifeline.die_with_parent(parent_pid)
    forget_forkserver_in_child()  # a worker starts no process: it is no forkserver client
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # The parent's SIGINT (Ctrl-C in the terminal), SIGTERM (systemd's stop, `timeout`, a
    # CI job's kill) and SIGHUP (a closed terminal) reach the whole process group; the
    # pool's process decides what happens to compiles: it kills its workers itself, waits
    # until they are gone and sweeps their temp files. A worker that died on the signal
    # on its own raced that sweep and left its temp object. (SIGTERM, ignored here as a
    # default, is lifeline's parent-death signal: die_with_parent handles it, above.)
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        fn, req = msg
        lock_fd = None
        if getattr(req, "claimed", False):
            try:
                lock_fd = reduction.recv_handle(conn)
            except Exception:  # noqa: BLE001 - EOF, or no descriptor: the pool gave up on us
                return  # the pool went away (or replaced us) mid-hand-over: nothing to build
        lifeline.compiling(getattr(req, "timeout", None))
        try:
            result = ("ok", fn(req) if lock_fd is None else fn(req, lock_fd))
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
        finally:
            lifeline.compiling(None)
            if lock_fd is not None:
                os.close(lock_fd)  # the key's lock, released after the publish (or the failure)
        if not _answer(conn, result):
            return
        if isinstance(result[1], SourceChanged):
            return  # this process runs stale code of that kernel: the pool starts fresh ones


def _answer(conn, result) -> bool:
    """Send a task's result to the pool; False when the pool is gone (its process died:
    the pipe is broken). Then the worker just ends: what it built is published already
    (under the key's lock, which it held to the end), a failure left nothing partial, and
    nobody is left to tell. Before, the send raised BrokenPipeError, the fall-back send
    for an unpicklable result raised it again, and every worker of a killed build printed
    two chained tracebacks into the build's output."""
    try:
        conn.send(result)
        return True
    except OSError:  # BrokenPipeError, ConnectionResetError: the other end is gone
        return False
    except Exception:  # noqa: BLE001 - an unpicklable result: send it as text instead
        pass
    try:
        conn.send(("err", CompileError("?", {}, "?", repr(result[1])[:4000])))
        return True
    except OSError:
        return False


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


def ensure_forkserver(start_method: str) -> None:
    """Spawn the forkserver now if it is not running (quick: its preload then runs in
    the child). The dispatcher calls this under the pool's lock, so a shutdown either
    sees the forkserver's pid (and :func:`stop_forkserver` can kill it) or comes first
    and no forkserver starts: one spawned after an interrupt's shutdown outlived the
    build for as long as its preload took (its stdout still open: a caller reading the
    build's output to EOF waited for it)."""
    if start_method != "forkserver":
        return
    _block_sigint_for_children()
    _context(start_method)
    from multiprocessing import forkserver

    forkserver.ensure_running()


def stop_forkserver() -> None:
    """SIGKILL this process's forkserver, if one runs. For a process that is being
    interrupted: a forkserver still importing cutlass or compiling its warm-up (seconds,
    minutes on a loaded machine) only notices its parent's exit when that is done, and
    meanwhile holds the parent's stdout open. Not reaped here: multiprocessing's next
    ``ensure_running`` reaps it (WNOHANG) and starts a new one."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def restart_forkserver() -> None:
    """End this process's forkserver now and forget it, so that the next worker start runs
    a new one, whose preload imports the kernel packages afresh (a kernel's source edited
    since the old one imported it: quack.errors.SourceChanged). SIGKILL, then reaped
    (within 5 s):
    ``stop_forkserver`` alone left multiprocessing's record of it, and a worker start
    right after connected to the dying server ("unexpected EOF"). Its workers end with it
    (quack.compile.lifeline). Caller holds the pool's lock."""
    from multiprocessing import forkserver

    fs: Any = forkserver._forkserver  # multiprocessing's private singleton (as below)
    pid = getattr(fs, "_forkserver_pid", None)
    if not pid:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
    # Reaped within a bound (multiprocessing's own stop waits without one, under the pool's
    # lock): a server that won't go in 5 s is left to be reaped at exit, and forgotten.
    deadline = time.monotonic() + 5.0
    while True:
        try:
            done, _status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            break
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    fd, address = fs._forkserver_alive_fd, fs._forkserver_address
    fs._forkserver_address = fs._forkserver_alive_fd = fs._forkserver_pid = None
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
    if isinstance(address, str) and not address.startswith("\0"):  # a socket file, not abstract
        try:
            os.unlink(address)
        except OSError:
            pass


def forget_forkserver_in_child() -> None:
    """After ``os.fork()``, in the child (and in a compile worker): multiprocessing's
    record of the parent's forkserver names a process that is not the child's child (its
    ``ensure_running`` then raised ChildProcessError from ``waitpid``) and whose lock
    another thread of the parent may have held at the fork. Forget it, closing this
    process's copy of the forkserver's "alive" pipe: the forkserver ends (and its workers
    with it, quack.compile.lifeline) once the processes that use it are gone; a copy held
    here kept it, and a worker holding one kept it, and so itself, alive for ever after
    its parent was killed. The child's pool starts a forkserver of its own."""
    fs_mod = sys.modules.get("multiprocessing.forkserver")
    fs = getattr(fs_mod, "_forkserver", None)
    if fs is None:
        return
    fd = getattr(fs, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
    fs._lock = threading.Lock()
    fs._forkserver_address = fs._forkserver_alive_fd = fs._forkserver_pid = None


def start_worker(start_method: str) -> tuple[BaseProcess, Connection]:
    """Start one compile worker; returns (process, the parent's end of its pipe). Called
    on the pool's dispatcher thread (the first forkserver start waits for its preload)."""
    _block_sigint_for_children()
    ctx = _context(start_method)
    parent, child = ctx.Pipe()
    if start_method == "forkserver":
        from multiprocessing import forkserver

        forker = getattr(forkserver._forkserver, "_forkserver_pid", None)
    else:
        forker = os.getpid()
    proc = ctx.Process(target=_worker_main, args=(child, forker), daemon=True, name="quack-compile")
    _install_prep_filter()
    _tls.neutral = True
    try:
        proc.start()
    finally:
        _tls.neutral = False
        child.close()
    return proc, parent
