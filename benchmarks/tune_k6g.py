"""Issue 14 part 6, round 6 (engineer G): the last mixed-precision norm misses (fp32 weight /
bias beside bf16 x vs the same-dtype kernel, same process), variants side by side on the GPU
in ONE process (``benchmarks/tune_k5f.py``'s machinery: ``.raw`` compiles with the modules'
``_TUNE`` knobs in parallel workers, each checked against fp32 torch on 256 rows plus
finiteness, timed interleaved, ``--rounds`` rounds of a median of 20, L2 flushed).

Groups (bf16 x, TB/s), each with the same-dtype default and the fp32-w default:

- ``rms_w32 262144``: RMSNorm fwd (default: the ring at clusters of 16), round 5's prepared
  ``xs2j`` (both rows' sums in one round trip) and ``xs3``, and round 6's cache hints
  (``IO_HINTS``: "wbel" = the fp32 weight's 16-byte loads with an L2 evict_last policy; "h" =
  that + x's cp.async with L2 evict_first + y's stores with L2 evict_first; "wbel1": x's
  cp.async evict_first, w's loads with L1::evict_last + L2 evict_last; "ring xef": the
  ring's x cp.async with L2 evict_first);
- ``ln_w32 262144``: LayerNorm fwd (default: ``xs2 mb3``), ``xs3``, the hints on ``xs2`` /
  ``xs3`` / ``xs`` (one row a CTA), the ring (w AND b in shared memory for the CTA's rows)
  with and without the x hint; the same-dtype ``xs mb3`` with the hints, for the record;
- ``ln_w32 16384``: LayerNorm fwd (default: ``xs2 mb3``), ``xs2 t512``, ``xs3``, the hints;
- ``rms_w32 4096 / 16384 / 65536``, ``ln_w32 4096 / 65536``: the defaults only (other plan
  classes: their kernels are not changed by a decision here).

Rule (``decide``, round 5's): in each of the three groups the fastest correct fp32-w
candidate >= 1.5 % faster than the fp32-w default becomes the default of the group's plan
class (``rmsnorm.WIDE_FWD["16"]``, ``_ln_row.ROW_CLUSTER["wide@16"]``,
``_ln_row.ROW_CTA["wide"]``); the same-dtype defaults are not changed.

    python benchmarks/tune_k6g.py [--jobs 16] [--rounds 3] [--json OUT] [--apply]
    python benchmarks/tune_k6g.py --apply-from decisions.json
    python benchmarks/tune_k6g.py --ptxas DIR [--jobs 2]   # CPU: registers / spills of each
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.tune_k2 import V, compile_all, compile_key, load, run_group  # noqa: E402
from benchmarks.tune_k3 import apply  # noqa: E402

W32 = "float32"
RMS_262144 = (
    "xs2j mb3",
    "xs2j mb2",
    "xs3 mb2",
    "xs2 mb3 wbel",
    "xs2 mb3 h",
    "xs2 mb3 wbel1",
    "xs2j mb3 h",
    "xs3 mb2 h",
    "ring xef",
)
LN_262144 = (
    "xs mb3",
    "xs3 mb2",
    "xs2 mb3 wbel",
    "xs2 mb3 h",
    "xs3 mb2 wbel",
    "xs3 mb2 h",
    "xs mb3 wbel",
    "xs mb3 h",
    "xs2 mb3 wbel1",
    "xs mb3 c44 wbel1",
    "ring",
    "ring xef",
)
LN_16384 = (
    "xs mb5",
    "xs2 t512 mb3",
    "xs2 t512 mb2",
    "xs3 mb2",
    "xs2 mb3 wbel",
    "xs2 mb3 h",
    "xs2 t512 mb3 h",
    "xs3 mb2 h",
    "xs mb5 h",
    "xs2 mb3 wbel1",
    "xs mb5 wbel1",
)
SHAPES = {4096: 32768, 16384: 32768, 65536: 32768, 262144: 4096}


def variants():
    from quack_kernels._ln_row import ROW_CLUSTER_VARIANTS, ROW_CTA_VARIANTS
    from quack_kernels.rmsnorm import WIDE_VARIANTS

    out = []
    g, m, n = "rms_w32 262144", 4096, 262144
    out += [
        V(g, "same (default)", "rms_fwd", m, n, "same", {}),
        V(g, "w32 (default)", "rms_fwd", m, n, W32, {}),
    ]
    # each candidate's knobs replace the default tables' ("wide_fwd" / "row_cta": False): a
    # label means its own knob set, not the table's entry with the label's knobs over it
    # (this run's first sweep left "row_cta" on: its LayerNorm "xs mb3 ..." and "ring ..."
    # labels ran the default two-row kernel; docs/kernels.md, round 6)
    off = {"wide_fwd": False}
    out += [V(g, k, "rms_fwd", m, n, W32, WIDE_VARIANTS[k] | off, "api") for k in RMS_262144]
    g = "ln_w32 262144"
    out += [
        V(g, "same (default)", "ln_fwd", m, n, "same", {}, "api"),
        V(g, "w32 (default)", "ln_fwd", m, n, W32, {}, "api"),
    ]
    off = {"row_cta": False}
    out += [V(g, k, "ln_fwd", m, n, W32, ROW_CLUSTER_VARIANTS[k] | off, "api") for k in LN_262144]
    out += [V(g, "same xs mb3 h", "ln_fwd", m, n, "same", ROW_CLUSTER_VARIANTS["xs mb3 h"] | off, "api")]
    g, m, n = "ln_w32 16384", 32768, 16384
    out += [
        V(g, "same (default)", "ln_fwd", m, n, "same", {}),
        V(g, "w32 (default)", "ln_fwd", m, n, W32, {}),
    ]
    out += [V(g, k, "ln_fwd", m, n, W32, ROW_CTA_VARIANTS[k] | {"ring": False} | off) for k in LN_16384]
    for kern, op, ns in (("rms_fwd", "rms", (4096, 16384, 65536)), ("ln_fwd", "ln", (4096, 65536))):
        for n in ns:
            g, m = f"{op}_w32 {n}", SHAPES[n]
            out += [
                V(g, "same (default)", kern, m, n, "same", {}),
                V(g, "w32 (default)", kern, m, n, W32, {}),
            ]
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

    from quack_kernels import rmsnorm
    from quack_kernels._ln_row import ROW_CLUSTER, ROW_CTA

    # from the current tables: a group not measured (or without a clear win) keeps its entry
    wide_fwd = dict(rmsnorm.WIDE_FWD)
    p = best_of("rms_w32 262144", "w32 (default)", list(RMS_262144))
    if p:
        wide_fwd["16"] = p
    row_cluster = dict(ROW_CLUSTER)
    p = best_of("ln_w32 262144", "w32 (default)", list(LN_262144))
    if p:
        row_cluster["wide@16"] = p
    row_cta = dict(ROW_CTA)
    p = best_of("ln_w32 16384", "w32 (default)", list(LN_16384))
    if p:
        row_cta["wide"] = p
    edits = {
        "kernels/rmsnorm.py": {"WIDE_FWD: dict": wide_fwd},
        "kernels/_ln_row.py": {"ROW_CTA: dict": row_cta, "ROW_CLUSTER: dict": row_cluster},
    }
    return edits, why


# ----------------------------------------------------------------------------- CPU: ptxas


def _ptx_init(root: str):
    # CUTE_DSL_KEEP / DUMP_DIR are read once a process: one dump directory per worker, so
    # that two workers' kernels of one signature (the same file name) cannot collide
    d = Path(root) / f"w{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    os.environ.update(CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(d), CUTE_DSL_ARCH="sm_90a")


def _ptx_job(job):
    from benchmarks.tune_k2 import _module, _raw

    kern, n, wdt, tune, out = job
    d = Path(os.environ["CUTE_DSL_DUMP_DIR"])
    before = set(d.glob("*.ptx"))
    mod, attr = _module(kern)
    knobs = getattr(mod, attr)
    knobs.clear()
    knobs.update(tune)
    try:
        _raw(kern, n, wdt)
    except Exception as e:  # noqa: BLE001 - one failing variant must not cost the others
        return out, f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        knobs.clear()
    (new,) = set(d.glob("*.ptx")) - before
    new.rename(out)
    return out, None


def ptxas_report(vs, outdir: Path, jobs: int) -> None:
    """Compile each variant for sm_90a on the CPU, keep its PTX (``<key>.ptx``) and print
    ptxas -v's registers / spills of its kernel."""
    import concurrent.futures as cf
    import multiprocessing as mp

    outdir.mkdir(parents=True, exist_ok=True)
    todo = {}
    for v in vs:
        k = compile_key(v)
        todo.setdefault(k, (v["kern"], v["n"], v["wdt"], v["tune"], str(outdir / f"{k}.ptx")))
    errs = {}
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_ptx_init, initargs=(str(outdir),)) as ex:
        for out, err in ex.map(_ptx_job, todo.values()):
            if err:
                errs[out] = err
    for v in vs:
        ptx = outdir / f"{compile_key(v)}.ptx"
        if str(ptx) in errs:
            print(f"{v['group']:<16} {v['label']:<18} FAILED {errs[str(ptx)]}", flush=True)
            continue
        r = subprocess.run(
            ["ptxas", "-v", "-arch=sm_90a", str(ptx), "-o", os.devnull],
            capture_output=True,
            text=True,
            timeout=300,
        )
        regs = re.findall(r"Used (\d+) registers", r.stderr)
        spills = re.findall(r"(\d+) bytes spill stores", r.stderr)
        print(
            f"{v['group']:<16} {v['label']:<18} {v['wdt']:<8} regs {regs} spill stores {spills}", flush=True
        )


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--apply", action="store_true")
    ap.add_argument("--apply-from", default=None)
    ap.add_argument("--workdir", default="/tmp/tune_k6g")
    ap.add_argument("--groups", default=None)
    ap.add_argument("--ptxas", default=None, help="CPU: keep the PTX here and print ptxas -v")
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
    if args.ptxas:
        ptxas_report(vs, Path(args.ptxas), args.jobs)
        return
    wd = Path(args.workdir)
    errors = compile_all(vs, wd, args.jobs)
    for k, e in errors.items():
        print(f"compile {k} failed: {e}", flush=True)
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
