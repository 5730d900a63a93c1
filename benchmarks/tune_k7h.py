"""Issue 14 part 6, round 7 (engineer H): the mixed-precision norm misses, variants chosen from
the round's profile (``benchmarks/prof_k7h.py``, docs/kernels.md "Round 7"), side by side on the
GPU in ONE process (``benchmarks/tune_k2.py``'s machinery: ``.raw`` compiles with the modules'
``_TUNE`` knobs in parallel workers, each checked against fp32 torch on 256 rows plus
finiteness, timed interleaved, ``--rounds`` rounds of a median of 20, L2 flushed).

The profile: the fp32-w kernels are latency-bound (DRAM 60-68 % busy, L2 / L1 / issue below
65 %, long-scoreboard stalls first); the two-row kernel's y loop issues each vector's w / b
loads after the previous vector's y stores (may-alias: kept in that order), ``nvec`` dependent
L2 round trips a CTA. Knob "wb_ahead" (``_norm_fwd.xs_rows_kernel``): w / b vectors loaded
ahead. Labels: ``xsR`` = R rows a CTA, ``mbK`` = K CTAs / SM, ``wbaD`` = wb_ahead D, ``b32`` =
the one-CTA plan with 32 elements a thread (N = 4096: one 128-thread CTA a row instead of two
rows of 64 threads, so that ``xs_rows_kernel`` applies).

Groups (bf16 x), each with the same-dtype default and the fp32-w default:
``ln_w32 262144`` (``_ln_row.ROW_CLUSTER["wide@16"]``), ``rms_w32 262144``
(``rmsnorm.WIDE_FWD["16"]``), ``ln_w32 4096`` (``_ln_row.ROW_SMALL["wide"]``), ``ln_w32 16384``
(``_ln_row.ROW_CTA["wide"]``); defaults only at the ops' other shapes.

Rule (``decide``, rounds 5-6's): in each group the fastest correct fp32-w candidate >= 1.5 %
faster than the fp32-w default becomes the default of the group's plan class.

    python benchmarks/tune_k7h.py [--jobs 16] [--rounds 3] [--json OUT] [--apply]
    python benchmarks/tune_k7h.py --apply-from decisions.json
    python benchmarks/tune_k7h.py --ptxas DIR [--jobs 2]   # CPU: registers / spills of each
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
SHAPES = {4096: 32768, 16384: 32768, 65536: 32768, 262144: 4096}
# the candidates of each group: labels of the modules' variant tables, whose knobs replace the
# default tables' ("row_cta" / "wide_fwd" off: a label means its own knob set)
CANDIDATES = {
    "ln_w32 262144": (
        "xs2 mb3 wba1",
        "xs2 mb3 wba2",
        "xs2 mb2 wba4",
        "xs2 mb3 wbc",
        "xs mb6 wbc",
        "xs mb4 wbc",
    ),
    "rms_w32 262144": ("xs2 mb3", "xs2 mb3 wba4", "xs2 mb2 wba8", "xs2 mb3 wbc", "xs mb4 wbc"),
    "ln_w32 4096": (
        "xs2 b32 mb4 wba4",
        "xs2 b32 mb5 wba2",
        "xs4 b32 mb3 wba4",
        "xs2 b32 mb4",
        "xs4 b32 mb3 wbc",
    ),
    "ln_w32 16384": ("xs2 mb3 wba1", "xs2 mb3 wba2", "xs2 mb3 wbc", "xs mb5 wbc"),
}


def knobs(group: str, label: str) -> dict:
    from quack_kernels import _ln_row, rmsnorm

    if group.startswith("rms"):
        return rmsnorm.WIDE_VARIANTS[label] | {"wide_fwd": False}
    table = {
        "ln_w32 262144": _ln_row.ROW_CLUSTER_VARIANTS,
        "ln_w32 4096": _ln_row.ROW_SMALL_VARIANTS,
        "ln_w32 16384": _ln_row.ROW_CTA_VARIANTS,
    }[group]
    return table[label] | {"row_cta": False, "ring": False}


GROUPS = {
    "ln_w32 262144": ("ln_fwd", 262144),
    "rms_w32 262144": ("rms_fwd", 262144),
    "ln_w32 4096": ("ln_fwd", 4096),
    "ln_w32 16384": ("ln_fwd", 16384),
}
# (module file, table line, key) each group's decision rewrites
TABLES = {
    "ln_w32 262144": ("kernels/_ln_row.py", "ROW_CLUSTER: dict", "wide@16"),
    "rms_w32 262144": ("kernels/rmsnorm.py", "WIDE_FWD: dict", "16"),
    "ln_w32 4096": ("kernels/_ln_row.py", "ROW_SMALL: dict", "wide"),
    "ln_w32 16384": ("kernels/_ln_row.py", "ROW_CTA: dict", "wide"),
}


def variants():
    out = []
    for g, (kern, n) in GROUPS.items():
        m = SHAPES[n]
        out += [V(g, "same (default)", kern, m, n, "same", {}), V(g, "w32 (default)", kern, m, n, W32, {})]
        out += [V(g, label, kern, m, n, W32, knobs(g, label)) for label in CANDIDATES[g]]
    for kern, op, ns in (("rms_fwd", "rms", (4096, 16384, 65536)), ("ln_fwd", "ln", (65536,))):
        for n in ns:
            g, m = f"{op}_w32 {n}", SHAPES[n]
            out += [
                V(g, "same (default)", kern, m, n, "same", {}),
                V(g, "w32 (default)", kern, m, n, W32, {}),
            ]
    return out


def decide(results):
    """-> (edits, why): per group, the fastest correct fp32-w candidate >= 1.5 % faster than
    the fp32-w default, as a table entry naming the candidate's label (the label must be in
    the module's variants table for ``--apply``'s result to load: ``check_labels``)."""
    t = {(r["group"], r["label"]): r for r in results if "us" in r and r.get("ok")}
    why = []
    edits: dict = {}
    for g, (rel, line, key) in TABLES.items():
        base = t.get((g, "w32 (default)"), {}).get("us")
        pick, pu = None, None
        for c in CANDIDATES[g]:
            u = t.get((g, c), {}).get("us")
            if base and u and u <= base * (1 - 1.5 / 100) and (pu is None or u < pu):
                pick, pu = c, u
        why.append(
            f"{g}: base {base}, {[(c, t.get((g, c), {}).get('us')) for c in CANDIDATES[g]]} -> {pick or 'keep'}"
        )
        if pick:
            edits.setdefault(rel, {}).setdefault(line, dict(_table(rel, line)))[key] = pick
    return edits, why


def _table(rel, line):
    from quack_kernels import _ln_row, rmsnorm

    mod = {"kernels/_ln_row.py": _ln_row, "kernels/rmsnorm.py": rmsnorm}[rel]
    return getattr(mod, line.split(":")[0])


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
    ap.add_argument("--workdir", default="/tmp/tune_k7h")
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
    fns, mods = {}, []  # the modules stay referenced while their functions run
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
