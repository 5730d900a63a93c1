"""Issue 14 part 6, round 9: the ring forward with the weight / bias slice in registers
(knob "ring_wregs", ``kernels/_norm_fwd.py``) against the two mixed-precision misses at
4096x262144 (bf16 x, fp32 weight (+ bias) vs the same-dtype default), side by side.

Why: round 7's profile has the RMSNorm ring (w in shared memory, 4 x stages, 7 clusters of
16) at 82 % DRAM busy and the LayerNorm ring (w AND b in shared memory: 128 KiB a CTA, room
for only 2 x stages) at 65 %. With w / b in registers (64 / 128 a thread at 64 elements a
thread; ptxas: RMSNorm 100 registers, LayerNorm 188, no spills), shared memory holds x
stages only: 6 at clusters of 16; 3 at 2 CTAs / SM ("2x64", RMSNorm, 127 registers) or at
clusters of 8 ("c8": 128 elements a thread, 120 SMs instead of 112, 164 registers).

The last sweep (in ``variants`` now): the ring over clusters of 8 CTAs of 512 threads (knob
"ring_threads", 120 SMs), which made the RMSNorm default at 262144 (``rmsnorm.WIDE_FWD_BY_N``;
with it adopted, the variants here that only add knobs run on top of it). The earlier sweeps'
variant lists are in docs/kernels.md ("Round 9") and at commit 499a617.

Kernels: ``.raw`` compiles with the modules' ``_TUNE`` knobs (``benchmarks/tune_k2.py``'s
machinery: each checked against fp32 torch on 256 rows, outputs poisoned first; bf16 rows,
L2 flushed, median of 20, the group's variants interleaved over ``--rounds`` rounds).

    python benchmarks/prof_k9.py --compile            # compile every variant (workdir)
    python benchmarks/prof_k9.py --time [--groups g]  # interleaved timing, one process
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.tune_k2 import V  # noqa: E402

W32 = "float32"
M, N = 4096, 262144
WR = {"ring_wregs": True}
PIPE = {"ring_pipe": True}
XR = {"pipe_xregs": True}
BULK = {"x_bulk": True}
LNR = {"row_cta": False}  # LayerNorm: the ring in place of ROW_CLUSTER's x-in-shared-memory kernels


def variants():
    g = "rms"
    t512 = {"ring_threads": 512}
    out = [
        V(g, "same xs (default)", "rms_fwd", M, N, "same", {}),
        V(g, "w32 ring (default)", "rms_fwd", M, N, W32, {}, "api"),
        V(g, "w32 ring s3", "rms_fwd", M, N, W32, {"stages": 3}, "api"),
        V(g, "w32 c8 t512 ring", "rms_fwd", M, N, W32, t512, "api"),
        V(g, "w32 c8 t512 pipe wregs s3", "rms_fwd", M, N, W32, t512 | PIPE | WR | {"stages": 3}, "api"),
        V(
            g,
            "w32 c8 t512 pipe wregs s3 g16",
            "rms_fwd",
            M,
            N,
            W32,
            t512 | PIPE | WR | {"stages": 3, "ring_clusters": 16},
            "api",
        ),
    ]
    return out


def main(argv=None):
    from benchmarks.prof_k7h import run_cli

    run_cli(variants(), "/tmp/prof_k9", argv)


if __name__ == "__main__":
    main()
