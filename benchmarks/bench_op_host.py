"""Host cost of an eager call of each ``quack_kernels.ops`` function against torch's own op,
side by side in one run: microseconds of this thread per call with the GPU kept busy (so
only queueing is timed, not the kernel). For a small problem this time is the op's latency.

Three columns per op: torch's op; the quack function as users call it (plain eager calls
skip the custom op's Python dispatch, ``_dispatch.direct``); the same call through the custom op
(what a call that needs autograd, a dispatch mode or the profiler takes).

    python benchmarks/bench_op_host.py     # needs a CUDA GPU; compiles missing configurations
"""

import sys
import time

import torch


def host_us(fn, calls=200, rounds=5):
    """Best of ``rounds`` of the mean over ``calls`` queued calls (microseconds): the GPU
    spins meanwhile, so a call never waits for the kernel before it."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        torch.cuda._sleep(int(2e9 * 0.1))  # ~100 ms of GPU spin: the queue never drains
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def main():
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from quack_kernels import ops

    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(shape, generator=g, device="cuda").to(dtype)

    x, w = rand(64, 4096), rand(4096)
    xs = rand(64, 1000, dtype=torch.float32)
    t = torch.randint(0, 1000, (64,), device="cuda")
    a, b, bias = rand(256, 4096), rand(4096, 4096).t(), rand(4096)
    F = torch.nn.functional
    rows = [
        ("rmsnorm 64x4096", lambda: F.rms_norm(x, (4096,), w), lambda: ops.rmsnorm(x, w),
         lambda: ops.rmsnorm_fwd(x, w, None, None, 1e-6)),
        ("layernorm 64x4096", lambda: F.layer_norm(x, (4096,), w, w), lambda: ops.layernorm(x, w, w),
         lambda: ops.layernorm_fwd(x, w, w, 1e-5)),
        ("softmax 64x1000", lambda: torch.softmax(xs, -1), lambda: ops.softmax(xs), lambda: ops.softmax_fwd(xs)),
        ("cross_entropy 64x1000", lambda: F.cross_entropy(xs, t, reduction="none"),
         lambda: ops.cross_entropy(xs, t, reduction="none"),
         lambda: ops.cross_entropy_fwd(xs, t, None, -100, 0.0)),
        ("gemm 256x4096x4096", lambda: torch.matmul(a, b), lambda: ops.gemm(a, b),
         lambda: ops.gemm_op(a, b, None, None, "none", None, 1.0)),
        ("gemm + bias + gelu", lambda: F.gelu(torch.matmul(a, b) + bias, approximate="tanh"),
         lambda: ops.gemm(a, b, bias=bias, activation="gelu_tanh"),
         lambda: ops.gemm_op(a, b, bias, None, "gelu_tanh", None, 1.0)),
    ]  # fmt: skip
    print(f"{'op':>24} | {'torch us':>8} | {'quack us':>8} | {'via custom op us':>16} | quack / torch")
    for name, ref, quack, through in rows:
        t_ref, t_q, t_op = host_us(ref), host_us(quack), host_us(through)
        print(f"{name:>24} | {t_ref:8.1f} | {t_q:8.1f} | {t_op:16.1f} | {t_q / t_ref:.2f}x")


if __name__ == "__main__":
    main()
