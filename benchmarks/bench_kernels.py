"""Benchmark our CuTe DSL kernels against torch eager and torch.compile on the GPU.

    python benchmarks/bench_kernels.py [--ops rmsnorm_fwd,softmax_fwd,...] [--no-compile]
        [--dtype bfloat16] [--shapes 32768x4096,32768x16384,32768x65536,4096x262144] [--json out.json]

Median kernel time over reps (CUDA events, L2 flushed before every rep by writing a
256 MiB buffer), effective bandwidth = bytes read + written / time (TB = 1e12 B).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DEFAULT_SHAPES = [(32768, 4096), (32768, 16384), (32768, 65536), (4096, 262144)]


def bench(fn, reps=30, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    ts = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
    return ts[len(ts) // 2]


def make_ops(dt):
    from quack_kernels.cross_entropy import cross_entropy_bwd, cross_entropy_fwd
    from quack_kernels.layernorm import layernorm_bwd, layernorm_fwd
    from quack_kernels.rmsnorm import rmsnorm_bwd, rmsnorm_fwd
    from quack_kernels.softmax import softmax_bwd, softmax_fwd

    es = torch.empty((), dtype=dt).element_size()

    def rms_ref(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(x.dtype)

    def rms_bwd_ref(x, w, dy, rstd):
        xf, dyf, wf = x.float(), dy.float(), w.float()
        xhat = xf * rstd[:, None]
        g = dyf * wf
        dx = (g - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd[:, None]
        return dx.to(x.dtype), (dyf * xhat).sum(0).to(w.dtype)

    def ce_bwd_ref(x, t, dl, lse):
        p = torch.exp(x.float() - lse[:, None]) * dl[:, None]
        p.scatter_add_(1, t[:, None], -dl[:, None])
        return p.to(x.dtype)

    def ln_bwd_ref(x, w, b, dy, mean, rstd):
        return torch.ops.aten.native_layer_norm_backward(
            dy, x, (x.shape[-1],), mean[:, None], rstd[:, None], w, b, [True, True, True]
        )

    def ln_bwd_setup(m, n, wdt):
        x, w, b = rnd(m, n, dt), rnd(1, n, wdt)[0], rnd(1, n, wdt)[0]
        _, mean, rstd = layernorm_fwd(x, w, b)
        return x, w, b, rnd(m, n, dt), mean, rstd

    w32 = torch.float32
    # name -> (setup(M, N) -> args, ours, eager, bytes(M, N))
    return {
        # mixed precision: fp32 weight / bias with `dt` activations (the AMP setup); the
        # eager / compile columns run the same math
        "rmsnorm_fwd_w32": (
            lambda m, n: (rnd(m, n, dt), rnd(1, n, w32)[0]),
            lambda x, w: rmsnorm_fwd(x, w),
            rms_ref,
            lambda m, n: 2 * m * n * es + n * 4 + 4 * m,
        ),
        "rmsnorm_bwd_w32": (
            lambda m, n: (lambda x, w: (x, w, rnd(m, n, dt), rmsnorm_fwd(x, w)[1]))(
                rnd(m, n, dt), rnd(1, n, w32)[0]
            ),
            lambda x, w, dy, rstd: rmsnorm_bwd(x, w, dy, rstd),
            rms_bwd_ref,
            lambda m, n: 3 * m * n * es + 2 * n * 4 + 4 * m,
        ),
        "layernorm_fwd_w32": (
            lambda m, n: (rnd(m, n, dt), rnd(1, n, w32)[0], rnd(1, n, w32)[0]),
            lambda x, w, b: layernorm_fwd(x, w, b),
            lambda x, w, b: F.layer_norm(x.float(), (x.shape[-1],), w, b, 1e-5).to(x.dtype),
            lambda m, n: 2 * m * n * es + 2 * n * 4 + 8 * m,
        ),
        "layernorm_bwd": (
            lambda m, n: ln_bwd_setup(m, n, dt),
            lambda x, w, b, dy, mean, rstd: layernorm_bwd(x, w, dy, mean, rstd, b),
            ln_bwd_ref,
            lambda m, n: 3 * m * n * es + 4 * n * es + 8 * m,
        ),
        "layernorm_bwd_w32": (
            lambda m, n: ln_bwd_setup(m, n, w32),
            lambda x, w, b, dy, mean, rstd: layernorm_bwd(x, w, dy, mean, rstd, b),
            lambda x, w, b, dy, mean, rstd: ln_bwd_ref(x, w.to(x.dtype), b.to(x.dtype), dy, mean, rstd),
            lambda m, n: 3 * m * n * es + 4 * n * 4 + 8 * m,
        ),
        "rmsnorm_fwd": (
            lambda m, n: (rnd(m, n, dt), rnd(1, n, dt)[0]),
            lambda x, w: rmsnorm_fwd(x, w),
            rms_ref,
            lambda m, n: 2 * m * n * es + n * es + 4 * m,
        ),
        "softmax_fwd": (
            lambda m, n: (rnd(m, n, dt),),
            softmax_fwd,
            lambda x: torch.softmax(x, -1),
            lambda m, n: 2 * m * n * es,
        ),
        "layernorm_fwd": (
            lambda m, n: (rnd(m, n, dt), rnd(1, n, dt)[0], rnd(1, n, dt)[0]),
            lambda x, w, b: layernorm_fwd(x, w, b),
            lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
            lambda m, n: 2 * m * n * es + 2 * n * es + 8 * m,
        ),
        "cross_entropy_fwd": (
            lambda m, n: (rnd(m, n, dt), torch.randint(0, n, (m,), device="cuda")),
            lambda x, t: cross_entropy_fwd(x, t),
            lambda x, t: F.cross_entropy(x.float(), t, reduction="none"),
            lambda m, n: m * n * es + 16 * m,
        ),
        "softmax_bwd": (
            lambda m, n: (rnd(m, n, dt), torch.softmax(rnd(m, n, dt), -1)),
            lambda dy, y: softmax_bwd(dy, y),
            lambda dy, y: torch._softmax_backward_data(dy, y, -1, dy.dtype),
            lambda m, n: 3 * m * n * es,
        ),
        "rmsnorm_bwd": (
            lambda m, n: (lambda x, w: (x, w, rnd(m, n, dt), rmsnorm_fwd(x, w)[1]))(
                rnd(m, n, dt), rnd(1, n, dt)[0]
            ),
            lambda x, w, dy, rstd: rmsnorm_bwd(x, w, dy, rstd),
            rms_bwd_ref,
            lambda m, n: 3 * m * n * es + 2 * n * es + 4 * m,
        ),
        "cross_entropy_bwd": (
            lambda m, n: (lambda x, t: (x, t, torch.rand(m, device="cuda"), torch.logsumexp(x.float(), -1)))(
                rnd(m, n, dt), torch.randint(0, n, (m,), device="cuda")
            ),
            lambda x, t, dl, lse: cross_entropy_bwd(x, t, dl, lse),
            ce_bwd_ref,
            lambda m, n: 2 * m * n * es + 12 * m,
        ),
    }


def rnd(m, n, dt):
    return torch.randn(m, n, device="cuda", dtype=dt)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--ops",
        default="rmsnorm_fwd,softmax_fwd,cross_entropy_fwd,layernorm_fwd,rmsnorm_bwd,softmax_bwd,cross_entropy_bwd",
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shapes", default=",".join(f"{m}x{n}" for m, n in DEFAULT_SHAPES))
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    ap.add_argument(
        "--compile-ops",
        default="rmsnorm_fwd,softmax_fwd,cross_entropy_fwd,layernorm_fwd,rmsnorm_bwd,layernorm_bwd",
        help="ops that get a torch.compile column",
    )
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dt = getattr(torch, args.dtype)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ops = make_ops(dt)
    rows = []
    print(f"device: {torch.cuda.get_device_name()}  dtype: {args.dtype}  (µs / TB/s, median of {args.reps})")
    print(f"{'op':<18} {'M x N':>14} {'ours':>17} {'torch eager':>17} {'torch.compile':>17}  speedup vs best")
    for name in args.ops.split(","):
        setup, ours, eager, nbytes = ops[name]
        compiled = None
        if not args.no_compile and name in args.compile_ops.split(","):
            compiled = torch.compile(eager, dynamic=False)
        for m, n in shapes:
            try:
                a = setup(m, n)
                t0 = time.time()
                ours(*a)
                torch.cuda.synchronize()
                first = time.time() - t0
                res = {"op": name, "m": m, "n": n, "first_call_s": first}
                b = nbytes(m, n)
                for col, f in (("ours", ours), ("eager", eager), ("compile", compiled)):
                    if f is None:
                        continue
                    try:
                        us = bench(lambda: f(*a), reps=args.reps)
                        res[col] = (us, b / us / 1e6)
                    except Exception as e:  # noqa: BLE001
                        res[col] = None
                        print(f"  {col} failed: {type(e).__name__}: {str(e)[:200]}")
                rows.append(res)

                def cell(k):
                    v = res.get(k)
                    return f"{v[0]:9.0f} / {v[1]:4.2f}" if v else f"{'-':>16}"

                others = [res[k][0] for k in ("eager", "compile") if res.get(k)]
                sp = f"{min(others) / res['ours'][0]:.2f}x" if others and res.get("ours") else ""
                print(
                    f"{name:<18} {f'{m}x{n}':>14} {cell('ours'):>17} {cell('eager'):>17} {cell('compile'):>17}  {sp}",
                    flush=True,
                )
                del a
                torch.cuda.empty_cache()
            except torch.cuda.OutOfMemoryError:
                print(f"{name:<18} {f'{m}x{n}':>14}  OOM")
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
