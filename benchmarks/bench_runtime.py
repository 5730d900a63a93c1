"""Runtime cache figures (issue 2): hit overhead, disk load, cold start.

    python benchmarks/bench_runtime.py [--keys 8] [--cache DIR]

Prints a table. Compiles --keys toy kernels into a private cache first (through
the compile workers), then measures in fresh processes, side by side:
  - warm in-memory hit: @jit_cache call vs a bare dict lookup (ns/call)
  - disk load of a prebuilt kernel: first in a process, and each later one
    (quack's .so path vs CuTe DSL's cute.runtime.load_module on the same .o)
  - fresh interpreter -> loaded prebuilt kernel (import torch included, as in a real run)
"""

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

BLOCKS = [32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448, 480, 512]

_MEASURE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t_torch = time.perf_counter()
sys.path.insert(0, {tests!r})
import toykernels
from quack.runtime import jit
blocks = {blocks!r}
loads = []
for b in blocks:
    t = time.perf_counter()
    toykernels.toy_scale("bfloat16", b, False)
    loads.append(time.perf_counter() - t)
t_all = time.perf_counter()
fn = toykernels.toy_scale
d = {{("bfloat16", 32, False): fn("bfloat16", 32, False)}}
N = 200000
args = ("bfloat16", 32, False)
t = time.perf_counter()
for _ in range(N):
    fn(*args)
t_hit = (time.perf_counter() - t) / N
t = time.perf_counter()
for _ in range(N):
    d[args]
t_dict = (time.perf_counter() - t) / N
print(json.dumps({{"import_torch": t_torch - t0, "first_to_loaded": t0 and (loads[0] + (t_torch - t0)),
                  "loads": loads, "hit": t_hit, "dict": t_dict,
                  "how": [u["how"] for u in toykernels.toy_scale.usage()][:1],
                  "cute_imported": "cutlass.cute" in sys.modules}}))
"""

_CUTE_LOAD = r"""
import json, sys, time, glob
import torch
objs = sorted(glob.glob({pattern!r}, recursive=True))
import cutlass.cute as cute
loads = []
for o in objs:
    t = time.perf_counter()
    m = cute.runtime.load_module(o, enable_tvm_ffi=True)
    m["func"]
    loads.append(time.perf_counter() - t)
print(json.dumps({{"loads": loads}}))
"""


def run(code: str, env: dict) -> dict:
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        sys.exit(r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=8)
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    cache = a.cache or Path(tempfile.mkdtemp(prefix="quack-bench-")) / "cache"
    blocks = BLOCKS[: a.keys]
    env = dict(
        os.environ,
        QUACK_CACHE_DIR=str(cache),
        QUACK_ARCH=os.environ.get("QUACK_ARCH", "sm_90a"),
        PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    t = time.perf_counter()
    from quack import settings

    settings.set_current(settings.resolve({"cache_dir": str(cache), "arch": env["QUACK_ARCH"]}))
    import toykernels

    for b in blocks:
        toykernels.toy_scale("bfloat16", b, False)
    print(f"# filled {len(blocks)} keys in {time.perf_counter() - t:.1f} s into {cache}")
    env_pre = dict(env, QUACK_MODE="prebuilt")
    q = [run(_MEASURE.format(tests=str(ROOT / "tests"), blocks=blocks), env_pre) for _ in range(a.repeat)]
    c = [
        run(_CUTE_LOAD.format(pattern=str(cache / "v1" / "**" / "toy_scale" / "*" / "*.o")), env)
        for _ in range(a.repeat)
    ]
    med = statistics.median

    def ms(x):
        return f"{x * 1e3:8.3f} ms"

    rows = [
        ("hit: @jit_cache call", f"{med(r['hit'] for r in q) * 1e9:8.0f} ns"),
        ("hit: bare dict lookup", f"{med(r['dict'] for r in q) * 1e9:8.0f} ns"),
        ("hit overhead above dict", f"{med(r['hit'] - r['dict'] for r in q) * 1e9:8.0f} ns"),
        ("load first in process (quack .so)", ms(med(r["loads"][0] for r in q))),
        ("load later, median (quack .so)", ms(med(med(r["loads"][1:]) for r in q))),
        ("load first in process (cute load_module)", ms(med(r["loads"][0] for r in c))),
        ("load later, median (cute load_module)", ms(med(med(r["loads"][1:]) for r in c))),
        ("import torch (fresh interpreter)", ms(med(r["import_torch"] for r in q))),
        ("fresh interpreter -> loaded kernel", ms(med(r["first_to_loaded"] for r in q))),
    ]
    print(f"{'measure':45s} {'median of ' + str(a.repeat):>12s}")
    for name, v in rows:
        print(f"{name:45s} {v:>12s}")
    print(f"# loaded via {q[0]['how']}; cutlass.cute imported by the quack path: {q[0]['cute_imported']}")


if __name__ == "__main__":
    main()
