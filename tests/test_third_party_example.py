"""examples/third_party (issue 27): a kernel package with a helper package outside it, a
preloaded module, an SM90-only rule, a tuple and an fp8 parameter. Built for sm_90a on
CPU into a temporary cache, refused for sm_100a at expansion, loaded in prebuilt mode
without the compiler; on a GPU, launched against torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import third_party_support
from reliability_support import run_quack

built = third_party_support.built  # the module-scoped build, a fixture used by name

_PREBUILT = r"""
import json, sys
from tp_kernels.dequant import compile_tp_dequant
fn = compile_tp_dequant("float8_e4m3fn", "bfloat16", (256, 2))
u = compile_tp_dequant.usage()[0]
print(json.dumps({"callable": callable(fn), "how": u["how"], "compiles": u["compiles"],
                  "cutlass_dsl": "cutlass.cutlass_dsl" in sys.modules}))
"""


def test_example_builds_for_sm90_with_its_preload(built):
    _proj, _e, res = built
    # The manifest's 19 configurations (issue 27's workload shape): an fp8 cross product
    # with an exclude, a 16-bit one and an include.
    assert (res["total"], res["compiled"], res["failed"]) == (19, 19, 0), res
    assert res["preload"] == ["tp_helpers.dequant"] and res["preload_s"] > 0, res
    assert {k["arch"] for k in res["keys"]} == {"sm_90a"}
    configs = {
        (k["params"]["in_dtype"], k["params"]["out_dtype"], tuple(k["params"]["tile"])) for k in res["keys"]
    }
    assert len(configs) == 19
    assert {c[2] for c in configs} == {(128, 4), (256, 2), (64, 8), (128, 8), (256, 1)}
    assert {c[0] for c in configs} == {"float8_e4m3fn", "float8_e5m2", "bfloat16", "float16", "float32"}
    assert not {c for c in configs if c[1] == "float16" and c[2] == (64, 8)}  # the exclude


def test_example_rule_refuses_sm100a_at_expansion(built):
    proj, e, _ = built
    r = run_quack(["build", "-n", "--arch", "sm_100a"], cwd=proj, timeout=120, env_=e)
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "tp_dequant: arch = 'sm_100a' is not allowed" in out and "tp_dequant is SM90 only" in out, out


def _with_preload(proj, tmp_path, module: str):
    bad = tmp_path / "bad"
    shutil.copytree(proj, bad, ignore=shutil.ignore_patterns("__pycache__"))
    toml = bad / "quack.toml"
    toml.write_text(toml.read_text().replace('preload = ["tp_helpers.dequant"]', f'preload = ["{module}"]'))
    return bad, toml


def test_example_preload_that_cannot_be_found_stops_the_build_before_any_worker(built, tmp_path):
    proj, e, _ = built
    bad, toml = _with_preload(proj, tmp_path, "tp_helpers.missing")
    e2 = dict(e, QUACK_CACHE_DIR=str(tmp_path / "cache"))
    r = run_quack(["build", "--jobs", "2", "--keep-going", "--json"], cwd=bad, timeout=300, env_=e2)
    assert r.returncode == 1, r.stdout + r.stderr
    # Checked in the build process before any worker: no build ran, so no JSON result (a
    # worker used to find it after the forkserver's start-up and fail every key with it).
    assert r.stdout == "", r.stdout
    assert (
        f"error: preload module 'tp_helpers.missing' (set in {toml}) cannot be imported (checked "
        "before compiling): ModuleNotFoundError: No module named 'tp_helpers.missing'"
    ) in r.stderr.splitlines(), r.stderr
    assert not list((tmp_path / "cache").glob("v1/*/tp_dequant/*/*.o"))


def test_example_preload_that_raises_in_the_worker_stops_the_build_naming_it(built, tmp_path):
    proj, e, _ = built
    bad, toml = _with_preload(proj, tmp_path, "tp_helpers.broken")
    # Found (the build's check passes), but its import fails: the worker reports it before
    # compiling, and the build stops even with --keep-going.
    (bad / "tp_helpers" / "broken.py").write_text('raise ImportError("libfoo.so: cannot open")\n')
    e2 = dict(e, QUACK_CACHE_DIR=str(tmp_path / "cache"))
    r = run_quack(["build", "--jobs", "2", "--keep-going", "--json"], cwd=bad, timeout=300, env_=e2)
    assert r.returncode == 1, r.stdout + r.stderr
    res = json.loads(r.stdout)
    assert res["compiled"] == 0 and res["failed"] >= 1, res
    errs = {k.get("error", "") for k in res["keys"] if k["status"] == "failed"}
    assert errs == {
        f"error: preload module 'tp_helpers.broken' (set in {toml}) failed to import in the compile "
        "worker: ImportError: libfoo.so: cannot open"
    }, errs


def test_example_loads_prebuilt_without_the_compiler(built):
    proj, e, _ = built
    e = dict(e, QUACK_MODE="prebuilt", PYTHONPATH=f"{proj}:{e['PYTHONPATH']}")
    p = subprocess.run(
        [sys.executable, "-c", _PREBUILT], cwd=proj, env=e, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out == {"callable": True, "how": out["how"], "compiles": 0, "cutlass_dsl": False}, out
    assert out["how"] in ("so", "o")
