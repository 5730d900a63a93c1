"""Ray executor vs the local forkserver pool, at the same worker count.

    python benchmarks/bench_ray.py [--jobs 2] [--manifest manifests/default.toml ...] [--json out.json]

Builds the manifests twice into fresh private caches: once through the local pool
(``--jobs`` workers), once through ``--jobs`` Ray actors on a local cluster this
script starts (``ray.cluster_utils.Cluster``, 127.0.0.1 only). Reports:

* cluster start-up (head node up), executor start-up (connect + ship code + actors
  warm: compiler import and the warm-up compile), local pool start-up;
* keys/s in the compile phase (first compile start .. last publish) for both;
* Ray overhead per key: dispatch -> result back, minus the actor's own compile wall
  time (transport + queueing), plus the coordinator's verify + publish time; and the
  coordinator's CPU seconds per key (what one coordinator can sustain);
* objects bit-identical between the two builds (SHA-256);
* a projection of a 5,000-configuration build on 1, 4 and 16 nodes of 16 cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The bench's cluster listens on 127.0.0.1 only; without this Ray rewrites a loopback
# address to the host's outward IP when connecting (before ray is imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
sys.path.insert(0, str(ROOT))


def _build(executor_name: str, manifests, jobs: int, cache: Path, address: str = ""):
    from quack import settings as qs
    from quack.cache.store import DiskStore
    from quack_build.build import plan as planning
    from quack_build.build import scheduler
    from quack_build.build.executors.local import LocalExecutor
    from quack_build.build.executors.ray.executor import RayExecutor
    from quack_build.cli.context import load_kernels
    from quack_build.manifest.read import expand

    s = qs.resolve({"cache_dir": str(cache), "jobs": jobs, "fsync": True})
    qs.set_current(s)
    load_kernels(s)
    exp = expand([Path(m) for m in manifests], archs=s.build_archs())
    store = DiskStore(s.cache_dir, fsync=s.fsync, lock_timeout=s.lock_timeout)
    tasks = planning.plan(exp.configs, store)
    ex = (
        LocalExecutor(jobs, settings=s)
        if executor_name == "local"
        else RayExecutor(address, jobs=jobs, settings=s, store=store)
    )
    cpu0, t0 = time.process_time(), time.perf_counter()
    res = scheduler.BuildSession(
        tasks, store, scheduler.BuildOptions(jobs=jobs, settings=s, executor=ex)
    ).run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    assert res.ok, [t.error for t in res.tasks if t.error][:3]
    return res, ex, wall, cpu


def _digests(cache: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in cache.glob("v1/*/*/*/*.o")}


def _phase_local(manifests, jobs: int, tmp: Path) -> dict:
    res_l, ex_l, wall_l, cpu_l = _build("local", manifests, jobs, tmp / "local")
    n = res_l.count("compiled")
    return {
        "keys": n,
        "wall_s": round(wall_l, 2),
        "start_s": round(res_l.pool_start_s, 2),
        "compile_wall_s": round(res_l.compile_wall_s, 2),
        "keys_per_s": round(n / res_l.compile_wall_s, 3),
        "coordinator_cpu_ms_per_key": round(1000 * cpu_l / n, 2),
        "mean_compile_s": round(res_l.compile_s / n, 3),
    }


def _phase_ray(manifests, jobs: int, tmp: Path) -> dict:
    from ray.cluster_utils import Cluster

    t0 = time.perf_counter()
    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={"num_cpus": jobs, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    cluster_up = time.perf_counter() - t0
    try:
        res_r, ex_r, wall_r, cpu_r = _build("ray", manifests, jobs, tmp / "ray", cluster.address)
    finally:
        cluster.shutdown()
    st = ex_r.stats()
    nr = res_r.count("compiled")
    transport = (st["roundtrip_s"] - st["actor_compile_wall_s"]) / nr
    publish = st["publish_s"] / nr
    cpu_phase = st.get("coordinator_cpu_s") or cpu_r
    return {
        "keys": nr,
        "wall_s": round(wall_r, 2),
        "cluster_start_s": round(cluster_up, 2),
        "executor_start_s": st["start_s"],
        "actor_warm_s": st["warm_s"],
        "compile_wall_s": round(res_r.compile_wall_s, 2),
        "keys_per_s": round(nr / res_r.compile_wall_s, 3),
        # on an actor's critical path: dispatch -> result back, minus its compile
        "overhead_ms_per_key": round(1000 * transport, 2),
        # off it (publisher threads): verify, lock, write, fsync, .so
        "publish_ms_per_key": round(1000 * publish, 2),
        "publish_threads": st["publish_threads"],
        "coordinator_cpu_ms_per_key": round(1000 * cpu_phase / nr, 2),
        "coordinator_cpu_ms_per_key_incl_start": round(1000 * cpu_r / nr, 2),
        "mean_compile_s": round(res_r.compile_s / nr, 3),
        "retries": st["retries"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--manifest", action="append", default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--ray-first", action="store_true", help="Run the Ray build before the local one.")
    a = ap.parse_args()
    manifests = a.manifest or [str(ROOT / "manifests" / "default.toml")]
    os.chdir(ROOT)
    out: dict = {"jobs": a.jobs, "manifests": manifests, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        tmp = Path(tmp)
        # The machine may be shared: each phase records the load average around it, and
        # --ray-first swaps the order (to see whether a difference follows the order).
        for phase in ("ray", "local") if a.ray_first else ("local", "ray"):
            load0 = os.getloadavg()[0]
            out[phase] = (_phase_local if phase == "local" else _phase_ray)(manifests, a.jobs, tmp)
            out[phase]["load_avg_before_after"] = [round(load0, 1), round(os.getloadavg()[0], 1)]
        dl, dr = _digests(tmp / "local"), _digests(tmp / "ray")
        out["bit_identical"] = bool(dl) and dl == dr
    out["ray_vs_local_throughput"] = round(out["ray"]["keys_per_s"] / out["local"]["keys_per_s"], 3)
    out["projection_5000"] = project(out)
    out["projection_5000_gpu_host_compile"] = project(out, compile_s=1.13)
    print(json.dumps(out, indent=1))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0 if out["bit_identical"] else 1


def project(out: dict, n_keys: int = 5000, cores: int = 16, compile_s: float | None = None) -> dict:
    """Build time of ``n_keys`` on 1/4/16 nodes of ``cores``. The workers run keys at
    (mean compile + critical-path overhead) each; the one coordinator serves results at
    max(its CPU per key, publish wall time / publisher threads). The slower side bounds
    the compile phase. ``compile_s``: per-key compile time to assume (default: measured
    here; the GPU host's cores measured ~1.1 s·worker per key: 198 keys, 14 s at 16)."""
    r = out["ray"]
    c = r["mean_compile_s"] if compile_s is None else compile_s
    per_key = c + r["overhead_ms_per_key"] / 1000
    coord = max(r["coordinator_cpu_ms_per_key"], r["publish_ms_per_key"] / r["publish_threads"]) / 1000
    start = r["executor_start_s"]
    rows = {"assumed_compile_s_per_key": c}
    for nodes in (1, 4, 16):
        workers = nodes * cores
        t_workers = n_keys * per_key / workers
        t_coord = n_keys * coord
        rows[f"{nodes}x{cores}"] = {
            "workers": workers,
            "compile_phase_s": round(max(t_workers, t_coord), 1),
            "total_s": round(start + max(t_workers, t_coord), 1),
            "bound_by": "workers" if t_workers >= t_coord else "coordinator",
        }
    rows["coordinator_limit_keys_per_s"] = round(1 / coord, 1) if coord > 0 else None
    return rows


if __name__ == "__main__":
    sys.exit(main())
