"""Remote cache figures (issue 11), on this machine, with a real local redis-server.

    python benchmarks/bench_remote.py [--jobs N] [--manifests M ...] [--json OUT]

Measures, side by side:
  1. cold build of the manifests with no remote (real compiles) vs a fresh cache
     building the same manifests from a warm local Redis (signed objects pulled,
     verified, published locally; zero compiles);
  2. per-entry pull latency: Redis GET alone, and the whole fetch (GET + signature
     + checks + the local store's atomic publish with fsync);
  3. the runtime's first call of a kernel in a process whose imports are warm:
     local hit vs local miss + remote hit;
  4. what a down remote costs a build: the pull phase against a refused port and
     against a socket that never answers (one time-out, then the remote is off).

Needs redis-server on PATH and the remote extra (pip install -e '.[remote]')."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from remote_services import free_port, redis_server, silent_socket  # noqa: E402

_VARS = (
    "QUACK_REMOTE",
    "QUACK_REMOTE_WRITE",
    "QUACK_SIGNING_KEY",
    "QUACK_TRUSTED_KEYS",
    "QUACK_MODE",
    "QUACK_REMOTE_TIMEOUT",
)


def env_for(cache: Path, remote=None, keydir=None, write=False, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _VARS}
    env["QUACK_CACHE_DIR"] = str(cache)
    if remote:
        env["QUACK_REMOTE"] = remote
        env["QUACK_TRUSTED_KEYS"] = str(keydir / "ci-1.pub")
    if write:
        env["QUACK_REMOTE_WRITE"] = "1"
        env["QUACK_SIGNING_KEY"] = str(keydir / "ci-1.key")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def quack_json(args, env) -> tuple[dict, float]:
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "quack_build", *args, "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"quack {' '.join(args)} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout), wall


RUNTIME = r"""
import json, sys, time
from quack import settings
from quack.runtime import jit
from quack_build.cli.context import load_kernels
from quack_build.manifest.read import expand
s = settings.get()
load_kernels(s)
configs = expand({manifests!r}, archs=("sm_90a",)).configs[:{n} + 1]
by_name = {{k.spec.name: k for k in jit._ALL}}
def call(c):
    t = time.perf_counter()
    by_name[c.kernel](**c.params)
    return time.perf_counter() - t
call(configs[0])  # pays the one-time imports (tvm-ffi, the runtime) in both cases
print(json.dumps([call(c) for c in configs[1:]]))
"""


def runtime_first_calls(cache: Path, env: dict, manifests, n: int) -> list[float]:
    code = RUNTIME.format(manifests=[str(m) for m in manifests], n=n)
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**env, "QUACK_MODE": "prebuilt"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    if r.returncode != 0:
        sys.exit(f"runtime measurement failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def ms(v: float) -> str:
    return f"{v * 1e3:.2f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--manifests", nargs="+", default=["manifests/default.toml", "manifests/tests.toml"])
    ap.add_argument("--runtime-keys", type=int, default=10)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from quack import settings, signing
    from quack.cache.store import DiskStore
    from quack.remote import objects, tier
    from quack.remote.backend import open_backend
    from quack.runtime import tiers

    out: dict = {"manifests": args.manifests, "jobs": args.jobs}
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as td:
        td = Path(td)
        keydir = td / "keys"
        signing.write_keypair("ci-1", keydir)
        with redis_server(td / "redis") as srv:
            url = srv.url
            # 1. cold build, then push; a fresh cache pulls everything.
            cold, cold_wall = quack_json(
                ["build", *args.manifests, "-j", str(args.jobs)], env_for(td / "cold")
            )
            push, push_wall = quack_json(
                ["cache", "push", *args.manifests], env_for(td / "cold", url, keydir, write=True)
            )
            warm, warm_wall = quack_json(
                ["build", *args.manifests, "-j", str(args.jobs)], env_for(td / "warm", url, keydir)
            )
            assert warm["compiled"] == 0 and warm["remote_hits"] == cold["total"], warm
            out["build"] = {
                "configs": cold["total"],
                "cold_compile_wall_s": round(cold_wall, 2),
                "push_wall_s": round(push_wall, 2),
                "pulled": warm["remote_hits"],
                "warm_pull_wall_s": round(warm_wall, 2),
                "speedup": round(cold_wall / warm_wall, 1),
            }
            # 2. per-entry latency, in this process.
            backend = open_backend(url)
            names = sorted(n.decode() for n in srv.client().keys("quack/v1/*"))
            sizes, gets = [], []
            for n in names:
                t = time.perf_counter()
                b = backend.get(n)
                gets.append(time.perf_counter() - t)
                sizes.append(len(b))
            s = settings.resolve(env=env_for(td / "lat", url, keydir))
            remote = tier.from_settings(s)
            store = DiskStore(td / "lat", fsync=True)
            from quack.cache.entry import EntryRef

            fetches = []
            for n in names:
                _, _, stamp, kernel, srcfp, key = n.split("/")
                ref = EntryRef(kernel, key, stamp.rsplit("-", 1)[1], srcfp)
                t = time.perf_counter()
                e = tiers.fetch_into(store, ref, (remote,))[0]
                fetches.append(time.perf_counter() - t)
                assert e is not None, n
            # The same without fsync (QUACK_FSYNC=0): what the network + verification cost alone.
            store_nf = DiskStore(td / "lat-nofsync", fsync=False)
            fetches_nf = []
            for n in names:
                _, _, stamp, kernel, srcfp, key = n.split("/")
                ref = EntryRef(kernel, key, stamp.rsplit("-", 1)[1], srcfp)
                t = time.perf_counter()
                assert tiers.fetch_into(store_nf, ref, (remote,))[0] is not None
                fetches_nf.append(time.perf_counter() - t)
            # A ~100 KB object (the issue's yardstick; the manifests' objects are smaller).
            signer = signing.load_signing_key(keydir / "ci-1.key")
            synth = {"get": [], "fsync": [], "nofsync": []}
            for i in range(50):
                ref = EntryRef("bench_obj", f"{i:064x}", "sm_90a", "0" * 16)
                backend_w = open_backend(url)
                backend_w.put_if_absent(
                    objects.object_name(ref), objects.pack(ref, {}, os.urandom(100_000), signer)
                )
                t = time.perf_counter()
                backend.get(objects.object_name(ref))
                synth["get"].append(time.perf_counter() - t)
                for label, st in (("fsync", store), ("nofsync", store_nf)):
                    t = time.perf_counter()
                    assert tiers.fetch_into(st, ref, (remote,))[0] is not None
                    synth[label].append(time.perf_counter() - t)
            near_100k = [f for f, z in zip(fetches, sizes) if 50_000 <= z <= 200_000]
            out["pull_latency"] = {
                "objects": len(names),
                "median_object_bytes": int(statistics.median(sizes)),
                "get_median_ms": round(statistics.median(gets) * 1e3, 3),
                "fetch_median_ms": round(statistics.median(fetches) * 1e3, 3),
                "fetch_p90_ms": round(sorted(fetches)[int(len(fetches) * 0.9)] * 1e3, 3),
                "fetch_nofsync_median_ms": round(statistics.median(fetches_nf) * 1e3, 3),
                "max_object_bytes": max(sizes),
                "synthetic_100KB_ms": {k: round(statistics.median(v) * 1e3, 3) for k, v in synth.items()},
                "fetch_median_ms_50_200KB": round(statistics.median(near_100k) * 1e3, 3)
                if near_100k
                else None,
                "n_50_200KB": len(near_100k),
            }
            # 3. runtime first call: local hit (the warm cache) vs local miss + remote hit.
            local = runtime_first_calls(
                td / "warm", env_for(td / "warm"), args.manifests[:1], args.runtime_keys
            )
            fresh = runtime_first_calls(
                td / "rt", env_for(td / "rt", url, keydir), args.manifests[:1], args.runtime_keys
            )
            out["runtime_first_call"] = {
                "keys": len(local),
                "local_hit_median_ms": round(statistics.median(local) * 1e3, 3),
                "remote_hit_median_ms": round(statistics.median(fresh) * 1e3, 3),
            }
        # 4. a down remote, over every configuration's pull (all local misses).
        from quack_build.build import plan as planning
        from quack_build.build import remote as remote_sync
        from quack_build.cli.context import load_kernels
        from quack_build.manifest.read import expand

        load_kernels(settings.resolve(env=env_for(td / "x")))
        configs = expand([ROOT / m for m in args.manifests], archs=("sm_90a",)).configs

        def pull_phase(u: str, where: str) -> float:
            tier.reset_offline_for_tests()
            store = DiskStore(td / where, fsync=True)
            remote = tier.from_settings(settings.resolve(env=env_for(td / where, u, keydir)))
            tasks = planning.plan(configs, store)
            t = time.perf_counter()
            remote_sync.pull(tasks, store, remote)
            return round(time.perf_counter() - t, 3)

        down = {"refused": pull_phase(f"redis://127.0.0.1:{free_port()}/0", "down-refused")}
        with silent_socket() as port:
            down["hung (accepts, never answers)"] = pull_phase(f"redis://127.0.0.1:{port}/0", "down-hung")
        out["down_remote_pull_phase_s"] = {"configs": len(configs), **down}
    b, p, r = out["build"], out["pull_latency"], out["runtime_first_call"]
    print(f"manifests {' '.join(args.manifests)}: {b['configs']} configurations, {args.jobs} jobs")
    print(f"  cold build, no remote            {b['cold_compile_wall_s']:8.2f} s")
    print(
        f"  fresh cache, pull from Redis     {b['warm_pull_wall_s']:8.2f} s   ({b['speedup']}x faster; "
        f"{b['pulled']} pulled, 0 compiled)"
    )
    print(f"  push of the cold build           {b['push_wall_s']:8.2f} s")
    print(
        f"per entry ({p['objects']} objects, median {p['median_object_bytes'] / 1e3:.0f} KB): GET "
        f"{p['get_median_ms']} ms median; fetch (GET+verify+publish) {p['fetch_median_ms']} ms median, "
        f"p90 {p['fetch_p90_ms']} ms; without fsync {p['fetch_nofsync_median_ms']} ms median; "
        f"50-200 KB objects: {p['fetch_median_ms_50_200KB']} ms (n={p['n_50_200KB']}); "
        f"largest {p['max_object_bytes'] / 1e3:.0f} KB"
    )
    sy = p["synthetic_100KB_ms"]
    print(
        f"  a 100 KB object (50 runs, medians): GET {sy['get']} ms; fetch {sy['fsync']} ms with fsync, "
        f"{sy['nofsync']} ms without"
    )
    print(
        f"runtime first call (imports warm, {r['keys']} keys): local hit {r['local_hit_median_ms']} ms, "
        f"local miss + remote hit {r['remote_hit_median_ms']} ms (medians)"
    )
    d = out["down_remote_pull_phase_s"]
    print(
        f"down remote, pull phase over {d['configs']} local misses: "
        + ", ".join(f"{k} {v} s" for k, v in d.items() if k != "configs")
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
