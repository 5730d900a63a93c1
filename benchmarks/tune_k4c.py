"""Issue 14 part 6, round 4 (engineer C): the LayerNorm forward of 16-bit rows of one
256-thread CTA (N in (8192, 16384]; the gap: 32768x16384), variants side by side on the GPU
in one process, decided by rule (the machinery of ``benchmarks/tune_k3.py`` /
``tune_k2.py``: ``.raw`` compiles with ``layernorm._TUNE`` knobs in parallel workers, each
checked against fp32 torch on 256 rows plus finiteness, timed interleaved, ``--rounds``
rounds of a median of 20, L2 flushed), beside torch.compile's layer_norm (the best peer
there). Groups (bf16 rows, TB/s):

- ``ln 16384`` (bf16 w + b) / ``ln_w32 16384`` (fp32 w + b): the row tile (127 registers,
  2 CTAs / SM; fp32: the clusterless ring, round 3's default) against w / b loaded and y
  stored one vector at a time (``wb_vec``), 512 threads a row (``threads``), and x through
  shared memory (``x_smem``: cp.async, the thread's (mean, M2) one vector at a time,
  ``x_stream``) at 3-6 CTAs / SM, .cg / .ca, 256 / 512 threads;
- ``ln 4096`` / ``ln 65536`` / ``ln 262144``: the default alone (``ROW_CTA`` does not apply
  there: their kernels are byte-identical PTX to round 3's), for the before / after record.

Rule (``decide``): the fastest candidate of a group becomes the default of its weight kind
(``_ln_row.ROW_CTA["same"]`` / ``["wide"]``, a label of ``ROW_CTA_VARIANTS``) when it is
>= 1.5 % faster than round 3's kernel and passed the check.

    python benchmarks/tune_k4c.py [--jobs 16] [--rounds 3] [--json OUT] [--apply]
    python benchmarks/tune_k4c.py --apply-from decisions.json
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from quack_kernels._ln_row import ROW_CTA_VARIANTS  # noqa: E402

from benchmarks.tune_k2 import V  # noqa: E402
from benchmarks.tune_k3 import sweep_main  # noqa: E402

W32 = "float32"
PEER = ("ln_compile", "ln_ref")  # not compiled here

# label -> knobs (kernels/_ln_row.py: one table for the sweep and the defaults); every
# variant runs with "row_cta": False, so that it is exactly its knobs over round 3's code
CANDIDATES = {k: v for k, v in ROW_CTA_VARIANTS.items() if k != "rowtile"}
WIDE = ("rowtile", "t512 vec mb2", "xs mb3", "xs mb4", "xs mb5", "xs mb6", "xs512 mb3")
BASE = {"row_cta": False}


def variants():
    m, n = 32768, 16384
    g = "ln 16384"
    out = [V(g, "rowtile (round 3)", "ln_fwd", m, n, "same", BASE)]
    out += [V(g, k, "ln_fwd", m, n, "same", BASE | t) for k, t in CANDIDATES.items()]
    out += [V(g, "torch.compile", "ln_compile", m, n, "same", {})]
    g = "ln_w32 16384"
    out += [V(g, "ring (round 3)", "ln_fwd", m, n, W32, BASE, "api")]
    out += [V(g, k, "ln_fwd", m, n, W32, BASE | ROW_CTA_VARIANTS[k] | {"ring": False}) for k in WIDE]
    out += [V(g, "torch.compile", "ln_compile", m, n, W32, {})]
    for m2, n2 in ((32768, 4096), (32768, 65536), (4096, 262144)):
        out += [V(f"ln {n2}", "default", "ln_fwd", m2, n2, "same", {}, "api")]
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

    same = best_of("ln 16384", "rowtile (round 3)", list(CANDIDATES)) or ""
    wide = best_of("ln_w32 16384", "ring (round 3)", list(WIDE)) or ""
    return {"kernels/_ln_row.py": {"ROW_CTA: dict": {"same": same, "wide": wide}}}, why


def main():
    sweep_main(variants, decide, "/tmp/tune_k4c", peers=PEER)


if __name__ == "__main__":
    main()
