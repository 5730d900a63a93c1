"""Issue 14 part 6, round 5 (engineer E): the softmax backward at 32768x4096, variants side
by side on the GPU in one process with torch.compile's kernel, and that kernel dumped.

The machinery is ``benchmarks/tune_k3b.py``'s (``.raw`` compiles with ``softmax._TUNE``
knobs, compiled ahead on the CPU with ``--compile-only`` and carried, each checked against
fp32 torch on 256 rows with the output poisoned first, timed like ``bench_kernels.py``:
``--allocs`` input sets side by side x ``--rounds`` rounds, every column on set k before
any on set k + 1, the order rotated, median of 20 with L2 flushed, a column's figure the
median of its medians). Beside our variants, two torch.compile columns in the same process:
``torch._softmax_backward_data`` (what bench_kernels.py compiles) and the formula
``y * (dy - sum(dy * y))`` in fp32; ``--dump DIR`` writes what Inductor chose for each
(its launch configuration, registers and the generated source: ``inductor.json``), while
``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` set by the caller keep the Triton
source, PTX and cubin.

Two sweeps (``--set``; knobs of ``kernels/softmax.py``: ``_bwd_plan``; the hints: ``kernels/_cachehint.py``):
``r1`` (the first call, with torch.compile's kernel dumped: ``DUMP=1 SET=r1
benchmarks/h200_k5e.sh``): cache hints on the loads of dy / y and the store of dx
(st.global.cs, L1::evict_first, ld.global.nc / .cs / .lu / .cg, an L2 evict-first policy),
64-bit accesses, 256 / 512 threads a row, dy / y re-read after the reduction (torch.compile's
looped reduction: evict_last, then evict_first) at 32768x4096, the hints at the other
shapes; ``r2`` (the default): torch.compile's kernel reproduced (``TRITON_CP``, with the L2
policy created in the kernel or a constant operand) and taken apart, at 32768x4096 / 8192
(the "small" class) and 16384 (the "mid" class). (8 CTAs / SM spills 64 B at 64 registers;
1024 threads at 2 CTAs / SM spills 104 B: not measured.)

Rule (``decide``): per class, the fastest correct variant of its group becomes the class's
knobs (``softmax.DEFAULTS``) when >= 1.5 % faster than the default; for the small class
(decided at 4096) only if it is also measured at 8192 and not > 0.5 % slower there than
that default. ``--apply`` rewrites the ``DEFAULTS`` line (``--apply-from FILE``: the
same edit from a ``--json`` file, on another checkout).

    python benchmarks/tune_k5e.py --compile-only --workdir DIR [--jobs 2]     # CPU machine
    python benchmarks/tune_k5e.py --workdir DIR [--set r2] [--json OUT] [--dump DIR] [--apply]
    python benchmarks/tune_k5e.py --apply-from decisions.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.tune_k3b import V, compile_all, compile_key, load  # noqa: E402

M = 32768
PEERS = ("sm_bwd_compile", "sm_bwd_formula")  # torch.compile columns: not compiled ahead
ST_CS = {"bwd_st": {"mode": "cs"}}
LD_EF = {"bwd_ld": {"evict": "first"}}
L2_EF = {"bwd_ld": {"l2": "evict_first"}, "bwd_st": {"l2": "evict_first"}}
TRITON = {"bwd_twopass": True, "bwd_ld": {"evict": "last"}, "bwd_ld2": {"evict": "first"}}
# torch.compile's kernel at 32768x4096 as dumped in round 5's first call (Inductor's looped
# reduction with one iteration: XBLOCK 1, R0_BLOCK 4096, 16 warps, 26 registers): the row
# over 512 threads, one 16-byte vector of dy and of y a thread loaded with
# L1::evict_last + an L2 evict_last policy (createpolicy), the sum, dy and y loaded again
# with L1::evict_first + an L2 evict_first policy, a plain st.global.v4 of dx
TRITON_CP = {
    "bwd_twopass": True,
    "bwd_tpr": 512,
    "bwd_ld": {"evict": "last", "l2": "cp:evict_last"},
    "bwd_ld2": {"evict": "first", "l2": "cp:evict_first"},
}
LD_EL2 = {"bwd_ld": {"evict": "last", "l2": "cp:evict_last"}}

# round 5's first sweep (label -> knobs at 32768x4096, the "small" class: 128 threads a row,
# 4 x 16 B of dy and of y a thread; the default's knobs are {}); ``--set r1``
ROUND1 = {
    "default": {},
    "st.cs": ST_CS,
    "st L2 evict_first": {"bwd_st": {"l2": "evict_first"}},
    "st L1 no_allocate": {"bwd_st": {"evict": "no_allocate"}},
    "ld L1 evict_first": LD_EF,
    "ld ef + st.cs": LD_EF | ST_CS,
    "ld.nc": {"bwd_ld": {"mode": "nc"}},
    "ld.nc + st.cs": {"bwd_ld": {"mode": "nc"}} | ST_CS,
    "ld.cs": {"bwd_ld": {"mode": "cs"}},
    "ld.lu": {"bwd_ld": {"mode": "lu"}},
    "ld.cg": {"bwd_ld": {"mode": "cg"}},
    "L2 evict_first ld+st": L2_EF,
    "64-bit": {"bwd_width": 32},
    "64-bit + st.cs": {"bwd_width": 32} | ST_CS,
    "512 thr": {"bwd_tpr": 512},
    "512 thr + st.cs": {"bwd_tpr": 512} | ST_CS,
    "512 thr 64-bit": {"bwd_tpr": 512, "bwd_width": 32},
    "256 thr + st.cs": {"bwd_budget": 16} | ST_CS,
    "twopass": {"bwd_twopass": True},
    "twopass el/ef": TRITON,
    "twopass el/ef + st.cs": TRITON | ST_CS,
    "twopass 512 thr": {"bwd_twopass": True, "bwd_tpr": 512},
    "twopass 512 el/ef": TRITON | {"bwd_tpr": 512},
    "512 thr ld ef + st.cs": {"bwd_tpr": 512} | LD_EF | ST_CS,
    "256 thr": {"bwd_budget": 16},
}
# the hint sets also measured at the other shapes in the first sweep
OTHERS = {"st.cs": ST_CS, "ld ef + st.cs": LD_EF | ST_CS, "L2 evict_first ld+st": L2_EF}
STORES = {"st.cs": ST_CS, "st L2 evict_first": {"bwd_st": {"l2": "evict_first"}}}

# the second sweep (``--set r2``, the default): torch.compile's kernel reproduced and its
# parts taken apart, at 4096 and 8192 (the small class) and 16384 (the mid class)
ROUND2 = {
    "default": {},
    "twopass 512 el/ef": TRITON | {"bwd_tpr": 512},
    "triton (cp)": TRITON_CP,
    "triton (const policy)": TRITON_CP
    | {"bwd_ld": {"evict": "last", "l2": "evict_last"}, "bwd_ld2": {"evict": "first", "l2": "evict_first"}},
    "triton 128 thr (cp)": {k: v for k, v in TRITON_CP.items() if k != "bwd_tpr"},
    "triton, ld2 L1 only": TRITON_CP | {"bwd_ld2": {"evict": "first"}},
    "triton, ld L1 only": TRITON_CP | {"bwd_ld": {"evict": "last"}},
    "512 thr ld el+L2 el": {"bwd_tpr": 512} | LD_EL2,
    "ld el": {"bwd_ld": {"evict": "last"}},
    "ld el+L2 el": LD_EL2,
    "ld L2 el": {"bwd_ld": {"l2": "cp:evict_last"}},
    "512 thr": {"bwd_tpr": 512},
}
MID = {"bwd_min_blocks": 4}  # DEFAULTS["mid"] (a _TUNE replaces DEFAULTS whole)
ROUND2_MID = {
    "default": MID,
    "triton 1024 thr (cp)": TRITON_CP | {"bwd_tpr": 1024},
    "triton 512 thr (cp)": TRITON_CP,
    "triton 256 thr mb4 (cp)": MID | {k: v for k, v in TRITON_CP.items() if k != "bwd_tpr"},
    "ld el+L2 el mb4": MID | LD_EL2,
    "ld el mb4": MID | {"bwd_ld": {"evict": "last"}},
}
# group -> (softmax.DEFAULTS class, the group whose default it must not lose to, if any)
CLASSES = {"sm_bwd 32768x4096": ("small", "sm_bwd 32768x8192"), "sm_bwd 32768x16384": ("mid", None)}


def peers(g, m, n, formula=False):
    out = [V(g, "torch.compile", "sm_bwd_compile", m, n)]
    if formula:
        out.append(V(g, "compile formula", "sm_bwd_formula", m, n))
    return out


def variants(which="r2"):
    out = []
    if which == "r1":
        g = "sm_bwd 32768x4096"
        out += [V(g, k, "sm_bwd", M, 4096, t) for k, t in ROUND1.items()] + peers(g, M, 4096, True)
        g = "sm_bwd 32768x16384"
        out += [V(g, "default", "sm_bwd", M, 16384, MID)]
        out += [V(g, k, "sm_bwd", M, 16384, MID | t) for k, t in OTHERS.items()]
        out += [V(g, "twopass el/ef", "sm_bwd", M, 16384, MID | TRITON)] + peers(g, M, 16384, True)
        for m, n in ((M, 65536), (4096, 262144)):
            g = f"sm_bwd {m}x{n}"
            out += [V(g, "default", "sm_bwd", m, n)]
            # (dy, y go through shared memory there: only the store's hints apply)
            out += [V(g, k, "sm_bwd", m, n, t) for k, t in STORES.items()] + peers(g, m, n)
        return out
    for n in (4096, 8192):
        g = f"sm_bwd 32768x{n}"
        out += [V(g, k, "sm_bwd", M, n, t) for k, t in ROUND2.items()] + peers(g, M, n)
    g = "sm_bwd 32768x16384"
    out += [V(g, k, "sm_bwd", M, 16384, t) for k, t in ROUND2_MID.items()] + peers(g, M, 16384)
    return out


# ----------------------------------------------------------------------------- torch.compile


def compiled_fn(kind):
    import torch

    if kind == "sm_bwd_compile":
        f = lambda dy, y: torch._softmax_backward_data(dy, y, -1, dy.dtype)  # noqa: E731
    else:

        def f(dy, y):
            yf, dyf = y.float(), dy.float()
            return (yf * (dyf - (dyf * yf).sum(-1, keepdim=True))).to(y.dtype)

    return torch.compile(f, dynamic=False)


def inductor_report():
    """Every Triton kernel Inductor launched in this process: its name, the configuration
    its autotuner kept (num_warps, num_stages, XBLOCK / R0_BLOCK), registers, spills,
    shared memory, and the kernel source (best effort: private Inductor objects)."""
    import gc

    out = []
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except Exception as e:  # noqa: BLE001
        return [{"error": f"{type(e).__name__}: {e}"}]
    for obj in gc.get_objects():
        try:  # (a dead weak proxy among the objects raises ReferenceError)
            if not isinstance(obj, CachingAutotuner):
                continue
        except ReferenceError:
            continue
        rec = {"name": getattr(obj, "fn", None).__name__ if getattr(obj, "fn", None) else "?"}
        try:
            rec["inductor_meta"] = {k: str(v) for k, v in (obj.inductor_meta or {}).items()}
            rec["triton_meta"] = {k: str(v) for k, v in (obj.triton_meta or {}).items()}
            rec["size_hints"] = str(getattr(obj, "size_hints", None))
            rec["configs"] = [str(c) for c in getattr(obj, "configs", None) or []]
            ls = []
            for lz in getattr(obj, "launchers", []) or []:
                ls.append(
                    {
                        "config": str(getattr(lz, "config", None)),
                        "n_regs": getattr(lz, "n_regs", None),
                        "n_spills": getattr(lz, "n_spills", None),
                        "shared": getattr(lz, "shared", None),
                        "cache_hash": str(getattr(lz, "cache_hash", None)),
                    }
                )
            rec["launchers"] = ls
            src = getattr(getattr(obj, "fn", None), "src", None)
            rec["src"] = src
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {e}"
        out.append(rec)
    return out


# ----------------------------------------------------------------------------- run


def run_group(name, vs, fns, peers, allocs, rounds, reps, results):
    import torch

    from benchmarks.bench_kernels import bench, median_of_medians
    from benchmarks.tune_k3b import _inputs, check, nbytes

    v0 = vs[0]
    m, n = v0["m"], v0["n"]
    sets = [_inputs("sm_bwd", m, n, seed=k) for k in range(allocs)]
    rows = torch.unique(torch.linspace(0, m - 1, 256, device="cuda").long())
    live = []
    for v in vs:
        if v["kern"] in PEERS:
            comp = peers.get((v["kern"], n))
            if comp is None:
                comp = peers[(v["kern"], n)] = compiled_fn(v["kern"])

            def call(a, comp=comp):
                return comp(a["dy"], a["y"])
        else:
            fn = fns.get(compile_key(v))
            if fn is None:
                results.append(dict(group=name, label=v["label"], tune=v["tune"], failed="compile"))
                print(f"{name:<20} {v['label']:<24} FAILED compile", flush=True)
                continue

            def call(a, fn=fn):
                fn(a["dy"], a["y"], a["out"])
                return a["out"]

        try:
            a = sets[0]
            a["out"].fill_(float("nan"))
            res = call(a)
            torch.cuda.synchronize()
            a2 = dict(a, out=res)
            ok = check(dict(v, kern="sm_bwd"), a2, rows)
        except Exception as e:  # noqa: BLE001 - one failing variant must not cost the others
            results.append(
                dict(group=name, label=v["label"], tune=v["tune"], failed=f"{type(e).__name__}: {e}"[:300])
            )
            print(f"{name:<20} {v['label']:<24} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        live.append((v, call, ok))
    meds = {v["label"]: [] for v, _, _ in live}
    for r in range(rounds):
        for k, a in enumerate(sets):
            shift = (r * allocs + k) % max(1, len(live))
            for v, call, _ok in live[shift:] + live[:shift]:
                meds[v["label"]].append(bench(lambda call=call, a=a: call(a), reps=reps))
    nb = nbytes("sm_bwd", m, n)
    base = None
    for v, _call, ok in live:
        us = median_of_medians(meds[v["label"]])
        base = base or us
        results.append(
            dict(
                group=name,
                label=v["label"],
                tune=v["tune"],
                us=us,
                medians=meds[v["label"]],
                tbs=nb / us / 1e6,
                ok=ok,
            )
        )
        spread = " / ".join(f"{t:.0f}" for t in meds[v["label"]])
        print(
            f"{name:<20} {v['label']:<24} {us:8.1f} us {nb / us / 1e6:5.2f} TB/s {base / us:6.3f}x ok={ok}  ({spread})",
            flush=True,
        )
    del sets
    torch.cuda.empty_cache()


def decide(results, threshold=0.985, guard=1.005):
    """{class: knobs} to adopt and the reasons: per class, the fastest correct variant of its
    group (torch.compile columns are peers, never adopted) when it is >= 1.5 % faster than
    the group's default and, where the class has a guard group, measured there and not
    > 0.5 % slower than that group's default."""
    by: dict = {}
    for r in results:
        if "us" in r and r.get("ok") and not r["label"].startswith(("torch.compile", "compile ")):
            by.setdefault(r["group"], {})[r["label"]] = r
    adopt, why = {}, []
    for group, (cls, guard_group) in CLASSES.items():
        rs = by.get(group, {})
        base = rs.get("default")
        if base is None:
            why.append(f"{group}: no correct default measured -> keep")
            continue
        gs = by.get(guard_group, {}) if guard_group else None
        chosen = None
        for r in sorted(rs.values(), key=lambda r: r["us"]):
            if r["label"] == "default" or r["us"] / base["us"] > threshold:
                break
            if gs is not None:
                g = gs.get(r["label"])
                if g is None or "default" not in gs or g["us"] / gs["default"]["us"] > guard:
                    why.append(f"{group}: {r['label']} {r['us']:.1f} us fails the guard at {guard_group}")
                    continue
            chosen = r
            break
        best = min(rs.values(), key=lambda r: r["us"])
        why.append(
            f"{group}: default {base['us']:.1f} us, best {best['label']} {best['us']:.1f} us "
            f"({best['us'] / base['us']:.3f}) -> "
            + (f"adopt {chosen['label']} {json.dumps(chosen['tune'], sort_keys=True)}" if chosen else "keep")
        )
        if chosen:
            adopt[cls] = chosen["tune"]
    return adopt, why


def apply_classes(adopt, root: Path):
    """Rewrite softmax's ``DEFAULTS`` line with the adopted knobs of each class (a budget
    goes to ``BWD_BUDGET_*``: tune_k3b.apply's rewrite)."""
    import re

    from benchmarks.tune_k3b import apply

    text = (root / "kernels/softmax.py").read_text()
    line = re.search(r"^DEFAULTS: dict = (.*)$", text, flags=re.M).group(1)
    cur = eval(line, {"True": True, "False": False})  # noqa: S307 - our own source line
    for cls, tune in adopt.items():
        cur[cls] = dict(tune)
    apply({"kernels/softmax.py": cur}, root)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--allocs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dump", default=None, help="write Inductor's kernels (inductor.json) here")
    ap.add_argument("--apply", action="store_true")
    ap.add_argument("--apply-from", default=None, help="apply the decision of a --json file instead")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--workdir", default="/tmp/tune_k5e")
    ap.add_argument("--groups", default=None)
    ap.add_argument("--set", default="r2", choices=("r1", "r2"), help="the first or second sweep")
    args = ap.parse_args()
    if args.apply_from:
        adopt = json.loads(Path(args.apply_from).read_text())["adopt"]
        if adopt:
            apply_classes(adopt, ROOT)
        return
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    vs = variants(args.set)
    if args.groups:
        keep = set(args.groups.split(","))
        vs = [v for v in vs if v["group"] in keep]
    wd = Path(args.workdir)
    ours = [v for v in vs if v["kern"] not in PEERS]
    errors = compile_all(ours, wd, args.jobs)
    for k, e in errors.items():
        print(f"compile {k} failed: {e}", flush=True)
    if args.compile_only:
        return
    import torch

    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    fns, mods = {}, []
    for v in ours:
        k = compile_key(v)
        if k in fns or k in errors:
            continue
        try:
            fn, mod = load(wd / f"{k}.o")
        except Exception as e:  # noqa: BLE001
            print(f"load {k} ({v['label']}) failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        fns[k] = fn
        mods.append(mod)
    results: list = []
    peers: dict = {}
    groups: dict = {}
    for v in vs:
        groups.setdefault(v["group"], []).append(v)
    for name, gvs in groups.items():
        t0 = time.time()
        run_group(name, gvs, fns, peers, args.allocs, args.rounds, args.reps, results)
        print(f"[{name}: {time.time() - t0:.1f} s]", flush=True)
    if args.dump:
        rep = inductor_report()
        Path(args.dump).mkdir(parents=True, exist_ok=True)
        Path(args.dump, "inductor.json").write_text(json.dumps(rep, indent=1))
        for r in rep:
            print("inductor:", r.get("name"), r.get("launchers"), flush=True)
    adopt, why = decide(results)
    for line in why:
        print("decide:", line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(results=results, adopt=adopt, why=why), indent=1))
    if args.apply and adopt:
        apply_classes(adopt, ROOT)


if __name__ == "__main__":
    main()
