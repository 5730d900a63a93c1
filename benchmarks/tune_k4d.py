"""Issue 14 part 6, round 4 (engineer D): the persistent softmax backward
(``kernels/_softmax_persist.py``, knob ``bwd_persist`` = CTAs per SM) against the one-row-
per-CTA backward at 32768x4096 (bf16), side by side in one process.

Reuses round 3's machinery (``tune_k3b.py``: ``.raw`` compiles with ``_TUNE`` knobs, each
variant checked against fp32 torch on 256 rows, then timed interleaved over ``--allocs``
input sets x ``--rounds``, median of medians) with this round's variants, the persistent
kernel's launch (its grid: ``softmax.bwd_persist_grid``), and a decision that touches only
softmax's "small" class: the fastest correct variant is adopted when >= 1.5 % faster than
the default; ``--apply`` rewrites softmax's ``DEFAULTS`` line, keeping the other classes'
entries (tune_k3b's ``apply`` would rebuild every class from this sweep alone).

    python benchmarks/tune_k4d.py --compile-only --workdir DIR   # CPU machine
    python benchmarks/tune_k4d.py --workdir DIR [--json OUT] [--apply]
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import tune_k3b as base  # noqa: E402

M = base.M
GROUP = "sm_bwd 32768x4096"


def variants():
    V = base.V
    g = GROUP
    return [
        V(g, "default", "sm_bwd", M, 4096),
        V(g, "b16", "sm_bwd", M, 4096, {"bwd_budget": 16}),
        V(g, "rows2", "sm_bwd", M, 4096, {"bwd_rows": 2}),
        # ptxas -v (sm_90a; default: 72 registers, 7 CTAs / SM): "p" = persistent with the
        # next row's loads in flight, "n" = persistent without (loads where used), then CTAs
        # per SM, then the budget (16: 256 threads a row, 2 vectors a tensor a thread; 32:
        # 128 threads, 4 vectors). p2b16 96 registers, p3b16 80, p4b16 64 + 64 bytes
        # spilled, p3b32 150 (p4b32: 128 + 52 bytes spilled, not measured); n4b16 50, n5b16
        # 48, n4b32 84, n6b32 80 (n7b32 spills). rows2: 2 rows of 128 threads a CTA, 79.
        V(g, "p2b16", "sm_bwd", M, 4096, {"bwd_persist": 2, "bwd_budget": 16}),
        V(g, "p3b16", "sm_bwd", M, 4096, {"bwd_persist": 3, "bwd_budget": 16}),
        V(g, "p4b16", "sm_bwd", M, 4096, {"bwd_persist": 4, "bwd_budget": 16}),
        V(g, "p3b32", "sm_bwd", M, 4096, {"bwd_persist": 3, "bwd_budget": 32}),
        V(g, "n4b16", "sm_bwd", M, 4096, {"bwd_persist": 4, "bwd_budget": 16, "bwd_persist_pipe": False}),
        V(g, "n5b16", "sm_bwd", M, 4096, {"bwd_persist": 5, "bwd_budget": 16, "bwd_persist_pipe": False}),
        V(g, "n4b32", "sm_bwd", M, 4096, {"bwd_persist": 4, "bwd_budget": 32, "bwd_persist_pipe": False}),
        V(g, "n6b32", "sm_bwd", M, 4096, {"bwd_persist": 6, "bwd_budget": 32, "bwd_persist_pipe": False}),
    ]


_base_make_call = base.make_call


def make_call(v, fn, a):
    import torch
    from quack_kernels import softmax

    if v["kern"] == "sm_bwd":
        cfg = base._with_tune("sm_bwd", v["tune"], lambda: softmax.bwd_persist_cfg(base.BF, v["n"]))
        if cfg is not None:
            grid = softmax.bwd_persist_grid(cfg, v["m"], torch.device("cuda"))
            return lambda: fn(a["dy"], a["y"], a["out"], grid)
    return _base_make_call(v, fn, a)


def decide(results, threshold=0.985):
    """softmax's DEFAULTS (the current ones, the "small" class decided here) and the reason."""
    from quack_kernels import softmax

    rs = {r["label"]: r for r in results if r["group"] == GROUP and "us" in r and r.get("ok")}
    current = {c: dict(k) for c, k in softmax.DEFAULTS.items()}
    base_r = rs.get("default")
    if base_r is None:
        return {}, [f"{GROUP}: no correct default measured -> keep"]
    best = min(rs.values(), key=lambda r: r["us"])
    ratio = best["us"] / base_r["us"]
    take = best["label"] != "default" and ratio <= threshold
    why = [
        f"{GROUP}: default {base_r['us']:.1f} us, best {best['label']} {best['us']:.1f} us ({ratio:.3f})"
        f" -> {'adopt ' + json.dumps(best['tune'], sort_keys=True) if take else 'keep'}"
    ]
    if not take:
        return {}, why
    current["small"] = dict(best["tune"])
    return {"kernels/softmax.py": current}, why


def apply(defaults, root: Path):
    for rel, value in defaults.items():
        p = root / rel
        text = p.read_text()
        line = "DEFAULTS: dict = " + json.dumps(value, sort_keys=True).replace("true", "True").replace(
            "false", "False"
        )
        text, k = re.subn(r"^DEFAULTS: dict = .*$", lambda _m: line, text, count=1, flags=re.M)
        if k != 1:
            raise SystemExit(f"{rel}: no line 'DEFAULTS: dict = ...' to rewrite")
        p.write_text(text)
        print(f"{rel}: {line}", flush=True)


if __name__ == "__main__":
    base.variants = variants
    base.make_call = make_call
    base.decide = decide
    base.apply = apply
    base.main()
