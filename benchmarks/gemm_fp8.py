"""Product benchmark of the fp8 Hopper GEMM (quack_kernels.ops.scaled_gemm) against
torch._scaled_mm (cuBLAS) side by side in one run, per-tensor scales, bf16 output, with the
same accumulation on both sides: promoted (fast_accum off, cuBLAS's default) and fast.
Prints a table on stdout; the configurations are the tuning table's, else the heuristic's.

    python benchmarks/gemm_fp8.py                 # needs a CUDA GPU; compiles what is missing
    python benchmarks/gemm_fp8.py --dtype float8_e5m2

cuBLAS has no e5m2 x e5m2 GEMM (torch._scaled_mm: "Multiplication of two Float8_e5m2
matrices is not supported"): with ``--dtype float8_e5m2`` its column is its nearest kernel,
a in e4m3 times the same e5m2 b (the same bytes and tensor-core rate), labelled so.
"""

import argparse

import torch
from gemm import SHAPES, side_by_side  # the bf16 benchmark's shapes and measure


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float8_e4m3fn", choices=("float8_e4m3fn", "float8_e5m2"))
    args = ap.parse_args()
    from quack_kernels.gemm import gemm_config
    from quack_kernels.ops import scaled_gemm

    dt = getattr(torch, args.dtype)
    if dt == torch.float8_e5m2:
        print("cuBLAS column: a in float8_e4m3fn x b in float8_e5m2 (cuBLAS has no e5m2 x e5m2)")
    print(
        f"{'M x N x K':>22} {'accum':>8} | {'cuBLAS ms':>9} {'TFLOP/s':>7} | {'quack ms':>9} {'TFLOP/s':>7} "
        "| quack/cuBLAS | config"
    )
    for m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda").to(dt)
        b = torch.randn(n, k, device="cuda").to(dt).t()  # a weight (N, K), column-major (K, N)
        a_ref = a.to(torch.float8_e4m3fn) if dt == torch.float8_e5m2 else a  # see the docstring
        sa, sb = torch.tensor([0.5], device="cuda"), torch.tensor([0.25], device="cuda")
        for fast in (False, True):
            t_ref, t_q = side_by_side(
                lambda: torch._scaled_mm(a_ref, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast),
                lambda: scaled_gemm(a, b, sa, sb, fast_accum=fast),
            )
            fl = 2 * m * n * k / 1e9
            label = gemm_config(m, n, k, 1, args.dtype, fast).label()
            print(
                f"{f'{m}x{n}x{k}':>22} {'fast' if fast else 'promoted':>8} | {t_ref:9.3f} {fl / t_ref:7.0f} "
                f"| {t_q:9.3f} {fl / t_q:7.0f} | {t_ref / t_q:.3f}x | {label}"
            )
        del a, b


if __name__ == "__main__":
    main()
