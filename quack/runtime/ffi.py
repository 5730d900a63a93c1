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
        for name in LEAN_SUBMODULES[1:]:
            importlib.import_module(f"tvm_ffi.{name}")
        # From here on the package is tvm_ffi's: its spec and loader (reload, importlib
        # tools), and the hooks that complete it on first use of anything else.
        module.__spec__ = self.real
        module.__loader__ = self.real.loader
        done = _Complete(module, self.real)
        # PEP 562 hooks: looked up in the module's namespace, like any global.
        module.__dict__["__getattr__"] = done.getattr
        module.__dict__["__dir__"] = done.dir


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
