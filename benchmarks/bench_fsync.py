"""What fsync costs a build (issue 6, durability).

    python benchmarks/bench_fsync.py [--n 200] [--dir DIR] [--obj PATH]

A publish is: O_EXCL temp, write, fsync it, rename, fsync the directory; then the
metadata the same way (docs/cache-layout.md). This publishes a real toy_scale .o (compiled
once for sm_90a unless --obj is given) N times into a fresh cache under DIR (default:
beside the default cache, i.e. the same file system) with fsync on and off, interleaved,
and prints the per-publish cost next to the kernel's compile time. Settings:
QUACK_FSYNC=0 or ``[cache] fsync = false`` in quack.toml turn it off.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def compile_obj(dest: Path) -> tuple[Path, float]:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import toykernels  # noqa: F401

    from quack import registry
    from quack.compile import builder

    spec = registry.get("toy_scale")
    params = spec.bind((), {"dtype": "float32", "block": 128, "bias": False})
    out = dest / "toy.o"
    builder.compile_to(spec, params, "sm_90a", out)  # warm-up: imports cutlass
    t = time.perf_counter()
    builder.compile_to(spec, params, "sm_90a", out)
    return out, time.perf_counter() - t


def publish_many(root: Path, data: bytes, n: int, fsync: bool, offset: int) -> list[float]:
    from quack.cache.store import DiskStore, EntryRef

    store = DiskStore(root, fsync=fsync)
    out = []
    for i in range(n):
        ref = EntryRef(
            "toy_scale", hashlib.sha256(b"bench%d" % (i + offset)).hexdigest(), "sm_90a", "0123456789abcdef"
        )
        t = time.perf_counter()
        with store.lock(ref):
            tmp = store.tmp_obj(ref)
            with open(tmp, "wb") as f:
                f.write(data)
            store.publish(ref, tmp, {"compile_s": 0.0})
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--obj", type=Path, default=None)
    a = ap.parse_args()
    from quack import settings

    base = a.dir or settings.default_cache_dir().parent
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="quack-bench-fsync-", dir=base))
    try:
        os.chmod(work, 0o700)
        if a.obj:
            obj, compile_s = a.obj, None
        else:
            obj, compile_s = compile_obj(work)
        data = obj.read_bytes()
        on, off = [], []
        for rnd in range(4):  # interleave so drift hits both alike
            on += publish_many(work / "on", data, a.n // 4, True, rnd * a.n)
            off += publish_many(work / "off", data, a.n // 4, False, rnd * a.n)
        med_on, med_off = statistics.median(on), statistics.median(off)
        p90_on = sorted(on)[int(len(on) * 0.9)]
        fs = os.popen(f"df -T {work} | tail -1").read().split()
        print(
            f"file system: {fs[1] if len(fs) > 1 else '?'} at {work}  object: {len(data)} bytes  "
            f"publishes: {len(on)} + {len(off)}"
        )
        print(f"{'':24}{'median ms':>10}{'p90 ms':>10}{'mean ms':>10}")
        print(
            f"{'publish, fsync on':24}{med_on * 1e3:10.3f}{p90_on * 1e3:10.3f}{statistics.mean(on) * 1e3:10.3f}"
        )
        print(
            f"{'publish, fsync off':24}{med_off * 1e3:10.3f}{sorted(off)[int(len(off) * 0.9)] * 1e3:10.3f}"
            f"{statistics.mean(off) * 1e3:10.3f}"
        )
        delta = statistics.mean(on) - statistics.mean(off)
        print(f"fsync adds {delta * 1e3:.3f} ms per published entry (mean)")
        if compile_s:
            print(
                f"toy_scale compile (warm, sm_90a): {compile_s * 1e3:.0f} ms -> fsync is "
                f"{100 * delta / compile_s:.2f} % of one of the cheapest compiles"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
