"""Product benchmark of the Hopper GEMM (issue 28): bf16 quack_kernels.ops.gemm vs
torch.matmul (cuBLAS) side by side in one run, then bias + gelu-tanh fused vs matmul followed
by the epilogue in eager torch and under torch.compile. Prints a table on stdout.

    python benchmarks/gemm.py            # needs a CUDA GPU; compiles missing configurations
    python benchmarks/gemm.py --table T  # with tuning table T in force (quack tune --table T)
"""

import argparse
import contextlib

import torch

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192)] + [
    (8192, n, k) for n, k in ((4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192), (8192, 28672))
]
# The same (N, K) at M = 8448 tokens: off the sizes the table's rows were tuned at, inside
# their buckets (5793..11585), so the same configurations run; 33 rows of 256 are not a
# multiple of the tuned swizzle groups (8), whose padding the kernel must skip.
OFF_GRID = [(8448, n, k) for _m, n, k in SHAPES[1:]]


def gpu_ms(fn, reps=20):
    """Milliseconds: quack tune's own measure (quack.tuning.bench.gpu_time: the L2 flushed
    before each call, the GPU kept busy while the calls are queued, so a call's host-side
    cost is not timed as GPU time), median of ``reps``. The same for every column: before,
    an idle GPU between calls made a Python op's launch cost part of its time."""
    from quack.tuning.bench import gpu_time

    return gpu_time(fn, reps=reps, warmup=3) * 1e3


def side_by_side(*fns, rounds=6, reps=20):
    """Each function's time (ms), measured in interleaved rounds, the median of its rounds.
    A 5 ms GEMM heats the GPU and whichever ran second paid for it: the order rotates each
    round (A B, B A, ...), so over 6 rounds each of two or three functions runs first as
    often as the others (session 16 measured 0.936 at 8192x8192x28672 with quack always
    second; other calls 0.99-1.05)."""
    import statistics

    times = [[] for _ in fns]
    for r in range(rounds):
        order = list(range(len(fns)))
        order = order[r % len(fns) :] + order[: r % len(fns)]
        for i in order:
            times[i].append(gpu_ms(fns[i], reps))
    return [statistics.median(t) for t in times]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", default=None, help="a tuning table to use instead of the checked-in one")
    ap.add_argument(
        "--off-grid",
        action="store_true",
        help="M = 8448 instead of the tuned shapes (no fused-epilogue table)",
    )
    args = ap.parse_args()
    from quack.tuning import Table, use_table

    # the table's rows pick each shape's configuration (quack_kernels.gemm.gemm_config)
    with use_table(Table.load(args.table)) if args.table else contextlib.nullcontext():
        run(OFF_GRID if args.off_grid else SHAPES, epilogue=not args.off_grid)


def run(shapes, epilogue=True):
    from bench_op_host import host_us  # the one host-time measure of the benchmarks
    from quack_kernels.gemm import gemm_config
    from quack_kernels.ops import gemm

    for m, n, k in shapes:
        print(f"config {m}x{n}x{k}: {gemm_config(m, n, k, 1, 'bfloat16').label()}")
    print(
        f"{'M x N x K':>22} | {'cuBLAS ms':>9} {'TFLOP/s':>7} | {'quack ms':>9} {'TFLOP/s':>7} | quack/cuBLAS"
    )
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()  # a weight (N, K), as in a Linear
        t_ref, t_q = side_by_side(lambda: torch.matmul(a, b), lambda: gemm(a, b))
        fl = 2 * m * n * k / 1e9
        print(
            f"{f'{m}x{n}x{k}':>22} | {t_ref:9.3f} {fl / t_ref:7.0f} | {t_q:9.3f} {fl / t_q:7.0f} | {t_ref / t_q:.3f}x"
        )
        del a, b
    if not epilogue:
        return
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
        fused = lambda: gemm(a, b, bias=bias, activation="gelu_tanh")  # noqa: E731
        t_e, t_c, t_f = side_by_side(eager, comp, fused)
        print(
            f"{f'{m}x{n}x{k}':>22} | {t_e:9.3f} | {t_c:10.3f} | {t_f:9.3f} | {t_e / t_f:.3f}x / {t_c / t_f:.3f}x"
            f" | host us/call: fused {host_us(fused):.0f}, eager {host_us(eager):.0f}"
        )


if __name__ == "__main__":
    main()
