"""Compare compile-time variants (module ``_TUNE`` knobs) of the large-N forward kernels
on the GPU: each variant is compiled through the undecorated compile function (``.raw``),
checked against torch, and timed like bench_kernels.py (bf16, L2 flushed)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from quack_kernels import cross_entropy, layernorm, rmsnorm  # noqa: E402

from benchmarks.bench_kernels import bench  # noqa: E402

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
                print(
                    f"{name:<18} {m}x{n:<7} {str(tune):<40} {us:8.0f} us {nbytes(m, n) / us / 1e6:5.2f} TB/s ok={ok}",
                    flush=True,
                )
            except Exception as e:  # noqa: BLE001
                print(
                    f"{name:<18} {m}x{n:<7} {str(tune):<40} FAILED {type(e).__name__}: {str(e)[:300]}",
                    flush=True,
                )
        mod._TUNE.clear()
        del a
        torch.cuda.empty_cache()


def rmsnorm_bwd_variants(shapes, variants):
    """RMSNorm backward: variants are (tune dict, grid clusters or None = the wrapper's)."""
    from quack_kernels._plan import plan_rows

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
            dw_ref += (dy[i : i + 2048].float() * x[i : i + 2048].float() * rstd[i : i + 2048, None]).sum(0)
        del xf, dyf, xhat, g
        plan = plan_rows(n, 16, budget=32)
        nbytes = 3 * m * n * 2 + 2 * n * 2 + 4 * m
        for tune, grid in variants:
            rmsnorm._TUNE.clear()
            rmsnorm._TUNE.update(tune)
            gr = rmsnorm._bwd_grid(m, plan, 16, x.device) if grid is None else grid
            try:
                fn = rmsnorm.compile_rmsnorm_bwd.raw("bfloat16", n, True, False, "same")
                st = rmsnorm.bwd_smem_stages(plan, 16)

                def call():
                    dx = torch.empty_like(x)
                    part = torch.empty(gr * plan.rows_per_cta, n, dtype=torch.float32, device="cuda")
                    fn(x, w, dy, None, rstd, dx, part, None, gr)
                    return dx, part.sum(0)

                dx, dw = call()
                torch.cuda.synchronize()
                ok = bool(torch.allclose(dx[:k].float(), dx_ref, atol=6e-2, rtol=2e-2)) and bool(
                    torch.allclose(dw, dw_ref, atol=1e-2 * (dw_ref.abs().max().item() + 1), rtol=1e-3)
                )
                us = bench(call, reps=20)
                print(
                    f"rmsnorm_bwd {m}x{n:<7} {str(tune):<34} stages={st} grid={gr:<4} {us:8.0f} us "
                    f"{nbytes / us / 1e6:5.2f} TB/s ok={ok}",
                    flush=True,
                )
            except Exception as e:  # noqa: BLE001
                print(
                    f"rmsnorm_bwd {m}x{n:<7} {str(tune):<34} grid={gr} FAILED {type(e).__name__}: {str(e)[:300]}",
                    flush=True,
                )
        rmsnorm._TUNE.clear()
        del x, dy, w, rstd
        torch.cuda.empty_cache()


# Cross-entropy forward: the register path (stream=False) vs the streaming
# variants (cross_entropy.stream_cfg). Names are short labels for the final table.
CE_FWD_VARIANTS = [
    ("reg", dict(stream=False)),
    ("w32k4s4", dict(stream=True)),  # 6 CTAs/SM x 4 warps
    ("w32k4s3c8", dict(stream=True, stages=3, ctas_per_sm=8)),  # 8 CTAs/SM x 4 warps
    ("w32k2s4c8", dict(stream=True, k=2, ctas_per_sm=8)),
    ("w32k8s3", dict(stream=True, k=8, stages=3)),  # 4 CTAs/SM
    ("w32t256s3", dict(stream=True, threads=256, stages=3)),  # 8 warps / CTA, 4 CTAs/SM
    ("cta256", dict(stream=True, tpr=256)),  # one row per CTA, 3 CTAs/SM
    ("cta256s3c4", dict(stream=True, tpr=256, stages=3, ctas_per_sm=4)),
    ("cl2", dict(stream=True, tpr=256, cluster=2)),
    ("cl4", dict(stream=True, tpr=256, cluster=4)),
    ("cl8", dict(stream=True, tpr=256, cluster=8)),
]
# one variant per code path for the fp32 / fp16 correctness pass
CE_FWD_CHECK = ["reg", "w32k4s4", "cta256", "cl4"]
CE_SHAPES = [(32768, 4096), (32768, 16384), (32768, 65536), (4096, 262144)]


def ce_fwd_variants(variants=None, shapes=None, check_names=None):
    """Compile each cross-entropy forward variant (``.raw``), check loss / lse on every row
    against torch (fp32 reference), time it (bf16, L2 flushed); then a correctness pass in
    fp32 / fp16 at N in {1000, 4096, 65536} (M = 2053, ignored and out-of-range targets).
    Prints a table at the end; details to $OUT/tune_cross_entropy_fwd.json when OUT is set."""
    import json
    import time

    variants = variants or CE_FWD_VARIANTS
    if os.environ.get("CE_VARIANTS"):  # e.g. CE_VARIANTS=reg,w32k4s3c8
        keep = os.environ["CE_VARIANTS"].split(",")
        variants = [v for v in variants if v[0] in keep]
    shapes = shapes or CE_SHAPES
    check_names = CE_FWD_CHECK if check_names is None else check_names
    check_names = [c for c in check_names if c in dict(variants)]
    ce = cross_entropy
    results = []

    def make(dtype, n, tune):
        ce._TUNE.clear()
        ce._TUNE.update(tune)
        try:
            t0 = time.time()
            fn = ce.compile_cross_entropy_fwd.raw(dtype, n)
            ct = time.time() - t0
            cfg = ce.stream_cfg(dtype, n)
        finally:
            ce._TUNE.clear()
        return fn, cfg, ct

    def reference(x, t):
        lse = torch.empty(x.shape[0], device="cuda")
        for i in range(0, x.shape[0], 1024):
            lse[i : i + 1024] = torch.logsumexp(x[i : i + 1024].float(), -1)
        # ignored rows: loss 0; out-of-range targets: x[t] taken as 0 (loss = lse)
        valid = (t >= 0) & (t < x.shape[1])
        xt = torch.zeros(x.shape[0], device="cuda")
        rows = torch.nonzero(valid).flatten()
        xt[rows] = x[rows, t[rows]].float()
        return torch.where(t == -100, torch.zeros_like(lse), lse - xt), lse

    def runner(fn, cfg, x, t):
        m = x.shape[0]
        grid = ce.stream_grid(cfg, m, x.device) if cfg is not None else None

        def call():
            loss = torch.empty(m, device="cuda")
            lse = torch.empty(m, device="cuda")
            if grid is None:
                fn(x, t, loss, lse, -100)
            else:
                fn(x, t, loss, lse, -100, grid)
            return loss, lse

        return call, grid

    def close(out, ref, tol):
        return all(bool(torch.allclose(a, b, atol=tol, rtol=tol)) for a, b in zip(out, ref))

    out_dir = os.environ.get("OUT")
    checks = []

    def save():
        if out_dir:
            with open(os.path.join(out_dir, "tune_cross_entropy_fwd.json"), "w") as f:
                json.dump(dict(results=results, checks=checks), f, indent=1, default=str)

    def timing(vs):
        for m, n in shapes:
            x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 2
            t = torch.randint(0, n, (m,), device="cuda")
            t[::7] = -100
            ref = reference(x, t)
            nbytes = m * n * 2 + 16 * m
            for name, tune in vs:
                rec = dict(name=name, tune=tune, dtype="bfloat16", m=m, n=n)
                try:
                    fn, cfg, ct = make("bfloat16", n, tune)
                    call, grid = runner(fn, cfg, x, t)
                    out = call()
                    torch.cuda.synchronize()
                    ok = close(out, ref, 2e-3)
                    us = bench(call, reps=20)
                    rec.update(us=us, tbs=nbytes / us / 1e6, ok=ok, grid=grid, cfg=cfg, compile_s=ct)
                    print(
                        f"cross_entropy_fwd {m}x{n:<7} {name:<11} {us:8.1f} us {nbytes / us / 1e6:5.2f} TB/s "
                        f"ok={ok} grid={grid} compile={ct:.1f}s {tune}",
                        flush=True,
                    )
                except Exception as e:  # noqa: BLE001
                    rec.update(error=f"{type(e).__name__}: {str(e)[:500]}")
                    print(f"cross_entropy_fwd {m}x{n:<7} {name:<11} FAILED {rec['error'][:300]}", flush=True)
                results.append(rec)
            del x, t, ref
            torch.cuda.empty_cache()
            save()

    def correctness(names):
        by_name = dict(variants)
        for dtype in ("float32", "float16"):
            for n in (1000, 4096, 65536):
                g = torch.Generator(device="cpu").manual_seed(n)
                m = 2053
                x = (torch.randn(m, n, generator=g) * 3).to(device="cuda", dtype=getattr(torch, dtype))
                t = torch.randint(0, n, (m,), generator=g)
                t[::5] = -100
                t[3::11] = n + 5  # out of range: loss = lse (like the register path)
                t = t.to("cuda")
                ref = reference(x, t)
                for name in names:
                    try:
                        fn, cfg, _ = make(dtype, n, by_name[name])
                        call, _ = runner(fn, cfg, x, t)
                        out = call()
                        torch.cuda.synchronize()
                        ok = close(out, ref, 1e-3)
                        if not ok:
                            err = max((a - b).abs().max().item() for a, b in zip(out, ref))
                            ok = f"False(maxerr={err:.3g})"
                    except Exception as e:  # noqa: BLE001
                        ok = f"FAILED {type(e).__name__}: {str(e)[:200]}"
                    checks.append(dict(name=name, dtype=dtype, n=n, m=m, ok=ok))
                    print(f"check {dtype:<8} {m}x{n:<6} {name:<11} ok={ok}", flush=True)
                del x, t, ref
                torch.cuda.empty_cache()
        save()

    # cluster variants last: a fault there cannot cost the other results
    plain = [v for v in variants if "cluster" not in v[1]]
    clus = [v for v in variants if "cluster" in v[1]]
    timing(plain)
    correctness([c for c in check_names if c not in dict(clus)])
    timing(clus)
    correctness([c for c in check_names if c in dict(clus)])

    # short table: variant x shape (us / TB/s, * = wrong result)
    print("\ncross_entropy_fwd bf16, us / TB/s (QuACK: 77 / 259 / 1064 / 642 us)")
    hdr = f"{'variant':<11}" + "".join(f"{f'{m}x{n}':>18}" for m, n in shapes)
    print(hdr)
    for name, _ in variants:
        row = f"{name:<11}"
        for m, n in shapes:
            r = next(r for r in results if r["name"] == name and r["m"] == m and r["n"] == n)
            cell = "FAILED" if "error" in r else f"{r['us']:.0f}/{r['tbs']:.2f}{'' if r['ok'] else '*'}"
            row += f"{cell:>18}"
        print(row)
    bad = [c for c in checks if c["ok"] is not True]
    print(
        f"fp32/fp16 correctness: {len(checks) - len(bad)}/{len(checks)} ok"
        + "".join(f"\n  BAD {c}" for c in bad)
    )


def ce_bwd_variants(
    shapes=((32768, 4096), (32768, 16384), (32768, 65536), (4096, 262144)), budgets=(64, 32, 16)
):
    """Cross-entropy backward: elements per thread (``_TUNE["bwd_budget"]``); the row is
    split over CTAs without a cluster (no reduction in the backward)."""
    dt = torch.bfloat16
    for m, n in shapes:
        x = torch.randn(m, n, device="cuda", dtype=dt)
        t = torch.randint(0, n, (m,), device="cuda")
        dl = torch.rand(m, device="cuda")
        lse = torch.logsumexp(x.float(), -1)
        k = 256
        p = torch.softmax(x[:k].float(), -1) * dl[:k, None]
        p[torch.arange(k, device="cuda"), t[:k]] -= dl[:k]
        for b in budgets:
            cross_entropy._TUNE.clear()
            cross_entropy._TUNE.update(bwd_budget=b)
            try:
                fn = cross_entropy.compile_cross_entropy_bwd.raw("bfloat16", n)

                def call():
                    dx = torch.empty_like(x)
                    fn(x, t, dl, lse, dx, -100)
                    return dx

                ok = bool(torch.allclose(call()[:k].float(), p, atol=1e-2, rtol=1e-2))
                us = bench(call, reps=20)
                print(
                    f"cross_entropy_bwd {m}x{n:<7} budget={b:<3} {us:8.0f} us "
                    f"{(2 * m * n * 2 + 12 * m) / us / 1e6:5.2f} TB/s ok={ok}",
                    flush=True,
                )
            except Exception as e:  # noqa: BLE001
                print(
                    f"cross_entropy_bwd {m}x{n} budget={b} FAILED {type(e).__name__}: {str(e)[:300]}",
                    flush=True,
                )
        cross_entropy._TUNE.clear()
        del x
        torch.cuda.empty_cache()


def main():
    dt = torch.bfloat16
    only = sys.argv[1].split(",") if len(sys.argv) > 1 else None
    if only is not None and "cross_entropy_bwd" in only:
        ce_bwd_variants()
        if only == ["cross_entropy_bwd"]:
            return
    if only is not None and "cross_entropy_fwd" in only:
        ce_fwd_variants()
        if only == ["cross_entropy_fwd"]:
            return
    if only is None or "rmsnorm_bwd" in only:
        # grid None = the wrapper's (_bwd_grid); measured on the H200: one cluster of 8 / 16
        # less than SMs / cluster size (16 clusters of 8: 5720 us vs 15: 3383 us at 65536)
        old = dict(smem=False)
        rmsnorm_bwd_variants(
            [(32768, 65536)], [({}, None), (dict(stages=3), None), (dict(stages=2), None), (old, None)]
        )
        rmsnorm_bwd_variants([(4096, 262144)], [({}, None), (dict(smem_kb=192), None), (old, None)])
        rmsnorm_bwd_variants([(32768, 16384), (32768, 4096)], [({}, None), (old, None)])
    if only is not None and "fwd" not in only and "rmsnorm_fwd" not in only:
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
        n = x.shape[1]
        cfg = layernorm.fwd_ring_cfg("bfloat16", n, True, True, "same")
        fn(x, w, b, y, mean, rstd, 1e-5, layernorm.fwd_grid(x.shape[0], "bfloat16", n, cfg, x.device))
        return y

    def ln_check(a, y):
        x, w, b = a
        k = 512
        ref = F.layer_norm(x[:k].float(), (x.shape[1],), w.float(), b.float(), 1e-5)
        return bool(torch.allclose(y[:k].float(), ref, atol=6e-2, rtol=2e-2))

    ln_variants = [
        dict(ring=False, stage_wb=False),
        dict(ring=False, stage_wb=True, min_blocks=0),
        dict(ring=False, stage_wb=True, min_blocks=3),
        dict(ring=True),
    ]
    run(
        "layernorm_fwd",
        layernorm,
        lambda n: layernorm.compile_layernorm_fwd.raw("bfloat16", n, True, True),
        ln_variants if only is None or "fwd" in only else [],
        ln_setup,
        ln_call,
        ln_check,
        lambda m, n: 2 * m * n * 2 + 4 * n + 8 * m,
    )

    # RMSNorm forward
    def rms_setup(m, n):
        return rnd(m, n), rnd(n)

    def rms_call(fn, a):
        x, w = a
        y = torch.empty_like(x)
        rstd = torch.empty(x.shape[0], device="cuda")
        fn(
            x,
            w,
            None,
            None,
            y,
            None,
            rstd,
            1e-6,
            rmsnorm.fwd_grid(
                x.shape[0],
                "bfloat16",
                x.shape[1],
                rmsnorm.fwd_ring_cfg("bfloat16", x.shape[1], True, False, False, "same"),
                x.device,
            ),
        )
        return y

    def rms_check(a, y):
        x, w = a
        k = 512
        xf = x[:k].float()
        ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
        return bool(torch.allclose(y[:k].float(), ref, atol=6e-2, rtol=2e-2))

    run(
        "rmsnorm_fwd",
        rmsnorm,
        lambda n: rmsnorm.compile_rmsnorm_fwd.raw("bfloat16", n, True, False, False),
        [dict(ring=False), dict(ring=True), dict(ring=True, stages=2)],
        rms_setup,
        rms_call,
        rms_check,
        lambda m, n: 2 * m * n * 2 + 2 * n + 4 * m,
    )

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

    run(
        "cross_entropy_fwd",
        cross_entropy,
        lambda n: cross_entropy.compile_cross_entropy_fwd.raw("bfloat16", n),
        [dict(min_blocks=0), dict(min_blocks=4)] if only is None or "fwd" in only else [],
        ce_setup,
        ce_call,
        ce_check,
        lambda m, n: m * n * 2 + 16 * m,
    )


if __name__ == "__main__":
    main()
