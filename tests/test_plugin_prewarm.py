"""--quack-prewarm: workers started before collection grows sys.path still import a
kernel module found only through it (tests/, as this repo's own toykernels.py is), and a
worker's failure to import the kernel's module is not remembered as the key's compile
failure. Without --async-compile the flag starts the one worker a miss waits on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from reliability_support import TESTS, env

# The project's root conftest (loaded before pytest_configure, unlike tests/conftest.py,
# which would put tests/ on sys.path before the prewarm and hide the bug): before
# collection, wait (bounded) until the prewarmed worker has started, so that it starts
# with the sys.path collection has not grown yet, and record what it found.
CONFTEST = """
import json, os, sys, time

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session):
    from quack.compile import pool

    p = pool.default_pool()
    end = time.monotonic() + 120
    while p.stats()["workers"] < 1 and time.monotonic() < end:
        time.sleep(0.05)
    with open(os.environ["PREWARM_REPORT"], "w") as f:
        json.dump({"workers": p.stats()["workers"], "tests_on_path": any(
            x.rstrip("/").endswith("proj/tests") for x in sys.path)}, f)
"""

TEST_LOC = """
from lockernels import loc_scale


def test_loc_32():
    assert callable(loc_scale("float32", 32, False))


def test_loc_64():
    assert callable(loc_scale("float32", 64, False))
"""


def _project(tmp_path: Path) -> Path:
    d = tmp_path / "proj"
    (d / "tests").mkdir(parents=True)
    (d / "quack.toml").write_text('[runtime]\narch = "sm_90a"\n\n[build]\nkernel_packages = []\n')
    (d / "conftest.py").write_text(CONFTEST)
    toy = (TESTS / "toykernels.py").read_text()
    # toy_scale, renamed: a kernel module only collection puts on sys.path
    (d / "tests" / "lockernels.py").write_text(
        toy[: toy.index('@jit_cache("toy_fail"')].replace("toy_", "loc_")
    )
    (d / "tests" / "test_loc.py").write_text(TEST_LOC)
    return d


def _pytest(proj: Path, tmp_path: Path, *opts: str) -> tuple[subprocess.CompletedProcess, dict]:
    report = tmp_path / "prewarm.json"
    e = env(QUACK_CACHE_DIR=tmp_path / "cache", PREWARM_REPORT=report, QUACK_COMPILE_TIMEOUT=300)
    e.pop("QUACK_MODE", None)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *opts, "tests", "-q"],
        cwd=str(proj),
        env=e,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return r, json.loads(report.read_text()) if report.exists() else {}


@pytest.mark.parametrize("opts", [("--async-compile=1", "--quack-prewarm"), ("--quack-prewarm",)])
def test_prewarmed_worker_imports_a_kernel_module_collection_put_on_sys_path(tmp_path, opts):
    proj = _project(tmp_path)
    r, seen = _pytest(proj, tmp_path, *opts)
    out = r.stdout + r.stderr
    # the worker started before collection (without --async-compile it started none)
    assert seen == {"workers": 1, "tests_on_path": False}, out
    assert "ModuleNotFoundError" not in out and "will not be compiled again" not in out, out
    assert r.returncode == 0, out
    assert "2 passed" in out, out


FLAKY = """
import os

from quack import jit_cache
from quack.params import Int

# refused in any process but the caller while the marker exists: a worker whose import of
# the kernel's module fails, as one with a stale sys.path did
if os.getpid() != int(os.environ["FLAKY_CALLER_PID"]) and os.path.exists(os.environ["FLAKY_MARKER"]):
    raise ImportError("flaky_mod: refused in this worker (the test's marker)")


@jit_cache("flaky_k", params={"n": Int(min=0, max=100)})
def flaky_k(n: int = 1):
    import toykernels

    return toykernels.toy_scale.compile_uncached("float32", 32, False)
"""

SCRIPT = """
import json, os, sys
os.environ["FLAKY_CALLER_PID"] = str(os.getpid())
open(os.environ["FLAKY_MARKER"], "w").close()
import flaky_mod
from quack.errors import CompileError
out = {}
try:
    flaky_mod.flaky_k(1)
    out["first"] = "compiled"
except CompileError as e:
    out["first"] = {"transient": e.transient, "notes": getattr(e, "__notes__", []), "msg": str(e)}
os.remove(os.environ["FLAKY_MARKER"])
out["second"] = callable(flaky_mod.flaky_k(1))
print(json.dumps(out))
"""


def test_a_worker_failing_to_import_the_kernel_module_is_not_remembered(tmp_path):
    (tmp_path / "flaky_mod.py").write_text(FLAKY)
    e = env(QUACK_CACHE_DIR=tmp_path / "cache", FLAKY_MARKER=tmp_path / "marker", QUACK_COMPILE_TIMEOUT=300)
    e.pop("QUACK_MODE", None)
    e["PYTHONPATH"] = f"{tmp_path}:{e['PYTHONPATH']}"
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=str(tmp_path), env=e, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    first = out["first"]
    assert first["transient"] is True, first
    assert "the compile worker could not import the kernel's module 'flaky_mod'" in first["msg"]
    assert "ImportError: flaky_mod: refused in this worker" in first["msg"]
    assert not any("will not be compiled again" in n for n in first["notes"]), first
    assert out["second"] is True  # retried once the module imports, not the first error again
