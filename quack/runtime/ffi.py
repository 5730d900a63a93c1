"""tvm-ffi for the loader: import only what loading a kernel and calling it need.

``import tvm_ffi`` runs its package ``__init__``, which imports every part of the
package: ~35 modules, 15-18 ms of a fresh process's first kernel load on a 2-core
machine (issue 15), more where each file opened costs more (a sandboxed GPU host).
Loading a kernel and calling it use only the library (libtvm_ffi), the Cython core
(arguments, DLPack and stream exchange with torch, errors), the registry, the dtype,
error, tensor and module classes, and the optional torch DLPack hook; the rest
(dataclasses, structural, serialization, access paths, the C++ build helper) is
never touched. ``tvm_module()`` imports that subset under the package's real name,
through the import system (its module lock, its clean-up on failure), and leaves a
PEP 562 ``__getattr__``/``__dir__`` on the package: the first access to anything
else runs tvm_ffi's own ``__init__`` in it, so any other user of ``tvm_ffi`` in the
process (cutlass, the application) sees the whole package, as ``import tvm_ffi``
gives it. The submodules imported are tvm_ffi's own, executed once, shared by both.

Taken only when tvm_ffi is not imported yet and its version is one this was tested
with (``_LEAN_VERSIONS``); any failure falls back to the plain import. To have the
whole package up front, import tvm_ffi before the first kernel.

The Cython core also imports cuda-python's driver bindings (``cuda.bindings.driver``,
17 ms on the H200 where torch has not imported them: torch 2.11 does not, 2.13 does) for
one ``isinstance(arg, CUstream)`` test in its argument conversion. When they are not
imported yet, the lean import withholds them from the core (on this thread, for the
core's import only) and gives the core a stand-in whose ``CUstream`` matches exactly the
real class's instances: an object can only be a ``CUstream`` once the driver bindings are
imported, and then the stand-in asks them. Anything else read from the stand-in imports
the real module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

log = logging.getLogger("quack.loader")

# In tvm_ffi's own import order (its __init__); each imports what it needs itself.
# _optional_torch_c_dlpack must be in before the first call: the Cython core caches its
# argument converter per type, and a torch.Tensor seen before torch's C DLPack exchange
# API is in place would keep the slow Python fallback for the life of the process.
LEAN_SUBMODULES = ("libinfo", "registry", "_dtype", "error", "_tensor", "module", "_optional_torch_c_dlpack")
# Versions whose __init__ this subset was checked against (tests/test_ffi_lean.py runs the
# same calls through both imports); another version takes the plain import.
_LEAN_VERSIONS = ("0.1.",)

_lock = threading.RLock()
_info: dict = {"how": "", "import_s": 0.0}
_module: ModuleType | None = None  # tvm_ffi.module, once the package is imported


def info() -> dict:
    """How this process got tvm_ffi: ``how`` is "" (not yet), "lean", "full" (the plain
    import; "lean-failed" when the subset was tried first), or "preloaded" (imported
    before the first kernel); ``import_s`` what that took here."""
    return dict(_info)


@contextmanager
def torch_hidden() -> Iterator[None]:
    """While open, ``import torch`` raises ImportError in this process, unless torch is
    imported already. tvm_ffi imports torch whenever it can (its ``__init__``, and its
    Cython core at import: ~3 s of a fresh process on 2 cores), and so does cutlass's
    export path through it; a compile worker or a static load never touches a tensor.
    Only for such processes: the core binds torch (or None) when it is imported, so a
    torch tensor handed to a kernel of this process later would not convert. torch is
    importable again afterwards (a compile function that imports it still can). The hiding
    is process-wide: a thread importing torch meanwhile would fail too, so its callers use
    it while they start up, before any thread of theirs runs (forkserver preload, Ray
    actor construction, a verify loader's warm-up)."""
    hidden = "torch" not in sys.modules
    if hidden:
        sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if hidden and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]


def tvm_module() -> ModuleType:
    """``tvm_ffi.module`` (load_module, Module), importing tvm_ffi's lean subset first if
    no part of tvm_ffi is imported yet."""
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            t0 = time.perf_counter()
            if "tvm_ffi" in sys.modules:
                how = "preloaded"
            elif not _lean_version():
                how = "full"
            else:
                try:
                    how = _import_lean()
                except Exception as e:  # noqa: BLE001 - tvm_ffi's own __init__ failed too: once more, plainly
                    log.info("lean import of tvm_ffi failed (%s: %s)", type(e).__name__, e)
                    how = "lean-failed"
            # The package before its submodule: when another thread is importing tvm_ffi
            # right now, this waits for that import to finish (a submodule imported
            # meanwhile would race its __init__: "partially initialized module").
            importlib.import_module("tvm_ffi")
            mod = importlib.import_module("tvm_ffi.module")
            _info.update(how=how, import_s=time.perf_counter() - t0)
            _module = mod
    return _module


def load_module(path: str):
    """``tvm_ffi.load_module(path)``: the tvm-ffi Module of a linked kernel."""
    return tvm_module().load_module(path)


def _lean_version() -> bool:
    from quack.cache.keys import toolchain  # the stamp's reading: no extra metadata scan

    v = toolchain().get("tvm_ffi") or ""
    return v.startswith(_LEAN_VERSIONS)


def _init_code(spec: importlib.machinery.ModuleSpec):
    """The code of tvm_ffi's own ``__init__``."""
    get_code = getattr(spec.loader, "get_code", None)
    if get_code is None:
        raise ImportError("tvm_ffi's loader can't give its code", name="tvm_ffi")
    return get_code("tvm_ffi")


def _run_init(pkg: ModuleType, spec: importlib.machinery.ModuleSpec) -> None:
    """Run tvm_ffi's own ``__init__`` in ``pkg``, the package object the lean import made:
    the submodules already imported stay its attributes and are not executed again."""
    d = pkg.__dict__
    # The hooks go first: while __init__ runs, a missing name must fail as usual (the
    # import system probes the package with hasattr for each submodule it imports).
    d.pop("__getattr__", None)
    d.pop("__dir__", None)
    d["__spec__"], d["__loader__"] = spec, spec.loader
    exec(_init_code(spec), d)  # noqa: S102 - tvm_ffi's own __init__, in its own namespace


class _Complete:
    """The package's ``__getattr__``/``__dir__`` until its ``__init__`` has run."""

    def __init__(self, pkg: ModuleType, spec: importlib.machinery.ModuleSpec):
        self.pkg, self.spec, self.done = pkg, spec, False

    def run(self) -> None:
        with _lock:
            if not self.done:
                self.done = True
                _run_init(self.pkg, self.spec)
                log.debug("tvm_ffi completed: its __init__ ran after the lean import")

    def getattr(self, name: str):
        self.run()
        return getattr(self.pkg, name)

    def dir(self) -> list[str]:
        self.run()
        return sorted(self.pkg.__dict__)


class _LeanLoader(importlib.abc.Loader):
    def __init__(self, real: importlib.machinery.ModuleSpec):
        self.real = real
        self.how = ""

    def create_module(self, spec):
        return None  # the default module, with __path__ from the spec

    def exec_module(self, module: ModuleType) -> None:
        try:
            self._lean(module)
            self.how = "lean"
        except Exception as e:  # noqa: BLE001 - any surprise: tvm_ffi's own __init__, here
            # In this same package object: a second one (the import system's clean-up,
            # then a plain import) would lack the submodules imported so far as attributes.
            log.info("lean import of tvm_ffi failed (%s: %s); running its __init__", type(e).__name__, e)
            self.how = "lean-failed"
            _run_init(module, self.real)

    def _lean(self, module: ModuleType) -> None:
        # As tvm_ffi's __init__ does first: torch before libtvm_ffi (a symbol conflict
        # otherwise seen on one platform), then the library, RTLD_GLOBAL, before any
        # Cython module that links it.
        try:
            import torch  # noqa: F401
        except ImportError:
            pass
        libinfo = importlib.import_module("tvm_ffi.libinfo")
        module.LIB = libinfo.load_lib_ctypes("apache-tvm-ffi", "tvm_ffi", "RTLD_GLOBAL")  # type: ignore[attr-defined]
        withheld = _withhold_driver_bindings()
        try:
            for name in LEAN_SUBMODULES[1:]:
                importlib.import_module(f"tvm_ffi.{name}")
        finally:
            if withheld is not None:
                withheld.close()
                _give_core_the_stand_in(withheld)
        # From here on the package is tvm_ffi's: its spec and loader (reload, importlib
        # tools), and the hooks that complete it on first use of anything else.
        module.__spec__ = self.real
        module.__loader__ = self.real.loader
        done = _Complete(module, self.real)
        # PEP 562 hooks: looked up in the module's namespace, like any global.
        module.__dict__["__getattr__"] = done.getattr
        module.__dict__["__dir__"] = done.dir


# tvm_ffi.core's module global holding cuda-python's driver bindings (None without them).
_CORE_DRIVER_NAME = "cuda_driver"
_DRIVER = "cuda.bindings.driver"


class _Withhold(importlib.abc.MetaPathFinder):
    """Makes the import of ``names`` fail on one thread while open: the Cython core's
    ``try: from cuda.bindings import driver / except ImportError`` then takes its
    no-bindings branch. Other threads import them as usual meanwhile."""

    def __init__(self, names: frozenset[str]):
        self.names, self.thread, self.hits = names, threading.get_ident(), 0

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.names and threading.get_ident() == self.thread:
            self.hits += 1
            raise ModuleNotFoundError(f"{fullname} withheld from tvm_ffi's lean import", name=fullname)
        return None

    def close(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


def _withhold_driver_bindings() -> _Withhold | None:
    """Withhold cuda-python's driver bindings from the core's import, unless imported
    already (then the core gets the real module, as with ``import tvm_ffi``)."""
    if _DRIVER in sys.modules or "tvm_ffi.core" in sys.modules:
        return None
    # The package too when it is not in: its own import (cuda.pathfinder, ...) is 3.5 ms.
    names = frozenset(n for n in ("cuda.bindings", _DRIVER) if n not in sys.modules)
    finder = _Withhold(names)
    sys.meta_path.insert(0, finder)
    return finder


class _CUstreamCheck(type):
    def __instancecheck__(cls, obj) -> bool:
        # Whoever holds a CUstream imported the driver bindings: no import here, ever.
        driver = sys.modules.get(_DRIVER)
        return driver is not None and isinstance(obj, driver.CUstream)


class _CUstream(metaclass=_CUstreamCheck):
    """Stands for ``cuda.bindings.driver.CUstream`` in ``isinstance`` tests."""


class DriverStandIn:
    """tvm_ffi.core's ``cuda_driver`` after a lean import that withheld the driver bindings:
    ``CUstream`` answers ``isinstance`` as the real class does; any other name is read
    from the real module (imported then)."""

    CUstream = _CUstream

    def __getattr__(self, name: str):
        return getattr(importlib.import_module(_DRIVER), name)

    def __repr__(self) -> str:
        return "<cuda.bindings.driver, imported on first use (quack.runtime.ffi)>"


def _give_core_the_stand_in(withheld: _Withhold) -> None:
    core = sys.modules.get("tvm_ffi.core")
    if core is None or not withheld.hits:
        return  # the core was not imported, or did not ask: nothing withheld from it
    if core.__dict__.get(_CORE_DRIVER_NAME, "missing") is None:
        # A Cython module's globals live in its __dict__ (looked up by dict version), so
        # the core's conversion code reads this from its next call on.
        setattr(core, _CORE_DRIVER_NAME, DriverStandIn())
        log.debug("tvm_ffi.core: cuda-python's driver bindings withheld; a stand-in until used")
    else:
        # A core that keeps them under another name (a layout _LEAN_VERSIONS' tests never
        # saw): importing them now would not reach it. Its CUstream fallback stays off;
        # cuda-python's streams still convert through their __cuda_stream__ protocol.
        log.warning(
            "tvm_ffi.core has no %r global: its CUstream fallback sees no driver bindings", _CORE_DRIVER_NAME
        )


class _OneShot(importlib.abc.MetaPathFinder):
    def __init__(self, spec: importlib.machinery.ModuleSpec):
        self.spec = spec

    def find_spec(self, fullname, path=None, target=None):
        return self.spec if fullname == "tvm_ffi" else None


def _import_lean() -> str:
    """Import tvm_ffi's subset as the package: "lean", or "lean-failed" when the subset
    failed and tvm_ffi's own __init__ ran instead. Raises what that raised."""
    real = importlib.util.find_spec("tvm_ffi")
    if real is None or real.origin is None or not real.submodule_search_locations:
        raise ImportError("tvm_ffi is not an installed package", name="tvm_ffi")
    loader = _LeanLoader(real)
    spec = importlib.machinery.ModuleSpec("tvm_ffi", loader, origin=real.origin, is_package=True)
    spec.submodule_search_locations = list(real.submodule_search_locations)
    spec.has_location = True
    spec.cached = real.cached
    finder = _OneShot(spec)
    # Through the import system, not by hand: it holds tvm_ffi's module lock while the
    # subset loads (another thread importing tvm_ffi waits, then gets this package).
    sys.meta_path.insert(0, finder)
    try:
        importlib.import_module("tvm_ffi")
    finally:
        sys.meta_path.remove(finder)
    return loader.how or "preloaded"  # "": another thread's plain import came first
