"""Deployment bundle figures (issue 13).

    QUACK_CACHE_DIR=... python benchmarks/bench_bundles.py [--repeat 7] [--out DIR]

Uses the project's cache (settings; what is missing is built by `quack bundle`) and
prints JSON:
  - bundle size and `quack bundle` wall time for manifests/default.toml and for
    default + tests (a warm cache: the packaging cost; the compile cost is `quack build`'s)
  - fresh interpreter -> first kernel loaded (rmsnorm_fwd bf16 4096): from an installed
    bundle with an empty cache vs from the local cache without any bundle, in two fresh
    virtual environments set up alike (median of --repeat, alternating)
  - a process that never uses quack kernels (imports quack and the kernels package): how
    often bundle discovery runs (entry_points calls) and its import time with and without
    a bundle installed; and the cost of discovery itself, paid once at the first lookup
    that reaches the bundle tier
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_FIRST = r"""
import time
t0 = time.perf_counter()
import sys
from quack import registry
from quack.runtime import jit
import quack_kernels.rmsnorm
fn = jit.kernel("rmsnorm_fwd")("bfloat16", 4096, True, False, False)
t1 = time.perf_counter()
u = jit.kernel("rmsnorm_fwd").usage()[0]
import json
print(json.dumps({"first_kernel_s": t1 - t0, "load_s": u["load_s"], "tier": u["tier"], "how": u["how"], "compiles": u["compiles"],
                  "cutlass": "cutlass" in sys.modules}))
"""

# The same, with the libraries every loaded kernel needs (tvm_ffi, cutlass-dsl's runtime
# .so) already loaded: what is left is the tier's own cost (lookup, checksum, dlopen).
_FIRST_WARM = (
    r"""
import ctypes, os, sys, time
import tvm_ffi
from quack.runtime import loader
d = loader.runtime_libdirs()
ctypes.CDLL(os.path.join(d[0], "libcute_dsl_runtime.so"), mode=ctypes.RTLD_GLOBAL)
"""
    + _FIRST
)

# Per kernel, in one process with the runtime loaded: local lookup + load of key i
# (the project's cache) vs bundle open + in-place load of key i (the installed bundle),
# alternating over all keys; discovery is paid once, before.
_PER_KEY = r"""
import json, statistics, sys, time
from quack import registry, settings
from quack.cache.store import DiskStore
from quack.compile import builder
from quack.runtime import loader, tiers
registry.load_packages(["quack_kernels"])
from quack_build.manifest.read import expand
s = settings.get()
cfgs = expand([sys.argv[1]], archs=("sm_90a",)).configs
store = DiskStore(s.cache_dir)
(view,) = [t for t in tiers.read_tiers(s) if t.name == "bundles"]
keep = []
warm = builder.entry_ref(cfgs[0].spec, cfgs[0].params, "sm_90a")
keep.append(loader.load_entry(store, store.lookup(warm)))   # runtime libraries loaded
t0 = time.perf_counter(); view.open(warm); disc = time.perf_counter() - t0
loc, bun = [], []
for c in cfgs[1:]:
    ref = builder.entry_ref(c.spec, c.params, "sm_90a")
    t0 = time.perf_counter(); e = store.lookup(ref); keep.append(loader.load_entry(store, e)); loc.append(time.perf_counter() - t0)
    t0 = time.perf_counter(); e = view.open(ref); keep.append(loader.load_in_place(e, None)); bun.append(time.perf_counter() - t0)
print(json.dumps({"keys": len(loc), "local_ms": statistics.median(loc) * 1e3, "bundle_ms": statistics.median(bun) * 1e3,
                  "first_open_with_discovery_ms": disc * 1e3}))
"""

_IDLE = r"""
import time
t0 = time.perf_counter()
import importlib.metadata as md
calls = []
real = md.entry_points
def counting(*a, **k):
    if k.get("group") == "quack.bundles":
        calls.append(1)
    return real(*a, **k)
md.entry_points = counting
import quack, quack.runtime.jit, quack_kernels.rmsnorm, quack_kernels.softmax
from quack import settings
settings.get()
t1 = time.perf_counter()
n_calls = len(calls)
from quack.bundles import tier
t2 = time.perf_counter()
bs = tier.discover(settings.get())
t3 = time.perf_counter()
import json
print(json.dumps({"import_s": t1 - t0, "discovery_calls_before_any_lookup": n_calls,
                  "discover_s": t3 - t2, "bundles": len(bs)}))
"""


def cli(*args, env=None):
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "quack_build", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env or os.environ.copy(),
        timeout=3600,
    )
    if r.returncode != 0:
        sys.exit(f"quack {' '.join(map(str, args))} failed:\n{r.stderr[-3000:]}")
    return r, time.perf_counter() - t0


def fresh_venv(d: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(d)], check=True, timeout=600)
    py = d / "bin" / "python"
    site_dir = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    ).stdout.strip()
    Path(site_dir, "_parent.pth").write_text(
        f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n"
    )
    return py


def run_json(py: Path, code: str, env: dict) -> dict:
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, env=env, cwd="/", timeout=600)
    if r.returncode != 0:
        sys.exit(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    from quack import settings

    cache = settings.resolve(cwd=ROOT).cache_dir
    work = Path(a.out or tempfile.mkdtemp(prefix="quack-bench-bundles-"))
    work.mkdir(parents=True, exist_ok=True)
    res: dict = {"cache": str(cache)}
    for label, mans in (
        ("default", ["manifests/default.toml"]),
        ("default+tests", ["manifests/default.toml", "manifests/tests.toml"]),
    ):
        r, wall = cli(
            "bundle",
            *mans,
            "--name",
            f"bench-{label.replace('+', '-')}",
            "-o",
            work / "dist",
            "--cache-dir",
            cache,
            "--json",
        )
        info = json.loads(r.stdout)
        res[f"bundle_{label}"] = {
            "entries": info["entries"],
            "objects_bytes": info["bytes"],
            "wheel_bytes": info["wheel_bytes"],
            "quack_bundle_wall_s": round(wall, 2),
            "build_step_s": info["build_s"],
        }
    wheel = next((work / "dist").glob("bench_default-*.whl"))
    with_b = fresh_venv(work / "with-bundle")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(with_b),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        check=True,
        timeout=600,
    )
    without = fresh_venv(work / "no-bundle")
    base = dict(os.environ, QUACK_MODE="prebuilt", QUACK_ARCH="sm_90a", CUDA_VISIBLE_DEVICES="")
    runs: dict = {"bundle": [], "local": []}
    loads: dict = {"bundle": [], "local": []}
    warm: dict = {"bundle": [], "local": []}
    for i in range(a.repeat):
        empty = work / f"empty-{i}"
        empty.mkdir(mode=0o700)
        b = run_json(with_b, _FIRST, dict(base, QUACK_CACHE_DIR=str(empty)))
        assert b["tier"].startswith("bundle:") and not b["compiles"] and not b["cutlass"], b
        runs["bundle"].append(b["first_kernel_s"])
        loads["bundle"].append(b["load_s"])
        shutil.rmtree(empty)
        loc = run_json(without, _FIRST, dict(base, QUACK_CACHE_DIR=str(cache)))
        assert loc["tier"] == "cache" and not loc["compiles"], loc
        runs["local"].append(loc["first_kernel_s"])
        loads["local"].append(loc["load_s"])
        empty.mkdir(mode=0o700)
        warm["bundle"].append(
            run_json(with_b, _FIRST_WARM, dict(base, QUACK_CACHE_DIR=str(empty)))["first_kernel_s"]
        )
        shutil.rmtree(empty)
        warm["local"].append(
            run_json(without, _FIRST_WARM, dict(base, QUACK_CACHE_DIR=str(cache)))["first_kernel_s"]
        )
    med = {k: statistics.median(v) for k, v in runs.items()}
    res["first_kernel_fresh_interpreter_ms"] = {
        "bundle_median": round(med["bundle"] * 1e3, 1),
        "local_cache_median": round(med["local"] * 1e3, 1),
        "difference": round((med["bundle"] - med["local"]) * 1e3, 1),
        "repeat": a.repeat,
        "paired_difference_median": round(
            statistics.median(b - lo for b, lo in zip(runs["bundle"], runs["local"])) * 1e3, 1
        ),
        "bundle_min": round(min(runs["bundle"]) * 1e3, 1),
        "local_cache_min": round(min(runs["local"]) * 1e3, 1),
        "runtime_preloaded_bundle_median": round(statistics.median(warm["bundle"]) * 1e3, 2),
        "runtime_preloaded_local_median": round(statistics.median(warm["local"]) * 1e3, 2),
        "tier_load_ms_bundle_median": round(statistics.median(loads["bundle"]) * 1e3, 2),
        "tier_load_ms_local_median": round(statistics.median(loads["local"]) * 1e3, 2),
        "bundle_all": [round(x * 1e3, 1) for x in runs["bundle"]],
        "local_all": [round(x * 1e3, 1) for x in runs["local"]],
    }
    pk = run_json(
        with_b,
        _PER_KEY.replace("sys.argv[1]", repr(str(ROOT / "manifests" / "default.toml"))),
        dict(base, QUACK_CACHE_DIR=str(cache)),
    )
    res["per_kernel_load_runtime_loaded_ms"] = {
        k: (round(v, 3) if isinstance(v, float) else v) for k, v in pk.items()
    }
    idle = {"with": [], "without": []}
    for _ in range(a.repeat):
        idle["with"].append(run_json(with_b, _IDLE, dict(base, QUACK_CACHE_DIR=str(cache))))
        idle["without"].append(run_json(without, _IDLE, dict(base, QUACK_CACHE_DIR=str(cache))))
    res["process_without_kernels"] = {
        "discovery_calls": sorted({x["discovery_calls_before_any_lookup"] for v in idle.values() for x in v}),
        "import_ms_with_bundle": round(statistics.median(x["import_s"] for x in idle["with"]) * 1e3, 1),
        "import_ms_without_bundle": round(statistics.median(x["import_s"] for x in idle["without"]) * 1e3, 1),
        "discovery_ms_at_first_bundle_lookup": round(
            statistics.median(x["discover_s"] for x in idle["with"]) * 1e3, 2
        ),
        "discovery_ms_no_bundle_installed": round(
            statistics.median(x["discover_s"] for x in idle["without"]) * 1e3, 2
        ),
    }
    print(json.dumps(res, indent=1))
    if a.out is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
