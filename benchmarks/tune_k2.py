"""Issue 14 part 6, round 2: the large-row variants side by side on the GPU, decided by rule.

Every variant (a compile-time ``_TUNE`` knob set, and for the ring forward a grid) is
compiled first, in parallel worker processes (``.raw``, exported to a ``.o``), then loaded
here, checked against fp32 torch on 256 rows spread over the batch (outputs poisoned with
NaN first, and finite everywhere), and timed like bench_kernels.py (bf16 rows, L2 flushed,
median of 20), each group's variants interleaved over ``--rounds`` rounds (mean of the
medians). Groups (bf16 rows, TB/s):

- the ring forward (``quack_kernels._norm_fwd``) at clusters of 4 (32768x65536) and 8
  (8192x131072) vs one row tile per CTA, with the grid from the driver's occupancy
  calculator ("api") and smaller ones; RMSNorm with fp32 weights, LayerNorm with bf16 and
  fp32 weight / bias;
- the ring's wide-weight shared-memory layout (``wide_perm``) and 227 KiB budget (a third
  x stage for LayerNorm with fp32 weight / bias) at 65536 / 131072 / 262144;
- the norm backward's wide-weight layout (``w_perm``), fp32 w at 4096x262144;
- the softmax backward's per-thread budget at 32768x4096 / 32768x16384;
- for information: RMSNorm same-dtype at 262144 (min_blocks, ring), at 65536 (ring).

The rules (``decide``) turn the timings into the kernels' defaults (``apply`` rewrites the
``NAME = value`` lines of kernels/_norm_fwd.py, _norm_bwd.py, softmax.py): a layout or
budget flag is adopted when it is >= 1 % faster on its pairs' mean and never > 1 % slower;
the ring for a cluster size when it is >= 2 % faster than one row tile per CTA there and
not slower at the larger cluster size; a softmax budget when >= 1.5 % faster.

    python benchmarks/tune_k2.py [--jobs 16] [--rounds 2] [--json OUT] [--apply]
    python benchmarks/tune_k2.py --apply-from decisions.json   # the same edits elsewhere
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

M65, N65 = 32768, 65536
M131, N131 = 8192, 131072
M262, N262 = 4096, 262144
BF = "bfloat16"
W32 = "float32"

PLAIN = {"wide_perm": False, "smem_kb": 220}
PERM = {"wide_perm": True, "smem_kb": 220}
BIG = {"wide_perm": False, "smem_kb": 227}
PERM_BIG = {"wide_perm": True, "smem_kb": 227}


def V(group, label, kern, m, n, wdt="same", tune=None, grid=None):
    return dict(group=group, label=label, kern=kern, m=m, n=n, wdt=wdt, tune=dict(tune or {}), grid=grid)


def variants():
    out = []
    r4 = {"ring_min_cluster": 4}
    r8 = {"ring_min_cluster": 8}
    # clusters of 4 (N = 65536)
    g = "rms_w32 65536"
    out += [V(g, "rowtile", "rms_fwd", M65, N65, W32, {"ring": False})]
    out += [
        V(g, f"ring@{gr}", "rms_fwd", M65, N65, W32, {**r4, **PLAIN}, gr)
        for gr in ("api", "api-1", "api-2", 28)
    ]
    out += [V(g, "ring+perm@api", "rms_fwd", M65, N65, W32, {**r4, **PERM}, "api")]
    g = "ln 65536"
    out += [V(g, "rowtile", "ln_fwd", M65, N65, "same", {"ring": False})]
    out += [
        V(g, f"ring@{gr}", "ln_fwd", M65, N65, "same", {**r4, **PLAIN}, gr)
        for gr in ("api", "api-1", "api-2", 28)
    ]
    g = "ln_w32 65536"
    out += [V(g, "rowtile", "ln_fwd", M65, N65, W32, {"ring": False})]
    out += [V(g, f"ring@{gr}", "ln_fwd", M65, N65, W32, {**r4, **PLAIN}, gr) for gr in ("api", "api-1", 28)]
    out += [
        V(g, "ring+perm@api", "ln_fwd", M65, N65, W32, {**r4, **PERM}, "api"),
        V(g, "ring+big@api", "ln_fwd", M65, N65, W32, {**r4, **BIG}, "api"),
        V(g, "ring+perm+big@api", "ln_fwd", M65, N65, W32, {**r4, **PERM_BIG}, "api"),
    ]
    g = "rms 65536 (info)"
    out += [
        V(g, "rowtile", "rms_fwd", M65, N65, "same", {}),
        V(g, "ring@api", "rms_fwd", M65, N65, "same", {**r4, "ring_same": True}, "api"),
    ]
    # clusters of 8 (N = 131072)
    g = "rms_w32 131072"
    out += [
        V(g, "rowtile", "rms_fwd", M131, N131, W32, {"ring": False}),
        V(g, "ring@api", "rms_fwd", M131, N131, W32, {**r8, **PLAIN}, "api"),
        V(g, "ring+perm@api", "rms_fwd", M131, N131, W32, {**r8, **PERM}, "api"),
    ]
    g = "ln 131072"
    out += [
        V(g, "rowtile", "ln_fwd", M131, N131, "same", {"ring": False}),
        V(g, "ring@api", "ln_fwd", M131, N131, "same", {**r8, **PLAIN}, "api"),
    ]
    g = "ln_w32 131072"
    out += [
        V(g, "rowtile", "ln_fwd", M131, N131, W32, {"ring": False}),
        V(g, "ring@api", "ln_fwd", M131, N131, W32, {**r8, **PLAIN}, "api"),
        V(g, "ring+perm+big@api", "ln_fwd", M131, N131, W32, {**r8, **PERM_BIG}, "api"),
    ]
    # clusters of 16 (N = 262144): the ring is on there already
    g = "rms_w32 262144"
    out += [
        V(g, "ring@api", "rms_fwd", M262, N262, W32, PLAIN, "api"),
        V(g, "ring@7", "rms_fwd", M262, N262, W32, PLAIN, 7),
        V(g, "ring+perm@api", "rms_fwd", M262, N262, W32, PERM, "api"),
    ]
    g = "ln 262144"
    out += [
        V(g, "ring@api", "ln_fwd", M262, N262, "same", PLAIN, "api"),
        V(g, "ring@7", "ln_fwd", M262, N262, "same", PLAIN, 7),
    ]
    g = "ln_w32 262144"
    out += [
        V(g, "ring@api", "ln_fwd", M262, N262, W32, PLAIN, "api"),
        V(g, "ring+perm@api", "ln_fwd", M262, N262, W32, PERM, "api"),
        V(g, "ring+big@api", "ln_fwd", M262, N262, W32, BIG, "api"),
        V(g, "ring+perm+big@api", "ln_fwd", M262, N262, W32, PERM_BIG, "api"),
    ]
    g = "rms 262144 (info)"
    out += [
        V(g, "rowtile mb3", "rms_fwd", M262, N262, "same", {}),
        V(g, "rowtile mb2", "rms_fwd", M262, N262, "same", {"min_blocks": 2}),
        V(g, "rowtile mb4", "rms_fwd", M262, N262, "same", {"min_blocks": 4}),
        V(g, "ring@api", "rms_fwd", M262, N262, "same", {"ring_same": True, **PLAIN}, "api"),
    ]
    # norm backward, fp32 weight in shared memory
    g = "ln_bwd_w32 262144"
    out += [
        V(g, "w_smem", "ln_bwd", M262, N262, W32, {"w_perm": False}),
        V(g, "w_smem+perm", "ln_bwd", M262, N262, W32, {"w_perm": True}),
        V(g, "same-dtype w (info)", "ln_bwd", M262, N262, "same", {}),
    ]
    g = "rms_bwd_w32 262144"
    out += [
        V(g, "w_smem", "rms_bwd", M262, N262, W32, {"w_perm": False}),
        V(g, "w_smem+perm", "rms_bwd", M262, N262, W32, {"w_perm": True}),
    ]
    # softmax backward budgets
    for n in (4096, 16384):
        g = f"sm_bwd {n}"
        out += [V(g, f"budget{b}", "sm_bwd", 32768, n, "same", {"bwd_budget": b}) for b in (32, 16, 64)]
    return out


# ----------------------------------------------------------------------------- compile


def _module(kern):
    from quack_kernels import layernorm, rmsnorm, softmax

    return {
        "rms_fwd": (rmsnorm, "_TUNE"),
        "rms_bwd": (rmsnorm, "_TUNE"),
        "ln_fwd": (layernorm, "_TUNE"),
        "ln_bwd": (layernorm, "_BWD_TUNE"),
        "sm_bwd": (softmax, "_TUNE"),
    }[kern]


def _raw(kern, n, wdt):
    from quack_kernels import layernorm, rmsnorm, softmax

    if kern == "rms_fwd":
        return rmsnorm.compile_rmsnorm_fwd.raw(BF, n, True, False, False, wdt)
    if kern == "rms_bwd":
        return rmsnorm.compile_rmsnorm_bwd.raw(BF, n, True, False, wdt)
    if kern == "ln_fwd":
        return layernorm.compile_layernorm_fwd.raw(BF, n, True, True, wdt)
    if kern == "ln_bwd":
        return layernorm.compile_layernorm_bwd.raw(BF, n, True, True, wdt)
    return softmax.compile_softmax_bwd.raw(BF, n)


def compile_key(v) -> str:
    text = json.dumps([v["kern"], v["n"], v["wdt"], v["tune"]], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _compile_job(job):
    """Worker: compile one variant with its knobs and export it (``quack``'s .o format)."""
    kern, n, wdt, tune, path = job
    t0 = time.time()
    try:
        mod, attr = _module(kern)
        knobs = getattr(mod, attr)
        knobs.clear()
        knobs.update(tune)
        try:
            compiled = _raw(kern, n, wdt)
        finally:
            knobs.clear()
        compiled.export_to_c(object_file_path=path, function_name="func")
        return path, time.time() - t0, None
    except Exception as e:  # noqa: BLE001 - one failing variant must not cost the others
        return path, time.time() - t0, f"{type(e).__name__}: {str(e)[:300]}"


def compile_all(vs, outdir: Path, jobs: int):
    import concurrent.futures as cf
    import multiprocessing as mp

    outdir.mkdir(parents=True, exist_ok=True)
    todo = {}
    for v in vs:
        todo.setdefault(
            compile_key(v), (v["kern"], v["n"], v["wdt"], v["tune"], str(outdir / f"{compile_key(v)}.o"))
        )
    errors = {}
    t0 = time.time()
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as ex:
        for path, _secs, err in ex.map(_compile_job, todo.values()):
            if err:
                errors[Path(path).stem] = err
    print(f"[compiled {len(todo)} variants in {time.time() - t0:.1f} s, {len(errors)} failed]", flush=True)
    return errors


def load(path: Path):
    from quack.runtime import loader

    so = path.with_suffix(".so")
    try:
        loader.link(path, so, path.parent)
        return loader.load_so(so)
    except Exception:  # noqa: BLE001 - no C compiler: CuTe DSL's own loader
        return loader.load_object(path)


# ----------------------------------------------------------------------------- run


def _with_tune(kern, tune, fn):
    mod, attr = _module(kern)
    knobs = getattr(mod, attr)
    knobs.clear()
    knobs.update(tune)
    try:
        return fn()
    finally:
        knobs.clear()


def ring_grid_of(v, device):
    """(grid, api grid) of a forward variant: the wrapper's grid with the variant's knobs
    (the occupancy calculator's for a ring), then "api-k" / a fixed int applied."""
    from quack_kernels import layernorm, rmsnorm

    def wrapper_grid():
        if v["kern"] == "rms_fwd":
            cfg = rmsnorm.fwd_ring_cfg(BF, v["n"], True, False, False, v["wdt"])
            return rmsnorm.fwd_grid(v["m"], BF, v["n"], cfg, device), cfg
        cfg = layernorm.fwd_ring_cfg(BF, v["n"], True, True, v["wdt"])
        return layernorm.fwd_grid(v["m"], BF, v["n"], cfg, device), cfg

    api, cfg = _with_tune(v["kern"], v["tune"], wrapper_grid)
    gr = v["grid"]
    if gr is None or gr == "api" or cfg is None:
        return api, api, cfg
    if isinstance(gr, str) and gr.startswith("api-"):
        return max(1, api - int(gr[4:])), api, cfg
    return int(gr), api, cfg


def time_groups(vs, wd: Path, rounds: int, failed=()) -> list:
    """Load each variant's object from ``wd`` (none for a key in ``failed``, whose compile
    failed -- a file there would be an earlier run's -- or without a file: its group
    reports it) and time every group (``run_group``) in the variants' order; the results."""
    fns, mods = {}, []  # the modules stay referenced while their functions run
    for v in vs:
        k = compile_key(v)
        p = wd / f"{k}.o"
        if k not in fns and k not in failed and p.exists():
            fns[k], mod = load(p)
            mods.append(mod)
    results: list = []
    groups: dict = {}
    for v in vs:
        groups.setdefault(v["group"], []).append(v)
    for name, gvs in groups.items():
        t0 = time.time()
        run_group(name, gvs, fns, rounds, results)
        print(f"[{name}: {time.time() - t0:.1f} s]", flush=True)
    return results


def run_group(name, vs, fns, rounds, results):
    import torch
    import torch.nn.functional as F
    from quack_kernels._norm_bwd import run_norm_bwd

    from benchmarks.bench_kernels import bench

    v0 = vs[0]
    m, n, kern0 = v0["m"], v0["n"], v0["kern"]
    dev = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.unique(torch.linspace(0, m - 1, 256, device=dev).long())
    x = torch.randn(m, n, device=dev, dtype=torch.bfloat16, generator=g) + 0.5
    out = torch.empty_like(x)
    mean = torch.empty(m, device=dev)
    rstd = torch.empty(m, device=dev)
    weights = {}
    for wname in {v["wdt"] for v in vs}:
        wdt = torch.float32 if wname == W32 else torch.bfloat16
        weights[wname] = (
            torch.randn(n, device=dev, generator=g).to(wdt),
            torch.randn(n, device=dev, generator=g).to(wdt),
        )
    dy = None
    if kern0 in ("ln_bwd", "rms_bwd", "sm_bwd"):
        dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16, generator=g)
    if kern0 == "sm_bwd":
        x = torch.softmax(x.float(), -1).to(torch.bfloat16)  # y
    if kern0 in ("ln_bwd", "rms_bwd"):
        for i in range(0, m, 1024):
            xf = x[i : i + 1024].float()
            mean[i : i + 1024] = xf.mean(-1) if kern0 == "ln_bwd" else 0.0
            var = xf.var(-1, unbiased=False) if kern0 == "ln_bwd" else xf.pow(2).mean(-1)
            rstd[i : i + 1024] = torch.rsqrt(var + (1e-5 if kern0 == "ln_bwd" else 1e-6))

    def reference(v):
        w, b = weights[v["wdt"]]
        xf = x[rows].float()
        if v["kern"] == "rms_fwd":
            return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
        if v["kern"] == "ln_fwd":
            return F.layer_norm(xf, (n,), w.float(), b.float(), 1e-5)
        dyf = dy[rows].float()
        if v["kern"] == "sm_bwd":
            return xf * (dyf - (xf * dyf).sum(-1, keepdim=True))
        xr = xf.clone().requires_grad_()
        if v["kern"] == "ln_bwd":
            F.layer_norm(xr, (n,), w.float(), b.float(), 1e-5).backward(dyf)
        else:
            (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).backward(dyf)
        return xr.grad

    calls = {}
    for v in vs:
        key = v["label"]
        if fns.get(compile_key(v)) is None:
            results.append(dict(group=name, label=key, tune=v["tune"], failed="compile"))
            print(f"{name:<20} {key:<22} FAILED compile", flush=True)
            continue
        fn = fns[compile_key(v)]
        w, b = weights[v["wdt"]]
        grid = api = None
        if v["kern"] == "rms_fwd":
            grid, api, _ = ring_grid_of(v, dev)

            def call(fn=fn, w=w, grid=grid):
                fn(x, w, None, None, out, None, rstd, 1e-6, grid)
                return out
        elif v["kern"] == "ln_fwd":
            grid, api, _ = ring_grid_of(v, dev)

            def call(fn=fn, w=w, b=b, grid=grid):
                fn(x, w, b, out, mean, rstd, 1e-5, grid)
                return out
        elif v["kern"] == "sm_bwd":

            def call(fn=fn):
                fn(dy, x, out)
                return out
        else:
            kind = "layer" if v["kern"] == "ln_bwd" else "rms"
            tune = v["tune"]

            def call(fn=fn, w=w, b=b, kind=kind, tune=tune):
                return run_norm_bwd(
                    kind,
                    lambda *a: fn,
                    x,
                    w,
                    dy,
                    mean if kind == "layer" else None,
                    rstd,
                    b.dtype if kind == "layer" else None,
                    tune,
                )[0]

        try:
            out.fill_(float("nan"))
            res = call()
            torch.cuda.synchronize()
            tol = 6e-2 if v["kern"] in ("rms_fwd", "ln_fwd") else 3e-2
            ok = bool(torch.isfinite(res).all()) and bool(
                torch.allclose(res[rows].float(), reference(v), atol=tol, rtol=tol)
            )
        except Exception as e:  # noqa: BLE001
            results.append(
                dict(group=name, label=key, tune=v["tune"], failed=f"{type(e).__name__}: {e}"[:300])
            )
            print(f"{name:<20} {key:<22} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        calls[key] = (v, call, ok, grid, api)
    es = {W32: 4, "same": 2}
    times = {k: [] for k in calls}
    for _ in range(rounds):
        for k, entry in calls.items():
            times[k].append(bench(entry[1], reps=20))
    for k, (v, _call, ok, grid, api) in calls.items():
        us = sum(times[k]) / len(times[k])
        kern = v["kern"]
        e = es[v["wdt"]]
        if kern in ("rms_fwd", "ln_fwd"):
            nb = 2 * m * n * 2 + (2 if kern == "ln_fwd" else 1) * n * e + (8 if kern == "ln_fwd" else 4) * m
        elif kern == "sm_bwd":
            nb = 3 * m * n * 2
        else:
            nb = 3 * m * n * 2 + 4 * n * e + 8 * m
        tbs = nb / us / 1e6
        results.append(
            dict(
                group=name,
                label=k,
                tune=v["tune"],
                grid=grid,
                api=api,
                us=us,
                rounds=times[k],
                tbs=tbs,
                ok=ok,
            )
        )
        gtxt = f"grid {grid} (api {api})" if grid is not None else ""
        rtxt = " / ".join(f"{t:.0f}" for t in times[k])
        print(f"{name:<20} {k:<22} {gtxt:<18} {us:8.0f} us ({rtxt}) {tbs:5.2f} TB/s ok={ok}", flush=True)
    del x, out, dy
    torch.cuda.empty_cache()


def occupancy_report():
    import torch
    from quack_kernels import _occupancy
    from quack_kernels import _torch as kt

    sms = kt.sm_count(torch.device("cuda"))
    for cl in (2, 4, 8, 16):
        for smem in (100 * 1024, 200 * 1024, 226 * 1024):
            try:
                got = _occupancy.query_max_active_clusters(0, cl, 256, smem)
            except Exception as e:  # noqa: BLE001
                got = f"{type(e).__name__}: {e}"
            print(
                f"occupancy: clusters of {cl:>2} x 256 threads, {smem // 1024} KiB: {got} (SMs {sms})",
                flush=True,
            )


# ----------------------------------------------------------------------------- decide


def decide(results):
    """The kernels' defaults from the timings (see the module docstring), with the reasons."""
    t = {(r["group"], r["label"]): r for r in results if "us" in r and r.get("ok")}
    why = []

    def us(g, label):
        r = t.get((g, label))
        return r["us"] if r else None

    def ratios(pairs):
        out = []
        for g, a, b in pairs:
            ua, ub = us(g, a), us(g, b)
            if ua and ub:
                out.append(ub / ua)
        return out

    def adopt(pairs, name):
        rs = ratios(pairs)
        ok = bool(rs) and sum(rs) / len(rs) <= 0.99 and max(rs) <= 1.01
        why.append(
            f"{name}: candidate/base ratios {[round(r, 3) for r in rs]} -> {'adopt' if ok else 'keep'}"
        )
        return ok

    # per kind: the layout changes how RMSNorm's one and LayerNorm's two wide vectors share
    # the shared-memory bandwidth with the x ring
    wide_perm = {
        "rms": adopt(
            [
                ("rms_w32 65536", "ring@api", "ring+perm@api"),
                ("rms_w32 131072", "ring@api", "ring+perm@api"),
                ("rms_w32 262144", "ring@api", "ring+perm@api"),
            ],
            "ring wide_perm rms",
        ),
        "layer": adopt(
            [
                ("ln_w32 65536", "ring@api", "ring+perm@api"),
                ("ln_w32 65536", "ring+big@api", "ring+perm+big@api"),
                ("ln_w32 262144", "ring@api", "ring+perm@api"),
                ("ln_w32 262144", "ring+big@api", "ring+perm+big@api"),
            ],
            "ring wide_perm layer",
        ),
    }
    pb = "ring+perm" if wide_perm["layer"] else "ring"
    big = adopt(
        [
            ("ln_w32 65536", f"{pb}@api", f"{pb}+big@api"),
            ("ln_w32 262144", f"{pb}@api", f"{pb}+big@api"),
        ],
        "ring smem 227 KiB",
    )

    def best(g, wide):
        if not wide:
            return "ring@api"
        perm = wide_perm["layer" if g.startswith("ln") else "rms"]
        label = (
            "ring" + ("+perm" if perm else "") + ("+big" if big and g.startswith("ln_w32") else "") + "@api"
        )
        if us(g, label) is None and g.startswith("ln_w32 131072"):
            # measured there: plain, and perm + big
            label = "ring+perm+big@api" if perm else "ring@api"
        return label

    def ring_wins(g, wide, pct):
        b, r = us(g, "rowtile"), us(g, best(g, wide))
        return bool(b and r and r <= b * (1 - pct / 100)), (b, r)

    def not_slower(g, wide):
        b, r = us(g, "rowtile"), us(g, best(g, wide))
        return bool(b and r and r <= b * 1.01)

    min_cluster = {}
    for key, g4, g8, wide in (
        ("rms_wide", "rms_w32 65536", "rms_w32 131072", True),
        ("layer", "ln 65536", "ln 131072", False),
        ("layer_wide", "ln_w32 65536", "ln_w32 131072", True),
    ):
        w4, t4 = ring_wins(g4, wide, 2)
        w8, t8 = ring_wins(g8, wide, 2)
        if w4 and not_slower(g8, wide):
            min_cluster[key] = 4
        elif w8:
            min_cluster[key] = 8
        else:
            min_cluster[key] = 16
        why.append(f"ring {key}: rowtile/ring us 65536 {t4}, 131072 {t8} -> min cluster {min_cluster[key]}")
    w_perm = adopt(
        [
            ("ln_bwd_w32 262144", "w_smem", "w_smem+perm"),
            ("rms_bwd_w32 262144", "w_smem", "w_smem+perm"),
        ],
        "bwd w_perm",
    )
    budgets = {}
    for n, name in ((4096, "BWD_BUDGET_SMALL"), (16384, "BWD_BUDGET_MID")):
        g = f"sm_bwd {n}"
        base = us(g, "budget32")
        pick = 32
        for b in (16, 64):
            u = us(g, f"budget{b}")
            if base and u and u <= base * 0.985 and (pick == 32 or u < us(g, f"budget{pick}")):
                pick = b
        budgets[name] = pick
        why.append(
            f"softmax bwd {n}: budget 32/16/64 us {[us(g, f'budget{b}') for b in (32, 16, 64)]} -> {pick}"
        )
    edits = {
        "kernels/_norm_fwd.py": {
            "RING_MIN_CLUSTER": min_cluster,
            "RING_SMEM_KB": 227 if big else 220,
            "WIDE_PERM": wide_perm,
        },
        "kernels/_norm_bwd.py": {"W_PERM": w_perm},
        "kernels/softmax.py": budgets,
    }
    return edits, why


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, dict):
        return "{" + ", ".join(f'"{k}": {_fmt(x)}' for k, x in v.items()) + "}"
    return str(int(v))


def apply(edits, root: Path):
    """Rewrite each ``NAME = value`` line (at the start of a line) of the named files."""
    for rel, names in edits.items():
        p = root / rel
        text = p.read_text()
        for name, value in names.items():
            text, k = re.subn(rf"^{name} = .*$", f"{name} = {_fmt(value)}", text, count=1, flags=re.M)
            if k != 1:
                raise SystemExit(f"{rel}: no line '{name} = ...' to rewrite")
        p.write_text(text)
        print(f"{rel}: sha256 {hashlib.sha256(p.read_bytes()).hexdigest()[:16]}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--apply", action="store_true", help="rewrite the kernels' defaults by the rules")
    ap.add_argument("--apply-from", default=None, help="apply the edits of a --json file instead")
    ap.add_argument("--workdir", default="/tmp/tune_k2")
    ap.add_argument("--groups", default=None, help="comma-separated group names (default: all)")
    args = ap.parse_args()
    if args.apply_from:
        apply(json.loads(Path(args.apply_from).read_text())["edits"], ROOT)
        return
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    vs = variants()
    if args.groups:
        keep = set(args.groups.split(","))
        vs = [v for v in vs if v["group"] in keep]
    wd = Path(args.workdir)
    errors = compile_all(vs, wd, args.jobs)
    for k, e in errors.items():
        print(f"compile {k} failed: {e}", flush=True)
    import torch

    print(torch.cuda.get_device_name(), flush=True)
    occupancy_report()
    results = time_groups(vs, wd, args.rounds, failed=errors)
    edits, why = decide(results)
    for line in why:
        print("decide:", line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(results=results, edits=edits, why=why), indent=1))
    if args.apply:
        apply(edits, ROOT)


if __name__ == "__main__":
    main()
