"""Issue 14 part 6, round 8 (engineer I): LayerNorm forward 32768x16384, bf16 x with fp32 w + b
(the default ``_ln_row.ROW_CTA["wide"]`` = "xs2 mb3": two rows a CTA, 0.964-0.968 of the
same-dtype kernel in rounds 5-7), against round 7's 4096 structure at this N: R rows a CTA
through shared memory with each fp32 w / b vector read once for the R rows and loaded ahead of
the reductions ("xsR ... wbaD", ``_norm_fwd.xs_rows_kernel``), 256 / 512 threads, 1-3 CTAs / SM.
``benchmarks/tune_k2.py``'s machinery: ``.raw`` compiles with ``layernorm._TUNE`` knobs in
parallel workers, each checked against fp32 torch on 256 rows plus finiteness, timed
interleaved, ``--rounds`` rounds of a median of 20, L2 flushed.

Groups (bf16 x, M = 32768): ``ln_w32 N`` for the N of ``ROW_CTA``'s class (16-bit rows of one
256-thread CTA, even tiling: 10240 / 12288 / 14336 / 16384), each with the same-dtype default,
the fp32-w default and every candidate (the candidates' "threads": 512 applies at 12288 / 16384
only: ``_ln_row.row_plan``).

Rule (``decide``, rounds 5-7's, over the mean of every JSON given): the fastest correct fp32-w
candidate at 16384 >= 1.5 % faster than the fp32-w default there, and not > 1 % slower than it
at any other N of the class (correct there too), becomes ``ROW_CTA["wide"]``.

    python benchmarks/tune_k8i.py [--jobs 16] [--rounds 3] [--json OUT] [--groups ...]
    python benchmarks/tune_k8i.py --decide A.json B.json ... [--apply]
    python benchmarks/tune_k8i.py --ptxas DIR [--jobs 2]   # CPU: registers / spills of each
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
M = 32768
MAIN_N = 16384
CLASS_N = (16384, 12288, 10240, 14336)
CANDIDATES = (
    "xs2 mb3 wba2",
    "xs2 mb2 wba4",
    "xs3 mb2",
    "xs3 mb2 wba4",
    "xs4 mb1 wba8",
    "xs4 t512 mb1 wba4",
    "xs4 t512 mb1 wba2",
    "xs3 t512 mb2",
)
TABLE = ("kernels/_ln_row.py", "ROW_CTA: dict", "wide")


def knobs(label: str) -> dict:
    from quack_kernels import _ln_row

    # the label's own knob set, the default tables off
    return _ln_row.ROW_CTA_VARIANTS[label] | {"row_cta": False, "ring": False}


def variants(ns=CLASS_N, cands=CANDIDATES):
    out = []
    for n in ns:
        g = f"ln_w32 {n}"
        out += [
            V(g, "same (default)", "ln_fwd", M, n, "same", {}),
            V(g, "w32 (default)", "ln_fwd", M, n, W32, {}),
        ]
        out += [V(g, c, "ln_fwd", M, n, W32, knobs(c)) for c in cands]
    return out


def mean_results(files):
    """(group, label) -> mean µs over the JSON files' results (only where correct in each);
    and (group, label) -> per-file µs."""
    per: dict = {}
    bad = set()
    for f in files:
        for r in json.loads(Path(f).read_text())["results"]:
            k = (r["group"], r["label"])
            if "us" in r and r.get("ok"):
                per.setdefault(k, []).append(r["us"])
            else:
                bad.add(k)
    return {k: sum(v) / len(v) for k, v in per.items() if k not in bad}, per


def decide(files):
    """-> (pick or None, why lines)."""
    t, per = mean_results(files)
    why = []
    g0 = f"ln_w32 {MAIN_N}"
    base = t.get((g0, "w32 (default)"))
    same = t.get((g0, "same (default)"))
    why.append(f"{g0}: same {same}, w32 default {base}, per process {per.get((g0, 'w32 (default)'))}")
    ranked = sorted((t[(g0, c)], c) for c in CANDIDATES if (g0, c) in t)
    pick = None
    for u, c in ranked:
        line = f"  {c}: {u:.1f} ({per.get((g0, c))})"
        if not base or u > base * (1 - 1.5 / 100):
            why.append(line + " < 1.5 %")
            continue
        losses = []
        for n in CLASS_N[1:]:
            g = f"ln_w32 {n}"
            b, v = t.get((g, "w32 (default)")), t.get((g, c))
            if b is None or v is None or v > b * 1.01:
                losses.append(f"{n}: {v} vs {b}")
        if losses:
            why.append(line + f" loses elsewhere {losses}")
            continue
        why.append(line + " -> pick")
        pick = c
        break
    for n in CLASS_N[1:]:
        g = f"ln_w32 {n}"
        why.append(
            f"{g}: same {t.get((g, 'same (default)'))}, w32 {t.get((g, 'w32 (default)'))}, "
            + ", ".join(f"{c} {t.get((g, c))}" for c in CANDIDATES)
        )
    return pick, why


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
    ap.add_argument("--workdir", default="/tmp/tune_k8i")
    ap.add_argument("--ns", default=None, help="comma-separated N (default: the class)")
    ap.add_argument("--cands", default=None, help="comma-separated labels (default: CANDIDATES)")
    ap.add_argument("--decide", nargs="*", default=None, help="JSON files of earlier runs")
    ap.add_argument("--apply", action="store_true")
    ap.add_argument("--ptxas", default=None, help="CPU: keep the PTX here and print ptxas -v")
    args = ap.parse_args(argv)
    if args.decide is not None:
        if not args.decide:
            raise SystemExit("--decide: no JSON files")
        pick, why = decide(args.decide)
        for line in why:
            print("decide:", line, flush=True)
        print(f"decide: pick {pick}", flush=True)
        if pick and args.apply:
            from quack_kernels import _ln_row

            rel, line, key = TABLE
            apply({rel: {line: dict(_ln_row.ROW_CTA) | {key: pick}}}, ROOT)
            print(f"applied ROW_CTA[{key!r}] = {pick!r}", flush=True)
        return
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    ns = tuple(int(x) for x in args.ns.split(",")) if args.ns else CLASS_N
    vs = variants(ns, tuple(args.cands.split(",")) if args.cands else CANDIDATES)
    if args.ptxas:
        ptxas_report(vs, Path(args.ptxas), args.jobs)
        return
    # objects are reused within a tree only: a knob-less label ("w32 (default)") compiles to
    # whatever the tables name, so the kernels' sources are part of the directory's name
    import hashlib

    src = b"".join(p.read_bytes() for p in sorted((ROOT / "kernels").glob("*.py")))
    wd = Path(args.workdir) / hashlib.sha256(src).hexdigest()[:12]
    # the objects of an earlier process of this call are reused (same key = same knobs)
    todo = [v for v in vs if not (wd / f"{compile_key(v)}.o").exists()]
    errors = compile_all(todo, wd, args.jobs) if todo else {}
    for k, e in errors.items():
        print(f"compile {k} failed: {e}", flush=True)
    import torch

    print(torch.cuda.get_device_name(), flush=True)
    fns, mods = {}, []  # the modules stay referenced while their functions run
    for v in vs:
        k = compile_key(v)
        if k in fns or k in errors or not (wd / f"{k}.o").exists():
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
    if args.json:
        Path(args.json).write_text(json.dumps(dict(results=results), indent=1))


if __name__ == "__main__":
    main()
