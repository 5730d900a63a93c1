"""The loader's lean tvm_ffi import (quack.runtime.ffi, issue 15): a kernel loaded with only
tvm_ffi's loading-and-calling parts behaves exactly as with ``import tvm_ffi``; anything
else that touches tvm_ffi afterwards gets the whole package; a failure or an untested
version takes the plain import. Each case is a fresh process (tvm_ffi's import is once per
process) loading one real kernel, built once for the module, from a prebuilt cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys, threading
mode = sys.argv[1]
if mode == "lean-no-driver":
    # A torch that does not import cuda-python's driver bindings (2.11, the H200's, does
    # not; this machine's 2.13 does): hidden while torch imports.
    import importlib.abc
    class Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname == "cuda.bindings" or fullname.startswith("cuda.bindings."):
                raise ModuleNotFoundError(fullname, name=fullname)
    hide = Hide()
    sys.meta_path.insert(0, hide)
    import torch
    sys.meta_path.remove(hide)
    assert "cuda.bindings.driver" not in sys.modules
import torch
if mode == "preloaded":
    import tvm_ffi  # the application imported it first: the loader uses it as is
from quack.runtime import ffi
if mode == "lean-failed":
    ffi.LEAN_SUBMODULES = ffi.LEAN_SUBMODULES + ("no_such_submodule",)
if mode == "untested-version":
    ffi._LEAN_VERSIONS = ("9.9.",)
import toykernels

out = {}
# Whether something (torch, on some builds) imported cuda-python's driver bindings first:
# the CPU torch here does, the H200's CUDA torch 2.11 does not.
out["driver_before_load"] = "cuda.bindings.driver" in sys.modules
if mode.startswith("threads"):
    # The kernel's first load and another thread's `import tvm_ffi` + use, at once:
    # "threads-lean-first" holds the lean import open until the other import arrives;
    # "threads-plain-first" starts the load as the other thread's plain import begins.
    import time
    started = threading.Event()
    if mode == "threads-lean-first":
        lean = ffi._LeanLoader._lean
        def slow_lean(self, module):
            started.set()
            time.sleep(0.3)  # the other thread's import arrives meanwhile and must wait
            lean(self, module)
        ffi._LeanLoader._lean = slow_lean
    res, errs = {}, []
    def load():
        try:
            if mode == "threads-plain-first":
                started.wait(60)
            res["fn"] = toykernels.toy_scale("float32", 128, False)
        except BaseException as e:
            errs.append(repr(e))
    def other():
        try:
            if mode == "threads-lean-first":
                started.wait(60)
            else:
                started.set()
            import tvm_ffi
            res["tensor_cls"] = tvm_ffi.Tensor.__name__
        except BaseException as e:
            errs.append(repr(e))
    ts = [threading.Thread(target=load), threading.Thread(target=other)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    out["alive"] = [t.is_alive() for t in ts]
    out["errors"] = errs
    out["tensor_cls"] = res.get("tensor_cls")
    fn = res["fn"]
else:
    fn = toykernels.toy_scale("float32", 128, False)
out["how"] = ffi.info()["how"]
out["driver_after_load"] = "cuda.bindings.driver" in sys.modules
out["core_driver"] = type(sys.modules["tvm_ffi.core"].cuda_driver).__name__
out["fn_type"] = type(fn).__name__
out["tvm_after_load"] = sorted(m for m in sys.modules if m.split(".")[0] == "tvm_ffi")
x = torch.ones(256)
y = torch.empty(256)
calls = {
    "cpu tensors": (x, y, 2.0),
    "too few": (x, y),
    "too many": (x, y, 2.0, 3.0),
    "not a tensor": ("a", y, 2.0),
    "not a float": (x, y, "s"),
    "wrong dtype": (x.half(), y, 2.0),
    "none": (None, y, 2.0),
}
out["calls"] = {}
for name, args in calls.items():
    try:
        fn(*args)
        out["calls"][name] = ["returned", ""]
    except Exception as e:
        out["calls"][name] = [type(e).__name__, str(e)]
out["tvm_before_use"] = sorted(m for m in sys.modules if m.split(".")[0] == "tvm_ffi")
import tvm_ffi
out["tensor"] = tvm_ffi.Tensor.__name__  # completes a lean package
out["dir"] = sorted(dir(tvm_ffi))
out["all"] = sorted(tvm_ffi.__all__)
out["tvm_after_use"] = sorted(m for m in sys.modules if m.split(".")[0] == "tvm_ffi")
out["has_hook"] = "__getattr__" in vars(tvm_ffi)
# A cuda-python stream through tvm_ffi's argument conversion, and the core's CUstream test
# for a stream, a non-stream and a subclass; then the driver bindings are imported.
from cuda.bindings import driver
echo = tvm_ffi.get_global_func("testing.echo")
class SubStream(driver.CUstream):
    pass
core_drv = sys.modules["tvm_ffi.core"].cuda_driver
out["echo_stream"] = echo(driver.CUstream(12345)).value
out["isinstance"] = [isinstance(o, core_drv.CUstream) for o in (driver.CUstream(7), 7, SubStream(3), "s")]
out["driver_attr"] = core_drv.CUresult.CUDA_SUCCESS == driver.CUresult.CUDA_SUCCESS
if mode == "lean":
    # The compiler in the same process after a lean load (jit mode's in-process compile):
    # cutlass imports and uses tvm_ffi itself, and gets the whole package.
    compiled = toykernels.toy_scale.compile_uncached("float32", 64, False)
    out["compiled"] = hasattr(compiled, "export_to_c")
print(json.dumps(out))
"""

MODES = (
    "lean",
    "preloaded",
    "lean-failed",
    "untested-version",
    "threads-lean-first",
    "threads-plain-first",
    "lean-no-driver",
)
LEAN = {"tvm_ffi", "tvm_ffi.core", "tvm_ffi._ffi_api"} | {
    f"tvm_ffi.{m}"
    for m in ("libinfo", "registry", "_dtype", "error", "_tensor", "module", "_optional_torch_c_dlpack")
}


def _env(cache, mode):
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUACK_")}
    env.update(QUACK_CACHE_DIR=str(cache), QUACK_ARCH="sm_90a", QUACK_MODE=mode)
    return env


def _run(args, env, cwd, timeout=600):
    r = subprocess.run(
        [sys.executable, *args], env=env, cwd=str(cwd), capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return r


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A cache holding toy_scale(float32, 128): compiled once by a worker (jit mode)."""
    d = tmp_path_factory.mktemp("ffi_lean")
    cache = d / "cache"
    code = "import toykernels; toykernels.toy_scale('float32', 128, False); print('built')"
    _run(["-c", code], _env(cache, "jit"), d)
    return d, cache


@pytest.fixture(scope="module")
def runs(built):
    d, cache = built
    out = {}
    for mode in MODES:
        r = _run(["-c", SCRIPT, mode], _env(cache, "prebuilt"), d)
        out[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def test_a_lean_load_imports_only_the_loading_parts(runs):
    lean = runs["lean"]
    assert lean["how"] == "lean" and lean["fn_type"] == "Function"
    assert set(lean["tvm_after_load"]) == LEAN, sorted(set(lean["tvm_after_load"]) ^ LEAN)
    # Seven calls, errors and all, reached nothing outside the subset.
    assert set(lean["tvm_before_use"]) == LEAN
    assert lean["compiled"] is True  # then cutlass compiled a kernel through tvm_ffi
    assert runs["preloaded"]["how"] == "preloaded"
    assert "tvm_ffi.dataclasses" in runs["preloaded"]["tvm_after_load"]


def test_calls_behave_as_with_the_whole_package(runs):
    """Same exception type and message for every call, lean or not: the argument
    converters, the error kinds (ValueError, TypeError) and their text are tvm_ffi's."""
    full = runs["preloaded"]["calls"]
    assert len(full) == 7
    # On a machine without a GPU every call fails in the kernel's own argument checks;
    # with one, only the CPU tensors fail (device); either way both runs must agree.
    assert full["too few"][0] == "TypeError" and full["not a tensor"][0] == "TypeError"
    assert full["cpu tensors"][0] == "ValueError" and "device" in full["cpu tensors"][1]
    for mode in MODES[2:] + ("lean",):
        assert runs[mode]["calls"] == full, mode


def test_anything_else_touching_tvm_ffi_gets_the_whole_package(runs):
    full = runs["preloaded"]
    for mode in MODES[2:] + ("lean",):
        r = runs[mode]
        assert r["tensor"] == "Tensor", mode
        assert r["dir"] == full["dir"], (mode, sorted(set(r["dir"]) ^ set(full["dir"])))
        assert r["all"] == full["all"], mode
        assert r["tvm_after_use"] == full["tvm_after_use"], mode
        assert r["has_hook"] is False, mode


def test_a_failing_lean_import_or_an_untested_version_takes_the_plain_import(runs):
    assert runs["lean-failed"]["how"] == "lean-failed"
    assert runs["untested-version"]["how"] == "full"
    for mode in ("lean-failed", "untested-version"):
        # The plain import ran: the whole package was there from the first load on.
        assert "tvm_ffi.dataclasses" in runs[mode]["tvm_after_load"], mode
        assert runs[mode]["fn_type"] == "Function"


def test_a_concurrent_import_of_tvm_ffi_waits_and_gets_the_package(runs):
    """Another thread importing tvm_ffi while the first kernel loads: whichever import
    started first, the other waits for it, and both threads get the one whole package."""
    for mode in ("threads-lean-first", "threads-plain-first"):
        r = runs[mode]
        assert r["alive"] == [False, False] and r["errors"] == [], mode
        assert r["tensor_cls"] == "Tensor" and r["fn_type"] == "Function", mode
    assert runs["threads-lean-first"]["how"] == "lean"
    assert runs["threads-plain-first"]["how"] in ("preloaded", "lean")


def test_driver_bindings_are_withheld_only_when_nobody_imported_them(runs):
    """cuda-python's driver bindings (17 ms on the H200) stay out of a lean load when torch
    did not import them; tvm_ffi's core gets a stand-in whose CUstream test answers as the
    real class's (a stream converts, a subclass too, an int and a str do not); anything else
    read from it is the real module's. Where they were imported, the core gets them as is."""
    r = runs["lean-no-driver"]
    assert r["how"] == "lean" and r["fn_type"] == "Function"
    assert r["driver_after_load"] is False and r["core_driver"] == "DriverStandIn"
    assert r["calls"] == runs["preloaded"]["calls"]
    assert r["echo_stream"] == 12345
    assert r["isinstance"] == [True, False, True, False]
    assert r["driver_attr"] is True
    for mode in MODES[:-1]:
        if runs[mode]["driver_before_load"]:  # imported before (torch did): the real module
            assert runs[mode]["driver_after_load"] is True, mode
            assert runs[mode]["core_driver"] == "module", mode
        elif runs[mode]["how"] == "lean":  # nobody did: withheld, as in lean-no-driver
            assert runs[mode]["driver_after_load"] is False, mode
            assert runs[mode]["core_driver"] == "DriverStandIn", mode
        assert runs[mode]["isinstance"] == [True, False, True, False], mode
        assert runs[mode]["echo_stream"] == 12345, mode
