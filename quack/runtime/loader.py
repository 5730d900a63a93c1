"""Load a cached kernel into this process without the CuTe DSL compiler.

The .o is linked once into a shared object (gcc, ~20 ms; normally done by
the builder) against cutlass-dsl's runtime, and loaded with
``tvm_ffi.load_module``: ~0.1 ms, and cutlass's compiler is never imported.
The .so has no rpath (the cache stays relocatable): the runtime libraries are
preloaded RTLD_GLOBAL and resolve its DT_NEEDED entries by soname; tvm_ffi is
imported lean (quack.runtime.ffi). Without a C compiler,
``cute.runtime.load_module`` on the .o is the fallback."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, cast

from quack.cache import fsutil, problems
from quack.errors import CacheError, CacheWriteError, EntryVanished, LinkError

if TYPE_CHECKING:
    from quack.cache.contract import Store
    from quack.cache.entry import Entry

FUNCTION_NAME = "func"


@functools.lru_cache(maxsize=None)
def runtime_libdirs() -> tuple[str, str] | None:
    """(cutlass runtime lib dir, tvm_ffi lib dir), found without importing either."""
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    tspec = importlib.util.find_spec("tvm_ffi")
    if spec is None or tspec is None or not spec.submodule_search_locations:
        return None
    from quack.cache.keys import toolchain

    flavour = toolchain()["libs"]
    cdir = None
    # The installed flavour's directory first; the glob (a regex compile, ~4 ms on
    # the first-call path) only when it isn't there.
    for base in spec.submodule_search_locations:
        if (Path(base) / flavour / "lib" / "libcute_dsl_runtime.so").is_file():
            cdir = Path(base) / flavour / "lib"
            break
    for base in spec.submodule_search_locations if cdir is None else ():
        for cand in sorted(Path(base).glob("cu*/lib")):
            if (cand / "libcute_dsl_runtime.so").is_file():
                cdir = cand
                break
        if cdir:
            break
    if tspec.origin is None:
        return None
    tdir = Path(tspec.origin).parent / "lib"
    if cdir is None or not (tdir / "libtvm_ffi.so").is_file():
        return None
    return str(cdir), str(tdir)


def can_link() -> bool:
    return runtime_libdirs() is not None and shutil.which(os.environ.get("CC", "gcc")) is not None


def link(obj: Path, out: Path, tmpdir: Path | None = None) -> None:
    """Link ``obj`` into the shared object ``out`` (no rpath). The compiler driver's
    temp files go to ``tmpdir`` (the cache's scratch directory): a link killed mid-way
    leaves them there, for ``quack cache clean``, not in /tmp."""
    dirs = runtime_libdirs()
    cc = shutil.which(os.environ.get("CC", "gcc"))
    if dirs is None or cc is None:
        raise LinkError("no C compiler or cutlass-dsl runtime libraries found", str(obj))
    cdir, tdir = dirs
    cmd = [
        cc,
        "-shared",
        "-o",
        str(out),
        str(obj),
        f"-L{cdir}",
        "-lcute_dsl_runtime",
        f"-L{tdir}",
        "-ltvm_ffi",
        os.path.join(cdir, "libcuda_dialect_runtime_static.a"),
    ]
    # LC_ALL=C: the driver's messages untranslated, so a full disk is recognized in them
    # (link_entry warns about it; "No space left on device" is ld's only sign of it)
    env = dict(os.environ, LC_ALL="C", **({} if tmpdir is None else {"TMPDIR": str(tmpdir)}))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise LinkError(f"linking {obj} failed: {r.stderr.strip()[-2000:]}", str(obj))


_private_dir: str | None = None


def _private_so_dir() -> Path:
    """A private (0700) temp directory for .so files of a cache we can't write."""
    global _private_dir
    if _private_dir is None or not os.path.isdir(_private_dir):
        import atexit
        import tempfile

        _private_dir = tempfile.mkdtemp(prefix="quack-so-")
        atexit.register(shutil.rmtree, _private_dir, True)
    return Path(_private_dir)


def link_entry(store: Store, entry: Entry, obj: Path | None = None) -> Path | None:
    """Give a verified entry its .so (temp + rename, sidecar last). None if we can't link.
    A read-only cache gets the .so in a private temp directory instead (not shared).
    ``obj``: link this verified copy of the .o instead of the entry's path."""
    if not can_link():
        return None
    writable = store.writable()
    try:
        if writable:
            scratch = store.scratch_dir() if hasattr(store, "scratch_dir") else None
            tmp = fsutil.reserve_tmp(store.paths(entry.ref)["so"])
        else:
            tmp = fsutil.reserve_tmp(_private_so_dir() / f"{entry.ref.key}.so")
            scratch = _private_so_dir()
    except OSError as e:
        _link_failed(store, entry, writable, e)
        return None
    try:
        link(obj or entry.obj_path, tmp, scratch)
        if writable:
            return store.write_so(entry, tmp)
        private = tmp.with_name(f"{entry.ref.key}.so")
        os.replace(tmp, private)
        return private
    except (LinkError, OSError) as e:
        _link_failed(store, entry, writable, e)
        return None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


# What ld and the compiler driver print (LC_ALL=C) when the disk refuses the output.
_LINKER_DISK_ERRORS = (("No space left on device", errno.ENOSPC), ("Disk quota exceeded", errno.EDQUOT))


def _link_failed(store: Store, entry: Entry, writable: bool, e: BaseException) -> None:
    """A link that failed is a load through CuTe DSL's runtime instead, which imports the
    compiler: about a second in every process that loads the kernel, and no .so is left
    for the next one, so each pays it again. It used to be silent. When the cause is the
    cache's (its scratch directory unusable: a file planted at ``<root>/tmp``; a full disk;
    a write refused), warn once per cache directory, naming the cause and the fix; any
    other failure (the toolchain's, a compiler killed by a signal) is logged."""
    problem = _link_problem(e)
    if problem is None:
        logging.getLogger("quack.loader").info(
            "linking %s key %s into a .so failed (%s); loading its object through CuTe DSL",
            entry.ref.kernel,
            entry.ref.key[:16],
            e,
        )
        return
    cause, fix = problem
    if writable:
        where = f"the quack cache {getattr(store, 'root', '')}"
    else:  # a read-only cache: the .so goes to a private temp directory
        import tempfile

        where = f"this process's temp directory (under {tempfile.gettempdir()}; the cache is read-only)"
    problems.warn_once(
        f"link-failed:{where}",
        f"quack: kernels of {where} cannot be linked into .so files, so they load through "
        f"CuTe DSL's runtime, which imports the compiler in every process (a second or more "
        f"each, instead of under a millisecond): {cause}" + (f"; {fix}" if fix else ""),
        stacklevel=4,
    )


def _link_problem(e: BaseException) -> tuple[str, str] | None:
    """(cause, fix) when a link failed for a reason of the cache's (or its disk's), else None."""
    if isinstance(e, CacheError) and not isinstance(e, CacheWriteError):
        # the scratch directory (or the root) can't be used: its message names the path
        # and the fix ("Remove it or run quack cache clean")
        return str(e), ""
    code: int | None = None
    if isinstance(e, CacheWriteError):
        code = e.code
    elif isinstance(e, OSError):
        code = e.errno
    elif isinstance(e, LinkError):
        code = next((c for text, c in _LINKER_DISK_ERRORS if text in str(e)), None)
    reason = problems.write_reason(code)
    if reason is None:
        return None
    if code in (errno.ENOSPC, errno.EDQUOT):
        return reason, "free some space (`quack cache clean --max-size ...`): the next load links it"
    return reason, "point QUACK_CACHE_DIR at a directory you can write"


_runtime_ready = False
_runtime_load_s: float | None = None


def runtime_load_s() -> float | None:
    """Seconds this process spent loading cutlass-dsl's runtime library (its first
    kernel load pays it: a 43 MB library with the CUDA runtime inside, ~2 ms on a 2-core
    machine), or None before that. For cold-start accounting (bench_coldstart.py)."""
    return _runtime_load_s


def _prepare_runtime() -> None:
    global _runtime_ready, _runtime_load_s
    if _runtime_ready:
        return
    dirs = runtime_libdirs()
    if dirs is not None:
        t0 = time.perf_counter()
        ctypes.CDLL(os.path.join(dirs[0], "libcute_dsl_runtime.so"), mode=ctypes.RTLD_GLOBAL)
        _runtime_load_s = time.perf_counter() - t0
    _runtime_ready = True


def load_so(so: Path):
    """Load a linked kernel; returns (callable, module) — keep the module alive."""
    _prepare_runtime()
    from quack.runtime import ffi  # tvm_ffi's parts that load and call, not all of it

    mod = ffi.load_module(str(so))
    return mod[FUNCTION_NAME], mod


def load_object(obj: Path):
    """Fallback: load the .o through CuTe DSL's runtime (imports cutlass; ~250 ms first)."""
    import cutlass.cute as cute

    mod = cute.runtime.load_module(str(obj), enable_tvm_ffi=True)
    return mod[FUNCTION_NAME], mod


def _verified_bytes(entry) -> bytes:
    """The entry's .o, read once without following symlinks, if its bytes still match the
    metadata's digest. Raises EntryVanished (cleaned or replaced since its lookup)."""
    try:
        data = fsutil.read_nofollow(entry.obj_path)
    except OSError as e:
        raise EntryVanished(f"{entry.obj_path} vanished before it could be loaded ({e})") from None
    if hashlib.sha256(data).hexdigest() != entry.meta.get("sha256"):
        raise EntryVanished(f"{entry.obj_path} was replaced after it was verified")
    return data


def _sealed_memfd(data: bytes, name: str) -> int | None:
    """A memory file (Linux memfd) holding ``data``, sealed against any change, or None
    where there is none (no memfd_create, no /proc, out of descriptors or memory). It
    needs no disk, so a full or read-only temp directory can't fail the load of an
    entry without its .so (ENOSPC writing the copy used to escape the kernel call)."""
    create = getattr(os, "memfd_create", None)
    if create is None:
        return None
    try:
        fd = create(f"quack-{name}.o", os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0))
    except OSError:
        return None
    try:
        with open(fd, "wb", closefd=False) as f:
            f.write(data)
        if hasattr(fcntl, "F_ADD_SEALS"):  # Linux, Python >= 3.8: the F_SEAL_* come with it
            # Sealed: the bytes the linker and the loader read stay the verified ones,
            # whoever else gets hold of the descriptor (/proc/PID/fd is open to our uid).
            seals = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        # The linker and cutlass's loader open it by name: no /proc, no memory file.
        if not os.path.exists(_fd_path(fd)):
            raise OSError(errno.ENOENT, "no /proc/PID/fd to name a memory file by", _fd_path(fd))
    except OSError:
        os.close(fd)
        return None
    return fd


def _fd_path(fd: int) -> str:
    # /proc/PID, not /proc/self: the linker, a child process, opens it by this name.
    return f"/proc/{os.getpid()}/fd/{fd}"


def _tmp_copy(data: bytes, name: str) -> Path:
    """``data`` in a new file of this process's private temp directory: where there is
    no memory file. A temp directory that can't take it (disk full, read-only) makes
    the entry a miss with one CacheWarning naming the cause: EntryVanished."""
    snap: Path | None = None
    try:
        snap = fsutil.reserve_tmp(_private_so_dir() / f"{name}.o")
        with open(snap, "wb") as f:
            f.write(data)
        return snap
    except OSError as e:
        if snap is not None:
            try:
                os.unlink(snap)  # no partial copy left behind
            except OSError:
                pass
        from quack.cache.problems import warn_once

        code = errno.errorcode.get(e.errno or 0, "")
        where = snap.parent if snap is not None else "the temp directory"
        warn_once(
            f"snapshot:{code or e}",
            f"quack: could not write a private copy of a cached kernel's object to load it "
            f"({code + ': ' if code else ''}{e.strerror or e}, in {where}); such entries are "
            f"misses until the temp directory (TMPDIR) can take them",
        )
        raise EntryVanished(f"no private copy of {name}.o could be written ({e})") from None


@contextlib.contextmanager
def private_copy(data: bytes, name: str) -> Iterator[Path]:
    """A path to a private, read-only copy of verified object bytes, for the linker and
    cutlass's loader, which take a file name: a sealed memory file where the system has
    them (no disk needed), else a file of this process's private temp directory, gone
    when the block ends. Raises EntryVanished (with one CacheWarning) when neither can
    be had: loading whatever the name points at later would not be loading what was
    verified, so the entry is a miss instead."""
    fd = _sealed_memfd(data, name)
    if fd is not None:
        try:
            yield Path(_fd_path(fd))
        finally:
            os.close(fd)
        return
    snap = _tmp_copy(data, name)
    try:
        yield snap
    finally:
        try:
            os.unlink(snap)
        except OSError:
            pass


def snapshot_object(entry) -> contextlib.AbstractContextManager[Path]:
    """A private copy of the entry's .o whose bytes match the metadata's digest, read
    once without following symlinks: what gets linked or loaded is what was verified,
    even if a clean or a rebuild touches the cache meanwhile. A context manager yielding
    its path (``private_copy``). Raises EntryVanished."""
    return private_copy(_verified_bytes(entry), entry.ref.key)


def load_entry(store: Store, entry: Entry):
    """(callable, module, how) for a verified entry: its verified .so if there is one,
    else a .so linked from a verified snapshot of the .o, else the snapshot through
    CuTe DSL. Raises EntryVanished if the entry went away since its lookup (a miss)."""
    if entry.so_path is not None:
        try:
            fn, mod = load_so(entry.so_path)
            return fn, mod, "so"
        except Exception:  # noqa: BLE001 - gone or bad derived .so: fall back to the verified .o
            pass
    with snapshot_object(entry) as snap:
        return _link_and_load(store, entry, snap)


def _link_and_load(store: Store, entry: Entry, snap: Path):
    """(callable, module, how) for the verified copy ``snap`` of ``entry``'s object: a
    .so linked from it (into ``store`` or the private temp directory), else ``snap``
    itself through CuTe DSL."""
    so = link_entry(store, entry, obj=snap)
    if so is not None:
        try:
            fn, mod = load_so(so)
            return fn, mod, "so"
        except Exception:  # noqa: BLE001
            pass
    fn, mod = load_object(snap)
    return fn, mod, "o"


def load_fetched(ref, data: bytes):
    """(callable, module, how) for a read-only tier's object (a remote's: ``data``, the
    bytes the tier verified against its signed record) that the local store can't take
    (read-only, full): loaded from a private copy of those very bytes, its .so linked
    into the private temp directory, as an in-place entry is with no cache to keep one
    in. Dropping it left a valid, signed object unused (KernelNotPrebuilt, or a compile
    in this process). Raises EntryVanished (no private copy could be made)."""
    from quack.cache.entry import Entry

    with private_copy(data, ref.key) as snap:
        entry = Entry(ref, {"sha256": hashlib.sha256(data).hexdigest()}, snap, None)
        # _NoCache answers only writable() (False), all link_entry asks of such a cache.
        return _link_and_load(cast("Store", _NoCache()), entry, snap)


class _NoCache:
    """A cache that can't take a derived .so (read-only or disabled): link_entry links
    into this process's private temp directory instead."""

    def writable(self) -> bool:
        return False


def load_in_place(entry, store=None):
    """(callable, module, how) for an entry that lives outside the local store, in an
    in-place tier (an installed bundle; quack.cache.contract.InPlaceTier), verified
    there: its own .so if it has one, else a .so derived from its .o and kept in the
    local ``store`` where the entry would live (tied to the object's digest by the
    sidecar), or in a private temp directory when ``store`` is None (disabled or
    unusable) or read-only. Raises EntryVanished."""
    if entry.so_path is not None:
        try:
            fn, mod = load_so(entry.so_path)
            return fn, mod, "so"
        except Exception as e:  # noqa: BLE001 - a .so that won't load: link the .o ourselves
            logging.getLogger("quack.loader").info(
                "shipped .so of %s key %s did not load (%s); linking its object",
                entry.ref.kernel,
                entry.ref.key[:16],
                e,
            )
    target = _NoCache()
    if store is not None:
        so = store.derived_so(entry.ref, entry.meta["sha256"])
        if so is not None:
            try:
                fn, mod = load_so(so)
                return fn, mod, "so"
            except Exception:  # noqa: BLE001 - relinked below
                pass
        if store.writable():
            try:
                fsutil.ensure_dir(store.paths(entry.ref)["so"].parent, store.root)
                target = store
            except OSError:
                pass
    # _NoCache answers only writable() (False), all link_entry asks of such a cache.
    return load_entry(cast("Store", target), dataclasses.replace(entry, so_path=None))
