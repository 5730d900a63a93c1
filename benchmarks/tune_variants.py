"""Compare compile-time variants (module ``_TUNE`` knobs) of the large-N forward kernels
on the GPU: each variant is compiled through the undecorated compile function (``.raw``),
checked against torch, and timed like bench_kernels.py (bf16, L2 flushed)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.bench_kernels import bench  # noqa: E402
from kernels import cross_entropy, layernorm, rmsnorm  # noqa: E402

SHAPES = [(32768, 65536), (4096, 262144)]


def run(name, mod, raw, tunes, setup, call, check, nbytes):
    for m, n in SHAPES:
        a = setup(m, n)
        for tune in tunes:
            mod._TUNE.clear()
            mod._TUNE.update(tune)
            try:
                fn = raw(n)
                out = call(fn, a)
                torch.cuda.synchronize()
                ok = check(a, out)
                us = bench(lambda: call(fn, a), reps=20)
                print(f"{name:<18} {m}x{n:<7} {str(tune):<40} {us:8.0f} us {nbytes(m, n) / us / 1e6:5.2f} TB/s ok={ok}",
                      flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{name:<18} {m}x{n:<7} {str(tune):<40} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        mod._TUNE.clear()
        del a
        torch.cuda.empty_cache()


def rmsnorm_bwd_variants(shapes, variants):
    """RMSNorm backward: variants are (tune dict, grid clusters or None = the wrapper's)."""
    from kernels._plan import plan_rows
    
    dt = torch.bfloat16
    for m, n in shapes:
        x = torch.randn(m, n, device="cuda", dtype=dt)
        dy = torch.randn(m, n, device="cuda", dtype=dt)
        w = torch.randn(n, device="cuda", dtype=dt)
        rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
        # fp32 reference: dx on the first 512 rows, dw over all rows (chunked)
        k = 512
        xf, dyf, wf = x[:k].float(), dy[:k].float(), w.float()
        xhat = xf * rstd[:k, None]
        g = dyf * wf
        dx_ref = (g - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd[:k, None]
        dw_ref = torch.zeros(n, device="cuda")
        for i in range(0, m, 2048):
            dw_ref += (dy[i:i + 2048].float() * x[i:i + 2048].float() * rstd[i:i + 2048, None]).sum(0)
        del xf, dyf, xhat, g
        plan = plan_rows(n, 16, budget=32)
        nbytes = 3 * m * n * 2 + 2 * n * 2 + 4 * m
        for tune, grid in variants:
            rmsnorm._TUNE.clear()
            rmsnorm._TUNE.update(tune)
            gr = rmsnorm._bwd_grid(m, plan, 16, x.device) if grid is None else grid
            try:
                fn = rmsnorm.compile_rmsnorm_bwd.raw("bfloat16", n, True)
                st = rmsnorm.bwd_smem_stages(plan, 16)

                def call():
                    dx = torch.empty_like(x)
                    part = torch.empty(gr * plan.rows_per_cta, n, dtype=torch.float32, device="cuda")
                    fn(x, w, dy, rstd, dx, part, gr)
                    return dx, part.sum(0)
                dx, dw = call()
                torch.cuda.synchronize()
                ok = bool(torch.allclose(dx[:k].float(), dx_ref, atol=6e-2, rtol=2e-2)) and \
                    bool(torch.allclose(dw, dw_ref, atol=1e-2 * (dw_ref.abs().max().item() + 1), rtol=1e-3))
                us = bench(call, reps=20)
                print(f"rmsnorm_bwd {m}x{n:<7} {str(tune):<34} stages={st} grid={gr:<4} {us:8.0f} us "
                      f"{nbytes / us / 1e6:5.2f} TB/s ok={ok}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"rmsnorm_bwd {m}x{n:<7} {str(tune):<34} grid={gr} FAILED {type(e).__name__}: {str(e)[:300]}",
                      flush=True)
        rmsnorm._TUNE.clear()
        del x, dy, w, rstd
        torch.cuda.empty_cache()


def main():
    dt = torch.bfloat16
    only = sys.argv[1].split(",") if len(sys.argv) > 1 else None
    if only is None or "rmsnorm_bwd" in only:
        # grid None = the wrapper's (_bwd_grid); measured on the H200: one cluster of 8 / 16
        # less than SMs / cluster size (16 clusters of 8: 5720 us vs 15: 3383 us at 65536)
        old = dict(smem=False)
        rmsnorm_bwd_variants([(32768, 65536)], [
            ({}, None), (dict(stages=3), None), (dict(stages=2), None), (old, None)])
        rmsnorm_bwd_variants([(4096, 262144)], [({}, None), (dict(smem_kb=192), None), (old, None)])
        rmsnorm_bwd_variants([(32768, 16384), (32768, 4096)], [({}, None), (old, None)])
    if only is not None and "fwd" not in only:
        return

    def rnd(*s):
        return torch.randn(*s, device="cuda", dtype=dt)

    # LayerNorm
    def ln_setup(m, n):
        return rnd(m, n), rnd(n), rnd(n)

    def ln_call(fn, a):
        x, w, b = a
        y = torch.empty_like(x)
        mean = torch.empty(x.shape[0], device="cuda")
        rstd = torch.empty(x.shape[0], device="cuda")
        fn(x, w, b, y, mean, rstd, 1e-5)
        return y

    def ln_check(a, y):
        x, w, b = a
        k = 512
        ref = F.layer_norm(x[:k].float(), (x.shape[1],), w.float(), b.float(), 1e-5)
        return bool(torch.allclose(y[:k].float(), ref, atol=6e-2, rtol=2e-2))

    run("layernorm_fwd", layernorm, lambda n: layernorm.compile_layernorm_fwd.raw("bfloat16", n, True, True),
        [dict(stage_wb=False), dict(stage_wb=True, min_blocks=0), dict(stage_wb=True, min_blocks=3)],
        ln_setup, ln_call, ln_check, lambda m, n: 2 * m * n * 2 + 4 * n + 8 * m)

    # RMSNorm forward
    def rms_setup(m, n):
        return rnd(m, n), rnd(n)

    def rms_call(fn, a):
        x, w = a
        y = torch.empty_like(x)
        rstd = torch.empty(x.shape[0], device="cuda")
        fn(x, w, None, None, y, None, rstd, 1e-6)
        return y

    def rms_check(a, y):
        x, w = a
        k = 512
        xf = x[:k].float()
        ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
        return bool(torch.allclose(y[:k].float(), ref, atol=6e-2, rtol=2e-2))

    run("rmsnorm_fwd", rmsnorm, lambda n: rmsnorm.compile_rmsnorm_fwd.raw("bfloat16", n, True, False, False),
        [dict(stage_wb=False), dict(stage_wb=True, min_blocks=0), dict(stage_wb=True, min_blocks=3)],
        rms_setup, rms_call, rms_check, lambda m, n: 2 * m * n * 2 + 2 * n + 4 * m)

    # Cross-entropy forward
    def ce_setup(m, n):
        return rnd(m, n), torch.randint(0, n, (m,), device="cuda")

    def ce_call(fn, a):
        x, t = a
        loss = torch.empty(x.shape[0], device="cuda")
        lse = torch.empty(x.shape[0], device="cuda")
        fn(x, t, loss, lse, -100)
        return loss

    def ce_check(a, loss):
        x, t = a
        k = 512
        ref = F.cross_entropy(x[:k].float(), t[:k], reduction="none")
        return bool(torch.allclose(loss[:k], ref, atol=1e-3, rtol=1e-3))

    run("cross_entropy_fwd", cross_entropy, lambda n: cross_entropy.compile_cross_entropy_fwd.raw("bfloat16", n),
        [dict(min_blocks=0), dict(min_blocks=4)],
        ce_setup, ce_call, ce_check, lambda m, n: m * n * 2 + 16 * m)


if __name__ == "__main__":
    main()
