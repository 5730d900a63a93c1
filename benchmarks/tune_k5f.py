"""Issue 14 part 6, round 5 (engineer F): the mixed-precision norms (fp32 weight / bias beside
bf16 x) against the same-dtype kernels, variants side by side on the GPU in ONE process,
decided by rule (the machinery of ``benchmarks/tune_k2.py``: ``.raw`` compiles with the
modules' ``_TUNE`` knobs in parallel workers, each checked against fp32 torch on 256 rows
plus finiteness, timed interleaved, ``--rounds`` rounds of a median of 20, L2 flushed).

Groups (bf16 x, TB/s), each with the same-dtype default and the fp32-w default beside the
fp32-w candidates:

- ``rms_w32 65536`` / ``rms_w32 262144``: RMSNorm fwd, ``rmsnorm.WIDE_VARIANTS`` (the row
  tile with the fp32 weight cp.async'ed into shared memory in 16-byte chunks, x through
  shared memory with the weight from L2 or registers, L1-keeping carveouts, the ring's
  shape at clusters of 16);
- ``ln_w32 16384``: LayerNorm fwd, round 4's ``xs`` kernel at 2-5 CTAs / SM with the
  shared-memory carveout that leaves L1 the fp32 w + b (128 KiB), and ``xs2``: two rows a
  CTA with w / b read once for both (``_norm_fwd.xs_rows_kernel``; also for RMSNorm);
- ``ln_w32 65536`` / ``ln_w32 262144``: LayerNorm fwd, ``xs`` on rows over a cluster in
  place of the ring (same dtype and fp32 w + b);
- ``rms_bwd_w32 4096``: RMSNorm bwd, the fp32 weight in shared memory (read per use) on
  rows of one CTA;
- ``rms_w32 4096 / 16384``, ``ln_w32 4096``: the defaults only, for the record.

Rules (``decide``): in each group the fastest correct candidate of a weight kind becomes
that kind's default for the group's plan class when it is >= 1.5 % faster than the kind's
current default (the tables are keyed by the default plan's cluster size, so a decision
changes no kernel of another class: the other shapes' PTX is unchanged). Rewrites
``rmsnorm.WIDE_FWD``, ``_ln_row.ROW_CTA`` / ``ROW_CLUSTER`` and
``_norm_bwd.W_SMEM_WIDE_ONE_CTA``.

    python benchmarks/tune_k5f.py [--jobs 16] [--rounds 3] [--json OUT] [--apply]
    python benchmarks/tune_k5f.py --apply-from decisions.json
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

from benchmarks.tune_k2 import V, compile_all, compile_key, load, run_group  # noqa: E402
from benchmarks.tune_k3 import apply  # noqa: E402

W32 = "float32"
RMS_WIDE = {
    65536: (
        "rt sw mb3",
        "rt swp mb3",
        "rt swp mb2",
        "xs late mb4",
        "xs late mb4 c72",
        "xs late mb3 c44",
        "xs wregs mb2",
        "xs2 mb3",
        "xs2 mb2",
        "xs2j mb3",
        "xs3 mb2",
    ),
    262144: (
        "xs2 mb3",
        "xs2 mb2",
        "xs2j mb3",
        "xs2j mb2",
        "rt sw mb3",
        "rt swp mb3",
        "rt swp mb2",
        "xs late mb4",
        "xs late mb4 c72",
        "xs late mb3 c44",
        "xs wregs mb2",
        "ring 2x64",
        "ring 2x64p",
        "ring 1x128",
        "ring 1x128p",
    ),
}
LN_ONE_CTA = (
    "xs2 mb3",
    "xs2 mb2",
    "xs2 t512 mb3",
    "xs2 t512 mb2",
    "xs3 mb2",
    "xs mb3 c44",
    "xs mb4 c72",
    "xs mb5 c86",
    "xs mb2 c30",
)
LN_CLUSTER = ("xs mb3", "xs mb4", "xs mb5", "xs2 mb3", "xs2 mb2", "xs3 mb2", "xs mb4 c72", "xs mb3 c44")
BWD = {"w_smem": {"w_smem": True}, "w_smem plain": {"w_smem": True, "w_perm": False}}
SHAPES = {4096: 32768, 16384: 32768, 65536: 32768, 262144: 4096}
# the plan class (cluster size of the default plan, 16-bit rows) of each N measured
CLUSTER = {4096: 1, 16384: 1, 65536: 4, 262144: 16}


def variants():
    from quack_kernels._ln_row import ROW_CLUSTER_VARIANTS, ROW_CTA_VARIANTS
    from quack_kernels.rmsnorm import WIDE_VARIANTS

    out = []
    for n in (65536, 262144, 4096, 16384):
        g, m = f"rms_w32 {n}", SHAPES[n]
        out += [
            V(g, "same (default)", "rms_fwd", m, n, "same", {}),
            V(g, "w32 (default)", "rms_fwd", m, n, W32, {}),
        ]
        out += [V(g, k, "rms_fwd", m, n, W32, WIDE_VARIANTS[k], "api") for k in RMS_WIDE.get(n, ())]
    g, m, n = "ln_w32 16384", 32768, 16384
    out += [
        V(g, "same (default)", "ln_fwd", m, n, "same", {}),
        V(g, "w32 (default)", "ln_fwd", m, n, W32, {}),
    ]
    out += [V(g, k, "ln_fwd", m, n, W32, ROW_CTA_VARIANTS[k] | {"ring": False}) for k in LN_ONE_CTA]
    for n in (262144, 65536):
        g, m = f"ln_w32 {n}", SHAPES[n]
        out += [
            V(g, "same (default)", "ln_fwd", m, n, "same", {}, "api"),
            V(g, "w32 (default)", "ln_fwd", m, n, W32, {}, "api"),
        ]
        out += [V(g, k, "ln_fwd", m, n, W32, ROW_CLUSTER_VARIANTS[k]) for k in LN_CLUSTER]
        out += [V(g, "same " + k, "ln_fwd", m, n, "same", ROW_CLUSTER_VARIANTS[k]) for k in LN_CLUSTER[:3]]
    g, m, n = "ln_w32 4096", 32768, 4096
    out += [
        V(g, "same (default)", "ln_fwd", m, n, "same", {}),
        V(g, "w32 (default)", "ln_fwd", m, n, W32, {}),
    ]
    g, m, n = "rms_bwd_w32 4096", 32768, 4096
    out += [
        V(g, "same (default)", "rms_bwd", m, n, "same", {}),
        V(g, "w32 (default)", "rms_bwd", m, n, W32, {}),
    ]
    out += [V(g, k, "rms_bwd", m, n, W32, t) for k, t in BWD.items()]
    return out


def decide(results):
    t = {(r["group"], r["label"]): r for r in results if "us" in r and r.get("ok")}
    why = []

    def best_of(g, base, cands, pct=1.5):
        b = t.get((g, base), {}).get("us")
        pick, pu = None, None
        for c in cands:
            u = t.get((g, c), {}).get("us")
            if b and u and u <= b * (1 - pct / 100) and (pu is None or u < pu):
                pick, pu = c, u
        why.append(
            f"{g}: base {base} {b}, candidates {[(c, t.get((g, c), {}).get('us')) for c in cands]} -> {pick or 'keep'}"
        )
        return pick

    from quack_kernels import _norm_bwd, rmsnorm
    from quack_kernels._ln_row import ROW_CLUSTER, ROW_CTA

    # from the current tables: a group not measured (or without a clear win) keeps its entry
    wide_fwd = dict(rmsnorm.WIDE_FWD)
    for n, cands in RMS_WIDE.items():
        p = best_of(f"rms_w32 {n}", "w32 (default)", list(cands))
        if p:
            wide_fwd[str(CLUSTER[n])] = p
    row_cta = dict(ROW_CTA)
    p = best_of("ln_w32 16384", "w32 (default)", list(LN_ONE_CTA))
    if p:
        row_cta["wide"] = p
    row_cluster = dict(ROW_CLUSTER)
    for n in (65536, 262144):
        g = f"ln_w32 {n}"
        p = best_of(g, "w32 (default)", list(LN_CLUSTER))
        if p:
            row_cluster[f"wide@{CLUSTER[n]}"] = p
        p = best_of(g, "same (default)", ["same " + k for k in LN_CLUSTER[:3]])
        if p:
            row_cluster[f"same@{CLUSTER[n]}"] = p.removeprefix("same ")
    p = best_of("rms_bwd_w32 4096", "w32 (default)", list(BWD))
    w_smem = dict(_norm_bwd.W_SMEM_WIDE_ONE_CTA)
    w_perm_note = None
    if p:
        w_smem["rms"] = True
        if p == "w_smem plain":
            w_perm_note = (
                "w_smem plain won: W_PERM stays (applies to every wide shared-memory weight); not adopted"
            )
            w_smem["rms"] = False
    if w_perm_note:
        why.append(w_perm_note)
    edits = {
        "kernels/rmsnorm.py": {"WIDE_FWD: dict": wide_fwd},
        "kernels/_ln_row.py": {"ROW_CTA: dict": row_cta, "ROW_CLUSTER: dict": row_cluster},
        "kernels/_norm_bwd.py": {"W_SMEM_WIDE_ONE_CTA": w_smem},
    }
    return edits, why


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--apply", action="store_true")
    ap.add_argument("--apply-from", default=None)
    ap.add_argument("--workdir", default="/tmp/tune_k5f")
    ap.add_argument("--groups", default=None)
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args(argv)
    if args.apply_from:
        apply(json.loads(Path(args.apply_from).read_text())["edits"], ROOT)
        return
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    vs = variants()
    if args.groups:
        keep = set(args.groups.split(","))
        vs = [v for v in vs if v["group"] in keep]
        if not vs:
            # a selection that matches nothing must not reach decide() / --apply
            raise SystemExit(
                f"--groups {args.groups!r}: no such group (groups: {sorted({v['group'] for v in variants()})})"
            )
    wd = Path(args.workdir)
    errors = compile_all(vs, wd, args.jobs)
    for k, e in errors.items():
        print(f"compile {k} failed: {e}", flush=True)
    if args.compile_only:
        return
    import torch

    print(torch.cuda.get_device_name(), flush=True)
    fns, mods = {}, []
    for v in vs:
        k = compile_key(v)
        if k in fns or k in errors:
            continue
        fn, mod = load(wd / f"{k}.o")
        fns[k] = fn
        mods.append(mod)
    results: list = []
    groups: dict = {}
    for v in vs:
        groups.setdefault(v["group"], []).append(v)
    for name, gvs in groups.items():
        t0 = time.time()
        try:
            run_group(name, gvs, fns, args.rounds, results)
        except Exception as e:  # noqa: BLE001 - a failing group must not cost the others
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        print(f"[{name}: {time.time() - t0:.1f} s]", flush=True)
    edits, why = decide(results)
    for line in why:
        print("decide:", line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(results=results, edits=edits, why=why), indent=1))
    if args.apply:
        apply(edits, ROOT)


if __name__ == "__main__":
    main()
