"""Product benchmark of the Hopper GEMM (issue 28): bf16 quack_kernels.ops.gemm vs
torch.matmul (cuBLAS) side by side in one run, then bias + gelu-tanh fused vs matmul followed
by the epilogue in eager torch and under torch.compile. Prints a table on stdout.

    python benchmarks/gemm.py            # needs a CUDA GPU; compiles missing configurations
    python benchmarks/gemm.py --table T  # with tuning table T in force (quack tune --table T)
"""

import argparse
import contextlib
import statistics

import torch

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192)] + [
    (8192, n, k) for n, k in ((4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192), (8192, 28672))
]


def gpu_ms(fn, reps=20):
    """Median of ``reps`` CUDA-event timings, L2 flushed (a 512 MiB write) before each."""
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", default=None, help="a tuning table to use instead of the checked-in one")
    args = ap.parse_args()
    from quack.tuning import Table, use_table

    # the table's rows pick each shape's configuration (quack_kernels.gemm.gemm_config)
    with use_table(Table.load(args.table)) if args.table else contextlib.nullcontext():
        run()


def run():
    from quack_kernels.gemm import gemm_config
    from quack_kernels.ops import gemm

    for m, n, k in SHAPES:
        print(f"config {m}x{n}x{k}: {gemm_config(m, n, k, 1, 'bfloat16').label()}")
    print(
        f"{'M x N x K':>22} | {'cuBLAS ms':>9} {'TFLOP/s':>7} | {'quack ms':>9} {'TFLOP/s':>7} | quack/cuBLAS"
    )
    for m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()  # a weight (N, K), as in a Linear
        t_ref = gpu_ms(lambda: torch.matmul(a, b))
        t_q = gpu_ms(lambda: gemm(a, b))
        fl = 2 * m * n * k / 1e9
        print(
            f"{f'{m}x{n}x{k}':>22} | {t_ref:9.3f} {fl / t_ref:7.0f} | {t_q:9.3f} {fl / t_q:7.0f} | {t_ref / t_q:.3f}x"
        )
        del a, b
    print()
    print(
        f"{'bias+gelu M x N x K':>22} | {'eager ms':>9} | {'compile ms':>10} | {'fused ms':>9} | fused vs eager / compile"
    )
    for m, n, k in SHAPES[:1] + SHAPES[2:4]:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)

        def eager():
            return torch.nn.functional.gelu(torch.matmul(a, b) + bias, approximate="tanh")

        comp = torch.compile(eager)
        t_e, t_c = gpu_ms(eager), gpu_ms(comp)
        t_f = gpu_ms(lambda: gemm(a, b, bias=bias, activation="gelu_tanh"))
        print(
            f"{f'{m}x{n}x{k}':>22} | {t_e:9.3f} | {t_c:10.3f} | {t_f:9.3f} | {t_e / t_f:.3f}x / {t_c / t_f:.3f}x"
        )


if __name__ == "__main__":
    main()
