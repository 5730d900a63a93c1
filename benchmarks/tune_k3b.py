"""Issue 14 part 6, round 3 (engineer B): softmax / cross-entropy variants side by side on
the GPU, decided by rule.

Every variant (a compile-time ``_TUNE`` knob set of kernels/softmax.py or
kernels/cross_entropy.py) is compiled first (``.raw``, exported to a ``.o``; compiled ahead
on a CPU machine with ``--compile-only`` and carried, or here in parallel worker
processes), then loaded, checked against fp32 torch on 256 rows spread over the batch
(outputs poisoned with NaN first, and finite everywhere), and timed the way
``bench_kernels.py`` times (bf16 rows, L2 flushed by a 256 MiB write, median of ``--reps``)
on ``--allocs`` input sets allocated side by side (different placements in device memory:
the ~10 % spread between allocations of the ~135 us shapes), each variant of a group timed
on set k before any is timed on set k + 1, the variants' order rotated per set, over
``--rounds`` rounds; a variant's figure is the median of its medians
(``bench_kernels.median_of_medians``).

The rules (``decide``): per group (one op x shape = one row-length class of the kernel's
``size_class``), the fastest variant becomes the class's default when it is >= 1.5 %
faster than the current default ("default", the empty knob set) and correct; ``--apply``
rewrites the ``DEFAULTS: dict = ...`` line of the two modules (``--apply-from FILE``: the
same edits from a ``--json`` file, on another checkout).

    python benchmarks/tune_k3b.py --compile-only --workdir DIR [--jobs 2]   # CPU machine
    python benchmarks/tune_k3b.py --workdir DIR [--json OUT] [--apply]      # GPU machine
    python benchmarks/tune_k3b.py --apply-from decisions.json
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

BF = "bfloat16"
M = 32768


def V(group, label, kern, m, n, tune=None):
    return dict(group=group, label=label, kern=kern, m=m, n=n, tune=dict(tune or {}))


def variants():
    out = []
    # (min_blocks 8 at 4096 and 4 at 262144 spill: 64 registers; not measured)
    g = "sm_fwd 32768x4096"
    out += [
        V(g, "default", "sm_fwd", M, 4096),
        V(g, "smem", "sm_fwd", M, 4096, {"fwd_smem": True}),
        V(g, "online", "sm_fwd", M, 4096, {"online": True}),
        V(g, "smem+online", "sm_fwd", M, 4096, {"fwd_smem": True, "online": True}),
    ]
    g = "sm_fwd 4096x262144"
    out += [
        V(g, "default", "sm_fwd", 4096, 262144),
        V(g, "smem", "sm_fwd", 4096, 262144, {"fwd_smem": True}),
        V(g, "smem+mb3", "sm_fwd", 4096, 262144, {"fwd_smem": True, "fwd_min_blocks": 3}),
        V(g, "mb3", "sm_fwd", 4096, 262144, {"fwd_min_blocks": 3}),
    ]
    g = "sm_bwd 32768x4096"
    out += [
        V(g, "default", "sm_bwd", M, 4096),
        V(g, "b16", "sm_bwd", M, 4096, {"bwd_budget": 16}),
        V(g, "b64", "sm_bwd", M, 4096, {"bwd_budget": 64}),
        V(g, "smem", "sm_bwd", M, 4096, {"bwd_budget": 32, "bwd_smem": True}),
        V(g, "smem+b64", "sm_bwd", M, 4096, {"bwd_budget": 64, "bwd_smem": True}),
        V(g, "smem+b16", "sm_bwd", M, 4096, {"bwd_budget": 16, "bwd_smem": True}),
    ]
    g = "sm_bwd 32768x16384"
    out += [
        V(g, "default", "sm_bwd", M, 16384),
        V(g, "b16", "sm_bwd", M, 16384, {"bwd_budget": 16}),
        V(g, "smem+b64", "sm_bwd", M, 16384, {"bwd_budget": 64, "bwd_smem": True}),
        V(g, "smem+b16", "sm_bwd", M, 16384, {"bwd_budget": 16, "bwd_smem": True}),
        V(g, "b16+mb4", "sm_bwd", M, 16384, {"bwd_budget": 16, "bwd_min_blocks": 4}),
    ]
    g = "ce_fwd 32768x4096"
    out += [
        V(g, "default", "ce_fwd", M, 4096),
        V(g, "regs", "ce_fwd", M, 4096, {"stream": False}),
        V(g, "regs+smem", "ce_fwd", M, 4096, {"stream": False, "fwd_smem": True}),
        V(g, "s4", "ce_fwd", M, 4096, {"stream": True, "stages": 4, "ctas_per_sm": 8}),
        V(g, "s3k2", "ce_fwd", M, 4096, {"stream": True, "stages": 3, "ctas_per_sm": 8, "k": 2}),
        V(g, "s2", "ce_fwd", M, 4096, {"stream": True, "stages": 2, "ctas_per_sm": 8}),
    ]
    g = "ce_bwd 32768x16384"
    out += [
        V(g, "default", "ce_bwd", M, 16384),
        V(g, "smem", "ce_bwd", M, 16384, {"bwd_budget": 32, "bwd_smem": True}),
        V(g, "smem+b128", "ce_bwd", M, 16384, {"bwd_budget": 128, "bwd_smem": True}),
        V(g, "smem+b64", "ce_bwd", M, 16384, {"bwd_budget": 64, "bwd_smem": True}),
        V(g, "b64", "ce_bwd", M, 16384, {"bwd_budget": 64}),
        V(g, "b16", "ce_bwd", M, 16384, {"bwd_budget": 16}),
    ]
    g = "ce_bwd 32768x4096"
    out += [
        V(g, "default", "ce_bwd", M, 4096),
        V(g, "smem", "ce_bwd", M, 4096, {"bwd_budget": 32, "bwd_smem": True}),
        V(g, "smem+b64", "ce_bwd", M, 4096, {"bwd_budget": 64, "bwd_smem": True}),
    ]
    return out


# ----------------------------------------------------------------------------- compile


def _module(kern):
    from quack_kernels import cross_entropy, softmax

    return softmax if kern.startswith("sm_") else cross_entropy


def _raw(kern, n):
    from quack_kernels import cross_entropy, softmax

    if kern == "sm_fwd":
        return softmax.compile_softmax_fwd.raw(BF, n)
    if kern == "sm_bwd":
        return softmax.compile_softmax_bwd.raw(BF, n)
    if kern == "ce_fwd":
        return cross_entropy.compile_cross_entropy_fwd.raw(BF, n, "none")
    return cross_entropy.compile_cross_entropy_bwd.raw(BF, n, "none")


def compile_key(v) -> str:
    text = json.dumps([v["kern"], v["n"], v["tune"]], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _with_tune(kern, tune, fn):
    knobs = _module(kern)._TUNE
    knobs.clear()
    knobs.update(tune)
    try:
        return fn()
    finally:
        knobs.clear()


def _compile_job(job):
    """Worker: compile one variant with its knobs and export it (``quack``'s .o format)."""
    kern, n, tune, path = job
    t0 = time.time()
    try:
        compiled = _with_tune(kern, tune, lambda: _raw(kern, n))
        compiled.export_to_c(object_file_path=path, function_name="func")
        return path, time.time() - t0, None
    except Exception as e:  # noqa: BLE001 - one failing variant must not cost the others
        return path, time.time() - t0, f"{type(e).__name__}: {str(e)[:300]}"


def compile_all(vs, outdir: Path, jobs: int):
    """Compile the variants whose ``.o`` is not in ``outdir`` yet; {key: error}."""
    import concurrent.futures as cf
    import multiprocessing as mp

    outdir.mkdir(parents=True, exist_ok=True)
    todo = {}
    for v in vs:
        path = outdir / f"{compile_key(v)}.o"
        if not path.exists():
            todo.setdefault(compile_key(v), (v["kern"], v["n"], v["tune"], str(path)))
    errors = {}
    t0 = time.time()
    if todo:
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


def _inputs(kern, m, n, seed):
    """One input set (fresh allocations) of a group, plus its outputs."""
    import torch

    dev = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, n, device=dev, dtype=torch.bfloat16, generator=g) * 2
    a = {"x": x}
    if kern == "sm_bwd":
        a["y"] = torch.cat([torch.softmax(x[i : i + 4096].float(), -1) for i in range(0, m, 4096)]).to(
            torch.bfloat16
        )
        a["dy"] = torch.randn(m, n, device=dev, dtype=torch.bfloat16, generator=g)
        del a["x"]
    if kern.startswith("ce_"):
        a["t"] = torch.randint(0, n, (m,), device=dev, generator=g)
        a["t"][::7] = -100
        a["lse"] = torch.cat([torch.logsumexp(x[i : i + 4096].float(), -1) for i in range(0, m, 4096)])
        a["dl"] = torch.rand(m, device=dev, generator=g)
        a["loss"] = torch.empty(m, device=dev)
        a["lse_out"] = torch.empty(m, device=dev)
    if kern != "ce_fwd":
        a["out"] = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    return a


def _reference(kern, a, rows):
    import torch

    if kern == "sm_fwd":
        return torch.softmax(a["x"][rows].float(), -1)
    if kern == "sm_bwd":
        y, dy = a["y"][rows].float(), a["dy"][rows].float()
        return y * (dy - (y * dy).sum(-1, keepdim=True))
    x, t = a["x"][rows].float(), a["t"][rows]
    lse = torch.logsumexp(x, -1)
    valid = t != -100
    if kern == "ce_fwd":
        xt = x.gather(1, t.clamp(min=0)[:, None])[:, 0]
        return torch.where(valid, lse - xt, 0.0), lse
    p = torch.softmax(x, -1)
    p[valid, t[valid]] -= 1.0
    return p * (a["dl"][rows] * valid)[:, None]


def make_call(v, fn, a):
    import torch
    from quack_kernels import cross_entropy

    kern = v["kern"]
    if kern == "sm_fwd":
        return lambda: fn(a["x"], a["out"])
    if kern == "sm_bwd":
        return lambda: fn(a["dy"], a["y"], a["out"])
    if kern == "ce_bwd":
        return lambda: fn(a["x"], a["t"], a["dl"], a["lse"], a["out"], -100)
    cfg = _with_tune(kern, v["tune"], lambda: cross_entropy.stream_cfg(BF, v["n"]))
    if cfg is None:
        return lambda: fn(a["x"], a["t"], a["loss"], a["lse_out"], -100)
    grid = cross_entropy.stream_grid(cfg, v["m"], torch.device("cuda"))
    return lambda: fn(a["x"], a["t"], a["loss"], a["lse_out"], -100, grid)


def check(v, a, rows) -> bool:
    import torch

    kern = v["kern"]
    ref = _reference(kern, a, rows)
    if kern == "ce_fwd":
        loss, lse = a["loss"], a["lse_out"]
        return bool(
            torch.isfinite(loss).all()
            and torch.allclose(loss[rows], ref[0], atol=2e-3, rtol=2e-3)
            and torch.allclose(lse[rows], ref[1], atol=2e-3, rtol=2e-3)
        )
    out = a["out"]
    return bool(torch.isfinite(out).all()) and bool(
        torch.allclose(out[rows].float(), ref, atol=3e-2, rtol=3e-2)
    )


def nbytes(kern, m, n) -> int:
    return {
        "sm_fwd": 4 * m * n,
        "sm_bwd": 6 * m * n,
        "ce_fwd": 2 * m * n + 16 * m,
        "ce_bwd": 4 * m * n + 12 * m,
    }[kern]


def run_group(name, vs, fns, allocs, rounds, reps, results):
    import torch

    from benchmarks.bench_kernels import bench, median_of_medians

    v0 = vs[0]
    kern, m, n = v0["kern"], v0["m"], v0["n"]
    sets = [_inputs(kern, m, n, seed=k) for k in range(allocs)]
    rows = torch.unique(torch.linspace(0, m - 1, 256, device="cuda").long())
    live = []
    for v in vs:
        fn = fns.get(compile_key(v))
        if fn is None:
            results.append(dict(group=name, label=v["label"], tune=v["tune"], failed="compile"))
            print(f"{name:<20} {v['label']:<12} FAILED compile", flush=True)
            continue
        try:
            a = sets[0]
            for key in ("out", "loss", "lse_out"):
                if key in a:
                    a[key].fill_(float("nan"))
            make_call(v, fn, a)()
            torch.cuda.synchronize()
            ok = check(v, a, rows)
        except Exception as e:  # noqa: BLE001
            results.append(
                dict(group=name, label=v["label"], tune=v["tune"], failed=f"{type(e).__name__}: {e}"[:300])
            )
            print(f"{name:<20} {v['label']:<12} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        live.append((v, fn, ok))
    meds = {v["label"]: [] for v, _, _ in live}
    for r in range(rounds):
        for k, a in enumerate(sets):
            shift = (r * allocs + k) % max(1, len(live))
            for v, fn, _ok in live[shift:] + live[:shift]:
                meds[v["label"]].append(bench(make_call(v, fn, a), reps=reps))
    nb = nbytes(kern, m, n)
    for v, _fn, ok in live:
        us = median_of_medians(meds[v["label"]])
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
            f"{name:<20} {v['label']:<12} {us:8.1f} us {nb / us / 1e6:5.2f} TB/s ok={ok}  ({spread})",
            flush=True,
        )
    del sets
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- decide

# group -> (module file, DEFAULTS key)
CLASSES = {
    "sm_fwd 32768x4096": ("kernels/softmax.py", "small", "fwd"),
    "sm_fwd 4096x262144": ("kernels/softmax.py", "large", "fwd"),
    "sm_bwd 32768x4096": ("kernels/softmax.py", "small", "bwd"),
    "sm_bwd 32768x16384": ("kernels/softmax.py", "mid", "bwd"),
    "ce_fwd 32768x4096": ("kernels/cross_entropy.py", "fwd_small", None),
    "ce_bwd 32768x16384": ("kernels/cross_entropy.py", "bwd_mid", None),
    "ce_bwd 32768x4096": ("kernels/cross_entropy.py", "bwd_small", None),
}


def decide(results, threshold=0.985):
    """{file: DEFAULTS dict} and the reasons. Softmax's classes hold the forward's and the
    backward's knobs in one set (their names differ: fwd_* / bwd_*)."""
    by_group: dict = {}
    for r in results:
        if "us" in r and r.get("ok"):
            by_group.setdefault(r["group"], {})[r["label"]] = r
    defaults: dict = {"kernels/softmax.py": {}, "kernels/cross_entropy.py": {}}
    why = []
    for group, (path, key, _part) in CLASSES.items():
        rs = by_group.get(group, {})
        base = rs.get("default")
        if base is None:
            why.append(f"{group}: no correct default measured -> keep")
            continue
        best = min(rs.values(), key=lambda r: r["us"])
        ratio = best["us"] / base["us"]
        take = best["label"] != "default" and ratio <= threshold
        why.append(
            f"{group}: default {base['us']:.1f} us, best {best['label']} {best['us']:.1f} us "
            f"({ratio:.3f}) -> {'adopt ' + json.dumps(best['tune'], sort_keys=True) if take else 'keep'}"
        )
        if take:
            defaults[path].setdefault(key, {}).update(best["tune"])
    return defaults, why


# softmax's backward budget by class lives in its own constants (tests and tune_k2.py read
# them): an adopted "bwd_budget" rewrites these lines instead of going into DEFAULTS
BUDGET_LINES = {"small": "BWD_BUDGET_SMALL", "mid": "BWD_BUDGET_MID"}


def apply(defaults, root: Path):
    """Rewrite the ``DEFAULTS: dict = ...`` line of each module (and softmax's
    ``BWD_BUDGET_*`` lines for an adopted backward budget)."""

    def line(value):
        # one line (the rewrite's pattern); a long one tells ruff format to leave it
        text = f"DEFAULTS: dict = {json.dumps(value, sort_keys=True).replace('true', 'True').replace('false', 'False')}"
        return text + ("  # fmt: skip" if len(text) > 110 else "")

    for rel, value in defaults.items():
        p = root / rel
        text = p.read_text()
        if rel == "kernels/softmax.py":
            value = {c: dict(kn) for c, kn in value.items()}
            for cls, const in BUDGET_LINES.items():
                b = value.get(cls, {}).pop("bwd_budget", None)
                if b is not None:
                    text, k = re.subn(rf"^{const} = .*$", f"{const} = {int(b)}", text, count=1, flags=re.M)
                    if k != 1:
                        raise SystemExit(f"{rel}: no line '{const} = ...' to rewrite")
                if cls in value and not value[cls]:
                    del value[cls]
        text, k = re.subn(
            r"^DEFAULTS: dict = .*$",
            lambda _m: line(value),
            text,
            count=1,
            flags=re.M,
        )
        if k != 1:
            raise SystemExit(f"{rel}: no line 'DEFAULTS: dict = ...' to rewrite")
        p.write_text(text)
        print(
            f"{rel}: DEFAULTS = {value}; sha256 {hashlib.sha256(p.read_bytes()).hexdigest()[:16]}", flush=True
        )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--allocs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--apply", action="store_true", help="rewrite the modules' DEFAULTS by the rules")
    ap.add_argument("--apply-from", default=None, help="apply the DEFAULTS of a --json file instead")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--workdir", default="/tmp/tune_k3b")
    ap.add_argument("--groups", default=None, help="comma-separated group names (default: all)")
    args = ap.parse_args()
    if args.apply_from:
        apply(json.loads(Path(args.apply_from).read_text())["defaults"], ROOT)
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
    if args.compile_only:
        return
    import torch

    print(torch.cuda.get_device_name(), flush=True)
    fns, mods = {}, []
    for v in vs:
        k = compile_key(v)
        if k in fns or k in errors:
            continue
        try:
            fn, mod = load(wd / f"{k}.o")
        except Exception as e:  # noqa: BLE001 - an object from another toolchain: rebuild it here
            print(f"load {k} failed ({type(e).__name__}: {str(e)[:200]}); compiling it here", flush=True)
            _path, _secs, err = _compile_job((v["kern"], v["n"], v["tune"], str(wd / f"{k}.o")))
            if err:
                print(f"compile {k} failed: {err}", flush=True)
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
        run_group(name, gvs, fns, args.allocs, args.rounds, args.reps, results)
        print(f"[{name}: {time.time() - t0:.1f} s]", flush=True)
    defaults, why = decide(results)
    for line in why:
        print("decide:", line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(results=results, defaults=defaults, why=why), indent=1))
    if args.apply:
        apply(defaults, ROOT)


if __name__ == "__main__":
    main()
