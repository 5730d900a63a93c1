"""Benchmark `quack build` and `quack cache stats`.

    python benchmarks/bench_build.py                      # toy kernels, --jobs 1 2
    python benchmarks/bench_build.py --jobs 1 4 8 16 --manifest manifests/default.toml --packages kernels

Measures, each in a fresh cache and a fresh `quack build` process:

1. build throughput (keys/s over the compile phase, i.e. after the one-time
   forkserver start-up, which is reported apart) and parallel efficiency at
   each job count: rate(N) / (N x rate(1)), against the steady serial rate;
2. scheduler overhead per key: a `quack build` of an all-cached manifest of
   --overhead-keys keys (synthetic valid entries), wall time / keys;
3. `quack cache stats` wall time (whole process, the table and --json) on a synthetic
   cache of --stats-entries entries.

    python benchmarks/bench_build.py --jobs 1 --manifest benchmarks/one_config.toml \
        --packages quack_kernels --skip overhead stats

builds one real configuration from an empty cache: "start s" is the worker start-up
(forkserver import + warm-up compile), "process s" the whole `quack build` process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"

TOY_MANIFEST = """
[[kernel]]
name = "toy_scale"
archs = ["sm_90a"]
params = {{ dtype = ["float32", "float16", "bfloat16"], block = {blocks}, bias = [true, false] }}
"""


def _env(cache: Path) -> dict:
    env = dict(os.environ)
    env["QUACK_CACHE_DIR"] = str(cache)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(TESTS), env.get("PYTHONPATH", "")) if p)
    return env


def _project(d: Path, packages: list[str], manifest: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    pk = ", ".join(f'"{p}"' for p in packages)
    (d / "quack.toml").write_text(
        f'[build]\nkernel_packages = [{pk}]\nmanifests = ["{manifest}"]\n[runtime]\narch = "sm_90a"\n'
    )
    return d


def _quack(args: list[str], proj: Path, cache: Path) -> tuple[dict, float, str]:
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "quack_build.cli.main", *args],
        cwd=proj,
        env=_env(cache),
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"quack {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}\n{r.stdout[-2000:]}")
    return json.loads(r.stdout), wall, r.stderr


def bench_jobs(proj: Path, work: Path, jobs_list: list[int]) -> list[dict]:
    rows = []
    for j in jobs_list:
        cache = work / f"cache-j{j}"
        res, wall, _ = _quack(["build", "--jobs", str(j), "--json"], proj, cache)
        rows.append(
            {
                "jobs": j,
                "keys": res["compiled"],
                "process_s": wall,
                "pool_start_s": res["pool_start_s"],
                "compile_wall_s": res["compile_wall_s"],
                "compile_s": res["compile_s"],
                "keys_per_s": res["keys_per_s"] or 0.0,
                "busy_eff": res["efficiency"] or 0.0,
            }
        )
    base = next((r for r in rows if r["jobs"] == 1), None)
    for r in rows:
        r["eff_vs_serial"] = (
            (r["keys_per_s"] / (r["jobs"] * base["keys_per_s"])) if base and base["keys_per_s"] else None
        )
    return rows


def _fake_entries(cache: Path, configs, rng_size: int = 12000) -> None:
    """Valid-looking entries (metadata names the key, size and SHA-256 match) for configs."""
    for c in configs:
        from quack.cache.store import DiskStore
        from quack.compile import builder

        store = DiskStore(cache, fsync=False)
        ref = builder.entry_ref(c.spec, c.params, c.arch)
        p = store.paths(ref)
        p["obj"].parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        data = hashlib.sha256(c.key.encode()).digest() * (rng_size // 32)
        p["obj"].write_bytes(data)
        meta = {
            "format": 1,
            "key": c.key,
            "kernel": c.kernel,
            "arch": c.arch,
            "stamp": ref.stamp,
            "srcfp": ref.srcfp,
            "params": c.plain_params,
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "compile_s": 0.3,
            "created": time.time(),
        }
        p["meta"].write_text(json.dumps(meta, sort_keys=True, indent=1))


def bench_overhead(work: Path, n_keys: int) -> dict:
    """An all-cached build of n_keys toy_scale configurations: scheduler cost per key."""
    sys.path[:0] = [str(ROOT), str(TESTS)]
    import toykernels  # noqa: F401

    from quack_build.manifest.read import expand

    n_blocks = max(1, min(993, -(-n_keys // 6)))
    blocks = list(range(32, 32 + n_blocks))
    man = work / "overhead.toml"
    man.write_text(TOY_MANIFEST.format(blocks=blocks))
    proj = _project(work / "proj-overhead", ["toykernels"], man)
    cache = work / "cache-overhead"
    configs = expand([man]).configs
    _fake_entries(cache, configs)
    res, wall, _ = _quack(["build", "--json"], proj, cache)
    assert res["cached"] == len(configs), res
    # The same process with nothing to do but start up (an empty-ish manifest: 1 key).
    one = work / "one.toml"
    one.write_text(
        TOY_MANIFEST.format(blocks=[32])
        .replace('["float32", "float16", "bfloat16"]', '"float32"')
        .replace("[true, false]", "false")
    )
    res1, wall1, _ = _quack(["build", "--json", str(one)], proj, cache)
    return {
        "keys": len(configs),
        "process_s": wall,
        "internal_s": res["wall_s"],
        "per_key_ms": 1000 * res["wall_s"] / len(configs),
        "per_key_ms_process": 1000 * (wall - wall1) / max(1, len(configs) - 1),
        "startup_s": wall1,
    }


def bench_stats(work: Path, n: int) -> dict:
    sys.path[:0] = [str(ROOT), str(TESTS)]
    import toykernels  # noqa: F401

    from quack import registry
    from quack.cache import keys

    cache = work / "cache-stats"
    fp = registry.get("toy_scale").source_fingerprint()
    kernels = [("toy_scale", fp), ("toy_scale", "0" * 16), ("other_a", "1" * 16), ("other_b", "2" * 16)]
    for i in range(n):
        kernel, srcfp = kernels[i % len(kernels)]
        d = cache / "v1" / keys.toolchain_stamp("sm_90a") / kernel / srcfp
        if i < len(kernels):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
        k = hashlib.sha256(str(i).encode()).hexdigest()
        (d / f"{k}.o").write_bytes(b"o" * 1000)
        (d / f"{k}.json").write_text('{"format": 1}')
        (d / f"{k}.so").write_bytes(b"s" * 500)
        (d / f"{k}.so.json").write_text("{}")
        (d / f"{k}.lock").write_bytes(b"")
    proj = _project(work / "proj-stats", ["toykernels"], work / "none.toml")
    times, table = [], []
    for _ in range(5):
        res, wall, _ = _quack(["cache", "stats", "--json"], proj, cache)
        assert res["totals"]["entries"] == n, res["totals"]
        times.append(wall)
        # The table a user reads (rich, not the JSON): what issue 24 timed.
        t0 = time.perf_counter()
        r = subprocess.run(
            [sys.executable, "-m", "quack_build", "cache", "stats"],
            cwd=proj,
            env=_env(cache),
            capture_output=True,
            text=True,
        )
        table.append(time.perf_counter() - t0)
        assert r.returncode == 0 and f"{n} entries" in r.stdout, r.stderr[-2000:]
    from quack_build.cachedir import stats as cachestats

    t0 = time.perf_counter()
    cachestats.summarize(cache, {"toy_scale": fp})
    walk_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    py_s = time.perf_counter() - t0
    return {
        "entries": n,
        "process_s": statistics.median(times),
        "table_process_s": statistics.median(table),
        "walk_s": walk_s,
        "python_startup_s": py_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--jobs", type=int, nargs="+", default=[1, 2], help="job counts (include 1 for efficiency)"
    )
    ap.add_argument("--manifest", type=Path, help="manifest to build (default: toy_scale keys)")
    ap.add_argument(
        "--packages",
        nargs="+",
        default=None,
        help="kernel packages (default: toykernels, or kernels when --manifest is given)",
    )
    ap.add_argument(
        "--toy-keys", type=int, default=24, help="toy_scale keys when no --manifest (multiple of 6)"
    )
    ap.add_argument("--overhead-keys", type=int, default=3000)
    ap.add_argument("--stats-entries", type=int, default=10000)
    ap.add_argument("--skip", nargs="*", default=[], choices=["jobs", "overhead", "stats"])
    ap.add_argument("--json", action="store_true", help="print the results as JSON too")
    a = ap.parse_args()
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="quack-bench-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o700)
        if "jobs" not in a.skip:
            if a.manifest:
                man = a.manifest.resolve()
                packages = a.packages or ["quack_kernels"]
            else:
                n_blocks = max(1, a.toy_keys // 6)
                man = work / "toy.toml"
                man.write_text(TOY_MANIFEST.format(blocks=[32 * (i + 1) for i in range(n_blocks)]))
                packages = a.packages or ["toykernels"]
            proj = _project(work / "proj", packages, man)
            rows = bench_jobs(proj, work, a.jobs)
            out["jobs"] = rows
            print(f"\nbuild throughput ({man.name}, {rows[0]['keys']} keys, {os.cpu_count()} CPUs)")
            print(
                f"{'jobs':>5} {'keys':>5} {'start s':>8} {'compile s':>10} {'keys/s':>8} {'eff vs serial':>14} "
                f"{'busy eff':>9} {'process s':>10}"
            )
            for r in rows:
                e = f"{r['eff_vs_serial'] * 100:.0f}%" if r["eff_vs_serial"] is not None else "-"
                print(
                    f"{r['jobs']:>5} {r['keys']:>5} {r['pool_start_s']:>8.2f} {r['compile_wall_s']:>10.2f} "
                    f"{r['keys_per_s']:>8.2f} {e:>14} {r['busy_eff'] * 100:>8.0f}% {r['process_s']:>10.2f}"
                )
        if "overhead" not in a.skip:
            o = bench_overhead(work, a.overhead_keys)
            out["overhead"] = o
            print(
                f"\nscheduler overhead: all-cached build of {o['keys']} keys: {o['internal_s']:.3f} s inside "
                f"quack build = {o['per_key_ms']:.3f} ms/key (process {o['process_s']:.2f} s, of which start-up "
                f"{o['startup_s']:.2f} s; {o['per_key_ms_process']:.3f} ms/key by difference)"
            )
        if "stats" not in a.skip:
            s = bench_stats(work, a.stats_entries)
            out["stats"] = s
            print(
                f"\nquack cache stats on {s['entries']} entries, whole process, median of 5: table "
                f"{s['table_process_s']:.3f} s, --json {s['process_s']:.3f} s (directory walk "
                f"{s['walk_s']:.3f} s; bare python start-up {s['python_startup_s']:.3f} s)"
            )
    if a.json:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
