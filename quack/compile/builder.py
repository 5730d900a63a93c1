"""Compile one kernel configuration and publish it to the store.

Runs in a compile worker (or, for unshippable compile functions, in the
caller). The published .o is the only result that matters; the returned
metadata is a convenience."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
import traceback
from typing import TYPE_CHECKING

from quack.cache.entry import Entry, EntryRef
from quack.cache.problems import write_error
from quack.errors import CacheError, CacheWriteError, CompileError, SourceChanged
from quack.registry import KernelSpec
from quack.runtime import loader

if TYPE_CHECKING:  # the contract's Protocols only annotate here; jit's hit path imports us
    from quack.cache.contract import Store


def entry_ref(spec: KernelSpec, params: dict, arch: str) -> EntryRef:
    return EntryRef(spec.name, spec.key(params, arch), arch, spec.source_fingerprint())


def pin_arch(arch: str) -> None:
    """Point CuTe DSL at ``arch`` for the next compile. Before cutlass is imported
    the environment does it; after, the DSL reads its envar object, so set that
    (the env var alone is read once, at import)."""
    os.environ["CUTE_DSL_ARCH"] = arch
    os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")  # no second, hidden cache
    if "cutlass.cutlass_dsl" in sys.modules:
        from cutlass.cutlass_dsl import CuTeDSL

        CuTeDSL._get_dsl().envar.arch = arch


@contextlib.contextmanager
def no_jit_engine():
    """``cute.compile`` builds no JIT execution engine while open: an export needs only
    the compiled module, and the engine (the host code's LLVM JIT, its entry lookup and
    the tvm-ffi function over it) cost 0.1-0.3 CPU-s of every compile, up to half of a
    small one (RMSNorm fwd: 0.64 against 0.32 CPU-s on this machine), and the objects come
    out byte-identical without it (tests/test_compile_export.py). The DSL builds one
    when it holds that this machine can run the compiled arch (``_runtime_can_run_compiled``,
    which a cross-compile fails); its singleton is told "no" for the duration. Only where
    cutlass is imported already (the compile pool and Ray workers import it first): a
    compile function that imports it itself gets the engine, which costs time, not bytes.
    Not for an in-process compile whose result is called (``miss.compile_in_process``);
    compiles in one process do not run concurrently (the DSL's state is global)."""
    if "cutlass.cutlass_dsl" not in sys.modules:
        yield
        return
    from cutlass.cutlass_dsl import CuTeDSL

    dsl = CuTeDSL._get_dsl()
    if not callable(getattr(dsl, "_runtime_can_run_compiled", None)):  # another DSL version
        yield
        return
    dsl._runtime_can_run_compiled = lambda runtime_arch, compiled_arch: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        del dsl._runtime_can_run_compiled  # the class's method again


def call_compile(spec: KernelSpec, params: dict, arch: str):
    """Run the compile function: with ``arch=`` when it declares an ``arch`` parameter
    (not one of its params: the arch is in the key already), so a kernel need not read
    CUTE_DSL_ARCH from the environment."""
    return spec.fn(**params, arch=arch) if spec.takes_arch else spec.fn(**params)


def compile_to(spec: KernelSpec, params: dict, arch: str, out_path) -> float:
    """Compile and export to ``out_path``; returns compile seconds. Raises CompileError
    for the compile, and the OSError itself when writing the export fails (disk full,
    read-only): that is the cache's problem, not the kernel's."""
    pin_arch(arch)
    t0 = time.perf_counter()
    try:
        with no_jit_engine():
            compiled = call_compile(spec, params, arch)
        if not hasattr(compiled, "export_to_c"):
            raise TypeError(
                f"compile function {spec.module}.{spec.qualname} returned "
                f"{type(compiled).__name__}, not a cute.compile(...) result"
            )
    except Exception as e:  # noqa: BLE001 - any error of the kernel's code is its CompileError
        detail = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        raise CompileError(spec.name, spec.plain(params), arch, detail) from None
    try:
        compiled.export_to_c(object_file_path=str(out_path), function_name=loader.FUNCTION_NAME)
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - the exporter's own errors: the kernel's CompileError
        detail = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        if isinstance(e, TypeError) and "object_file_path" in str(e):
            # CuTe's export without tvm-ffi has another signature: say what is missing
            # (an "error:" line, so it is the one line a build shows).
            detail = (
                f"error: {spec.module}.{spec.qualname} compiled without tvm-ffi: pass "
                f'options="--enable-tvm-ffi" to cute.compile (quack exports and loads '
                f"kernels through tvm-ffi; docs/writing-kernels.md)\n\n{detail}"
            )
        raise CompileError(spec.name, spec.plain(params), arch, detail) from None
    return time.perf_counter() - t0


def unstored_tmp_prefix(pid: int) -> str:
    """The name prefix of the private temp directories (in the system's temp directory)
    process ``pid`` compiles unstored objects in (quack.compile.builder.compile_unstored)."""
    return f"quack-unstored-{pid}-"


def sweep_unstored_tmp(pid: int | None) -> None:
    """Remove what a worker that was killed mid-compile (a time-out, a death) left of its
    unstored compile's private temp directory; it removes its own when it returns."""
    import glob
    import shutil
    import tempfile

    if not pid:
        return
    for d in glob.glob(os.path.join(glob.escape(tempfile.gettempdir()), unstored_tmp_prefix(pid) + "*")):
        shutil.rmtree(d, ignore_errors=True)


def compile_unstored(spec: KernelSpec, params: dict, arch: str) -> tuple[bytes, float]:
    """Compile into a private temp directory of this process (the system's temp
    directory, TMPDIR: never the cache, which may be read-only or full) and return (the
    object's bytes, compile seconds), publishing nothing and taking no lock: the cache
    can't take the object (read-only, full, its entry gone) or another process holds the
    key's lock past lock_timeout (quack.compile.dispatch), and publishes the key itself if
    it ever finishes. Runs in a compile worker, so compile_timeout bounds it; the caller
    loads a private copy of the bytes. The directory is removed on return (the pool
    sweeps that of a worker it killed mid-compile). Raises CompileError (SourceChanged:
    the kernel's source was edited after this worker imported it), CacheWriteError (the
    temp directory can't take the object: full, read-only; the message names it)."""
    import shutil
    import tempfile

    changed = spec.changed_since_load()
    if changed:
        raise SourceChanged(spec.name, spec.plain(params), arch, changed, in_worker=True)
    key = spec.key(params, arch)
    what = f"compiling {spec.name} key {key[:16]} unstored"
    try:
        tmpdir = tempfile.mkdtemp(prefix=unstored_tmp_prefix(os.getpid()))
    except OSError as e:
        raise _tmp_write_error(e, tempfile.gettempdir(), what) from None
    try:
        try:
            seconds = compile_to(spec, params, arch, os.path.join(tmpdir, "obj.o"))
            with open(os.path.join(tmpdir, "obj.o"), "rb") as f:
                data = f.read()
        except OSError as e:
            raise _tmp_write_error(e, tmpdir, what) from None
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return data, seconds


def _tmp_write_error(e: OSError, where: str, what: str) -> CacheWriteError:
    """A failed write of the private temp directory of an unstored compile: not the
    cache's (it is never written), so the message names the temp directory and TMPDIR."""
    from quack.cache.problems import write_reason

    code = getattr(e, "errno", None) or 0
    reason = write_reason(code) or e.strerror or str(e)
    return CacheWriteError(
        f"cannot write the compile worker's temp directory {where}: {reason} while {what} "
        f"({getattr(e, 'filename', None) or where}); nothing was stored; free some space "
        f"there or point TMPDIR at a writable directory with room",
        path=str(where),
        reason=reason,
        code=code,
    )


def build(
    spec: KernelSpec,
    params: dict,
    arch: str,
    store: Store,
    *,
    force: bool = False,
    lock_timeout: float | None = None,
    lock_held: bool = False,
    in_worker: bool = False,
) -> tuple[Entry, bool]:
    """Make sure the entry exists; returns (entry, compiled_here). Check, lock, check again:
    a key another process is compiling is awaited on its lock, not compiled twice.

    Raises CompileError (the kernel; SourceChanged: its source was edited after this
    process imported it, ``in_worker``: a compile worker's process), LockTimeout (another
    holder past the time-out; the holder publishes: a runtime miss's pool compiles the key
    unstored in a worker instead, ``compile_unstored``),
    CacheWriteError (disk full / read-only: names the cache; nothing partial left)."""
    ref = entry_ref(spec, params, arch)
    if not force:
        e = store.lookup(ref, locked=lock_held)
        if e is not None:
            return e, False
    # lock_held: the caller holds the key's lock already (a pool worker given the pool's
    # claim, quack.compile.claims); taking it again from here would wait on ourselves
    with contextlib.nullcontext() if lock_held else store.lock(ref, timeout=lock_timeout):
        if not force:
            e = store.lookup(ref, locked=True)
            if e is not None:
                return e, False
        # ref's fingerprint was read from the files; the code compiled is what this process
        # imported. An edit in between (a long-lived process, a worker of an older
        # forkserver) would file the old code under the new fingerprint: refused.
        changed = spec.changed_since_load()
        if changed:
            raise SourceChanged(spec.name, spec.plain(params), arch, changed, in_worker=in_worker)
        tmp = store.tmp_obj(ref)
        try:
            try:
                seconds = compile_to(spec, params, arch, tmp)
            except OSError as e:
                if isinstance(e, CacheError):
                    raise
                raise write_error(e, store.root, f"writing {spec.name} key {ref.key[:16]}") from None
            meta = {
                "params": spec.plain(params),
                "compile_s": round(seconds, 4),
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "created": time.time(),
            }
            entry = store.publish(ref, tmp, meta)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        so = loader.link_entry(store, entry)
        entry.so_path = so
        return entry, True
