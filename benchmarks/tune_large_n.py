"""Side-by-side variants of the large-row kernels (compile-time ``_TUNE`` knobs, compiled
through ``.raw``), each checked against an fp32 torch reference on its first 512 rows and
timed like bench_kernels.py (bf16 rows, L2 flushed, median of 20):

- softmax fwd: one (max, sum) all-reduce round trip (``online``) vs two;
- softmax bwd: dy / y staged in shared memory (``bwd_smem``) vs fp32 in registers;
- RMSNorm / LayerNorm fwd, weight bf16 and fp32: the persistent ring (``ring``,
  ``quack_kernels._norm_fwd``) vs one row tile per CTA;
- LayerNorm bwd, fp32 weight: weight in shared memory (``w_smem``) vs registers;
- ``wrapper``: the torch wrapper vs a direct call of the loaded kernel (preallocated
  outputs) at 32768x4096, and the wrapper's host time per call;
- ``flush``: the L2 flushed by a write vs a read, on fresh allocations (harness spread);
- ``ring_grids``: the ring forward at 32768x65536 with smaller grids.

    python benchmarks/tune_large_n.py [softmax,rmsnorm,layernorm,ln_bwd,wrapper,flush,ring_grids]
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.bench_kernels import bench  # noqa: E402

SHAPES = [(32768, 65536), (4096, 262144)]
K = 512  # rows checked against the fp32 reference


def close(a, b, tol):
    return bool(torch.allclose(a.float(), b.float(), atol=tol, rtol=tol))


def report(name, m, n, tune, nbytes, call, check):
    try:
        out = call()
        torch.cuda.synchronize()
        ok = check(out)
        us = bench(call, reps=20)
        print(
            f"{name:<16} {m}x{n:<7} {str(tune):<44} {us:8.0f} us {nbytes / us / 1e6:5.2f} TB/s ok={ok}",
            flush=True,
        )
    except Exception as e:  # noqa: BLE001 - one failing variant must not cost the others
        print(f"{name:<16} {m}x{n:<7} {str(tune):<44} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


def with_tune(mod, attr, tune, fn):
    d = getattr(mod, attr)
    d.clear()
    d.update(tune)
    try:
        return fn()
    finally:
        d.clear()


def softmax_variants():
    from quack_kernels import softmax as sm

    for m, n in SHAPES:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 3
        ref = torch.softmax(x[:K].float(), -1)
        for tune in ({"online": False}, {"online": True}):
            fn = with_tune(sm, "_TUNE", tune, lambda: sm.compile_softmax_fwd.raw("bfloat16", n))

            def call(fn=fn):
                y = torch.empty_like(x)
                fn(x, y)
                return y

            report("softmax_fwd", m, n, tune, 2 * m * n * 2, call, lambda y: close(y[:K], ref, 1.6e-2))
        y = torch.softmax(x.float(), -1).to(torch.bfloat16)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        yf, dyf = y[:K].float(), dy[:K].float()
        ref = yf * (dyf - (yf * dyf).sum(-1, keepdim=True))
        for tune in ({"bwd_smem": False}, {"bwd_smem": True}, {"bwd_smem": True, "bwd_min_blocks": 0}):
            fn = with_tune(sm, "_TUNE", tune, lambda: sm.compile_softmax_bwd.raw("bfloat16", n))

            def call(fn=fn):
                dx = torch.empty_like(y)
                fn(dy, y, dx)
                return dx

            report("softmax_bwd", m, n, tune, 3 * m * n * 2, call, lambda dx: close(dx[:K], ref, 1.6e-2))
        del x, y, dy
        torch.cuda.empty_cache()


def norm_fwd_variants(kind):
    from quack_kernels import layernorm as ln
    from quack_kernels import rmsnorm as rms

    layer = kind == "layernorm"
    for m, n in SHAPES:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) + 0.5
        for wdt in (torch.bfloat16, torch.float32):
            w = torch.randn(n, device="cuda", dtype=wdt)
            b = torch.randn(n, device="cuda", dtype=wdt) if layer else None
            wname = "same" if wdt == torch.bfloat16 else "float32"
            xf = x[:K].float()
            if layer:
                ref = torch.nn.functional.layer_norm(xf, (n,), w.float(), b.float(), 1e-5)
            else:
                ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
            es = 4 if wdt == torch.float32 else 2
            nbytes = 2 * m * n * 2 + (2 if layer else 1) * n * es + (8 if layer else 4) * m
            for ring in (False, True):
                tune = {"ring": ring}
                if layer:

                    def make():
                        fn = ln.compile_layernorm_fwd.raw("bfloat16", n, True, True, wname)
                        return fn, ln.fwd_grid(
                            m, "bfloat16", n, ln.fwd_ring_cfg("bfloat16", n, True, True, wname), x.device
                        )

                    fn, grid = with_tune(ln, "_TUNE", tune, make)

                    def call(fn=fn, grid=grid):
                        y = torch.empty_like(x)
                        mean = torch.empty(m, device="cuda")
                        rstd = torch.empty(m, device="cuda")
                        fn(x, w, b, y, mean, rstd, 1e-5, grid)
                        return y
                else:

                    def make():
                        fn = rms.compile_rmsnorm_fwd.raw("bfloat16", n, True, False, False, wname)
                        cfg = rms.fwd_ring_cfg("bfloat16", n, True, False, False, wname)
                        return fn, rms.fwd_grid(m, "bfloat16", n, cfg, x.device)

                    fn, grid = with_tune(rms, "_TUNE", tune, make)

                    def call(fn=fn, grid=grid):
                        y = torch.empty_like(x)
                        rstd = torch.empty(m, device="cuda")
                        fn(x, w, None, None, y, None, rstd, 1e-6, grid)
                        return y

                label = f"{kind}_fwd" + ("_w32" if wname == "float32" else "")
                report(label, m, n, dict(tune, grid=grid), nbytes, call, lambda y: close(y[:K], ref, 6e-2))
        del x
        torch.cuda.empty_cache()


def ln_bwd_variants():
    from quack_kernels import layernorm as ln
    from quack_kernels._norm_bwd import run_norm_bwd

    for m, n in SHAPES:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) + 0.5
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        mean = torch.empty(m, device="cuda")
        rstd = torch.empty(m, device="cuda")
        for i in range(0, m, 4096):
            xf = x[i : i + 4096].float()
            mean[i : i + 4096] = xf.mean(-1)
            rstd[i : i + 4096] = torch.rsqrt(xf.var(-1, unbiased=False) + 1e-5)
        for wdt in (torch.float32, torch.bfloat16):
            w = torch.randn(n, device="cuda", dtype=wdt)
            b = torch.randn(n, device="cuda", dtype=wdt)
            wname = "same" if wdt == torch.bfloat16 else "float32"
            xr = x[:K].float().requires_grad_()
            torch.nn.functional.layer_norm(xr, (n,), w.float(), b.float(), 1e-5).backward(dy[:K].float())
            es = 4 if wdt == torch.float32 else 2
            for w_smem in (False, True):
                tune = {"w_smem": w_smem}
                fn = with_tune(
                    ln,
                    "_BWD_TUNE",
                    tune,
                    lambda: ln.compile_layernorm_bwd.raw("bfloat16", n, True, True, wname),
                )

                def call(fn=fn, tune=tune, w=w, b=b):
                    return run_norm_bwd("layer", lambda *a: fn, x, w, dy, mean, rstd, b.dtype, tune)

                report(
                    "layernorm_bwd" + ("_w32" if wname == "float32" else ""),
                    m,
                    n,
                    tune,
                    3 * m * n * 2 + 4 * n * es + 8 * m,
                    call,
                    lambda out: close(out[0][:K], xr.grad, 3e-2),
                )
        del x, dy
        torch.cuda.empty_cache()


def wrapper_overhead():
    """Same kernel, same inputs: through the torch wrapper (as bench_kernels.py times it)
    vs a direct call of the loaded kernel with preallocated outputs; then the wrapper's
    host time per call (no synchronization: launches queue up behind a long kernel)."""
    from quack_kernels import layernorm as ln
    from quack_kernels import softmax as sm

    m, n = 32768, 4096
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.softmax(torch.randn(m, n, device="cuda", dtype=torch.bfloat16), -1)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    mean = torch.empty(m, device="cuda")
    rstd = torch.empty(m, device="cuda")
    sb = sm.compile_softmax_bwd("bfloat16", n)
    sf = sm.compile_softmax_fwd("bfloat16", n)
    lf = ln.compile_layernorm_fwd("bfloat16", n, True, True, "same")
    cases = [
        ("softmax_bwd", 3 * m * n * 2, lambda: sm.softmax_bwd(dy, y), lambda: sb(dy, y, out)),
        ("softmax_fwd", 2 * m * n * 2, lambda: sm.softmax_fwd(x), lambda: sf(x, out)),
        (
            "layernorm_fwd",
            2 * m * n * 2 + 4 * n + 8 * m,
            lambda: ln.layernorm_fwd(x, w, b),
            lambda: lf(x, w, b, out, mean, rstd, 1e-5, 1),
        ),
    ]
    for name, nbytes, wrapped, direct in cases:
        for label, f in (("wrapper", wrapped), ("direct", direct), ("wrapper", wrapped)):
            us = bench(f, reps=30)
            print(f"{name:<16} {m}x{n:<7} {label:<10} {us:8.1f} us {nbytes / us / 1e6:5.2f} TB/s", flush=True)
        host_time(name, wrapped)
    del x, y, dy, out
    torch.cuda.empty_cache()
    # cross-entropy bwd at 4096x262144: 1205 us through bench_kernels.py, 1100 in
    # tune_variants.py (same kernel): wrapper vs direct in one process
    from quack_kernels import cross_entropy as ce

    m, n = 4096, 262144
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, n, (m,), device="cuda")
    dl = torch.rand(m, device="cuda")
    lse = torch.logsumexp(x.float(), -1)
    dx = torch.empty_like(x)
    fn = ce.compile_cross_entropy_bwd("bfloat16", n)
    nbytes = 2 * m * n * 2 + 12 * m
    for label, f in (
        ("wrapper", lambda: ce.cross_entropy_bwd(x, t, dl, lse)),
        ("direct", lambda: fn(x, t, dl, lse, dx, -100)),
        ("direct+alloc", lambda: fn(x, t, dl, lse, torch.empty_like(x), -100)),
        ("wrapper", lambda: ce.cross_entropy_bwd(x, t, dl, lse)),
    ):
        us = bench(f, reps=30)
        print(
            f"cross_entropy_bwd {m}x{n:<7} {label:<12} {us:8.1f} us {nbytes / us / 1e6:5.2f} TB/s", flush=True
        )


def flush_modes():
    """The same kernel on freshly allocated inputs, three times, timed with the L2 flushed
    by a write (bench_kernels.py's figures) and by a read: how much of the spread of the
    ~135 µs shapes between runs is the harness."""
    from quack_kernels import layernorm as ln
    from quack_kernels import softmax as sm

    m, n = 32768, 4096
    for alloc in range(3):
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        for name, nbytes, f in (
            ("softmax_fwd", 2 * m * n * 2, lambda: sm.softmax_fwd(x)),
            ("layernorm_fwd", 2 * m * n * 2 + 4 * n + 8 * m, lambda: ln.layernorm_fwd(x, w, b)),
        ):
            cells = []
            for mode in ("zero", "read", "zero"):
                us = bench(f, reps=30, flush_mode=mode)
                cells.append(f"{mode} {us:6.1f} us {nbytes / us / 1e6:4.2f}")
            print(f"{name:<16} {m}x{n} alloc {alloc}: " + " | ".join(cells), flush=True)
        del x, w, b
        torch.cuda.empty_cache()


def ring_grids():
    """The ring forward at 32768x65536 (clusters of 4) with smaller grids: the default
    (SMs / 4 - 1 = 32 clusters of one CTA / SM) may not be co-resident (GPC granularity)."""
    from quack_kernels import layernorm as ln
    from quack_kernels import rmsnorm as rms

    m, n = 32768, 65536
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) + 0.5
    for kind in ("rmsnorm", "layernorm"):
        layer = kind == "layernorm"
        for wdt in (torch.float32, torch.bfloat16):
            w = torch.randn(n, device="cuda", dtype=wdt)
            b = torch.randn(n, device="cuda", dtype=wdt) if layer else None
            wname = "same" if wdt == torch.bfloat16 else "float32"
            xf = x[:K].float()
            if layer:
                ref = torch.nn.functional.layer_norm(xf, (n,), w.float(), b.float(), 1e-5)
            else:
                ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
            es = 4 if wdt == torch.float32 else 2
            nbytes = 2 * m * n * 2 + (2 if layer else 1) * n * es + (8 if layer else 4) * m
            variants = [{"ring": False}] + [
                {"ring": True, "ring_min_cluster": 4, "ring_same": True, "ring_clusters": c}
                for c in (32, 28, 24, 16)
            ]
            for tune in variants:
                mod = ln if layer else rms

                def make():
                    if layer:
                        fn = ln.compile_layernorm_fwd.raw("bfloat16", n, True, True, wname)
                        cfg = ln.fwd_ring_cfg("bfloat16", n, True, True, wname)
                    else:
                        fn = rms.compile_rmsnorm_fwd.raw("bfloat16", n, True, False, False, wname)
                        cfg = rms.fwd_ring_cfg("bfloat16", n, True, False, False, wname)
                    return fn, mod.fwd_grid(m, "bfloat16", n, cfg, x.device)

                fn, grid = with_tune(mod, "_TUNE", tune, make)

                def call(fn=fn, grid=grid, w=w, b=b):
                    y = torch.empty_like(x)
                    rstd = torch.empty(m, device="cuda")
                    if layer:
                        fn(x, w, b, y, torch.empty(m, device="cuda"), rstd, 1e-5, grid)
                    else:
                        fn(x, w, None, None, y, None, rstd, 1e-6, grid)
                    return y

                label = f"{kind}_fwd" + ("_w32" if wname == "float32" else "")
                report(label, m, n, dict(tune, grid=grid), nbytes, call, lambda y: close(y[:K], ref, 6e-2))


def host_time(name, wrapped):
    """Host time per wrapper call while the GPU is busy (the launches only queue)."""
    torch.cuda._sleep(200_000_000)
    t0 = time.perf_counter()
    for _ in range(200):
        wrapped()
    host = (time.perf_counter() - t0) / 200 * 1e6
    torch.cuda.synchronize()
    print(f"{name:<16} wrapper host time {host:.1f} us / call", flush=True)


def main():
    only = (
        sys.argv[1].split(",")
        if len(sys.argv) > 1
        else ["wrapper", "softmax", "rmsnorm", "layernorm", "ln_bwd"]
    )
    for part in only:
        t = time.time()
        if part == "wrapper":
            wrapper_overhead()
        elif part == "softmax":
            softmax_variants()
        elif part in ("rmsnorm", "layernorm"):
            norm_fwd_variants(part)
        elif part == "ln_bwd":
            ln_bwd_variants()
        elif part == "flush":
            flush_modes()
        elif part == "ring_grids":
            ring_grids()
        print(f"[{part}: {time.time() - t:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
