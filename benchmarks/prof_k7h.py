"""Issue 14 part 6, round 7 (engineer H): measure before tuning. The mixed-precision norm
misses at 4096x262144 (bf16 x, fp32 weight (+ bias) vs the same-dtype kernel) side by side,
and one launch of each under Nsight Compute.

Kernels (``.raw`` compiles with the modules' ``_TUNE`` knobs, ``benchmarks/tune_k2.py``'s
machinery): LayerNorm same-dtype ``xs mb3`` (the default), fp32 w + b ``xs2 mb3`` (the
default), the fp32 ring (w AND b in shared memory, clusters of 16, 7 clusters), and two
controls that separate the two-row structure from the fp32 loads: same-dtype ``xs2 mb3`` and
fp32 ``xs mb3`` (one row a CTA); RMSNorm same-dtype x-in-shared-memory (default) and the
fp32 ring (default). Plus ``ln 4096`` (32768x4096, both defaults) for the re-measure.

    python benchmarks/prof_k7h.py --compile            # compile every variant (workdir)
    python benchmarks/prof_k7h.py --time [--groups g]  # interleaved timing, one process
    ncu ... python benchmarks/prof_k7h.py --profile    # one launch each, between
                                                       # cudaProfilerStart / Stop
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.tune_k2 import V, compile_all, compile_key, load, ring_grid_of, time_groups  # noqa: E402

W32 = "float32"
M, N = 4096, 262144
XS1 = {"row_cta": False, "ring": False, "stage_wb": False, "x_smem": True, "x_smem_cluster": True}


def variants(extra=()):
    g = "p262144"
    out = [
        V(g, "ln same xs mb3", "ln_fwd", M, N, "same", {}),
        V(g, "ln w32 xs2 mb3", "ln_fwd", M, N, W32, {}),
        V(g, "ln w32 ring", "ln_fwd", M, N, W32, {"row_cta": False}, "api"),
        V(g, "ln same xs2 mb3", "ln_fwd", M, N, "same", XS1 | {"x_rows": 2, "x_min_blocks": 3}),
        V(g, "ln w32 xs mb3", "ln_fwd", M, N, W32, XS1 | {"x_min_blocks": 3}),
        V(g, "rms same xs", "rms_fwd", M, N, "same", {}),
        V(g, "rms w32 ring", "rms_fwd", M, N, W32, {}, "api"),
    ]
    out += list(extra)
    g = "ln 4096"
    out += [
        V(g, "same (default)", "ln_fwd", 32768, 4096, "same", {}),
        V(g, "w32 (default)", "ln_fwd", 32768, 4096, W32, {}),
    ]
    return out


def profile(vs, wd: Path) -> None:
    """One launch of each variant between cudaProfilerStart / Stop (``ncu --profile-from-start
    off``), after a warm-up launch; ncu flushes the caches before each replay pass."""
    import torch

    dev = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, N, device=dev, dtype=torch.bfloat16, generator=g) + 0.5
    y = torch.empty_like(x)
    mean = torch.empty(M, device=dev)
    rstd = torch.empty(M, device=dev)
    wb = {
        "same": (
            torch.randn(N, device=dev, generator=g).bfloat16(),
            torch.randn(N, device=dev, generator=g).bfloat16(),
        ),
        W32: (torch.randn(N, device=dev, generator=g), torch.randn(N, device=dev, generator=g)),
    }
    mods = []  # the modules stay referenced while their functions run
    for i, v in enumerate(vs):
        fn, mod = load(wd / f"{compile_key(v)}.o")
        mods.append(mod)
        grid, api, _ = ring_grid_of(v, dev)
        w, b = wb[v["wdt"]]
        if v["kern"] == "ln_fwd":

            def call(fn=fn, w=w, b=b, grid=grid):
                fn(x, w, b, y, mean, rstd, 1e-5, grid)
        else:

            def call(fn=fn, w=w, grid=grid):
                fn(x, w, None, None, y, None, rstd, 1e-6, grid)

        call()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        call()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"profiled #{i}: {v['label']} (grid {grid}, api {api})", flush=True)


def run_cli(vs, workdir: str, argv=None, profile_pick=lambda v: True) -> None:
    """The profiling scripts' command line over the variants ``vs``: --compile (into
    ``--workdir``), --time (``tune_k2.time_groups``), --profile (``profile`` of the variants
    ``profile_pick`` keeps), --groups to select."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", default=workdir)
    ap.add_argument("--groups", default=None)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    if args.groups:
        vs = [v for v in vs if v["group"] in set(args.groups.split(","))]
        if not vs:
            raise SystemExit(f"--groups {args.groups!r}: no such group")
    wd = Path(args.workdir)
    failed: dict = {}
    if args.compile:
        failed = compile_all(vs, wd, args.jobs)
        for k, e in failed.items():
            print(f"compile {k} failed: {e}", flush=True)
    if args.profile:
        profile([v for v in vs if profile_pick(v)], wd)
    if args.time:
        time_groups(vs, wd, args.rounds, failed=failed)


def main(argv=None):
    run_cli(variants(), "/tmp/prof_k7h", argv, profile_pick=lambda v: v["group"] == "p262144")


if __name__ == "__main__":
    main()
