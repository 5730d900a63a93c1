"""The GEMM's hooks. ``verify_gemm`` (``quack verify --run``; ``reference=`` of
``compile_gemm``): runs the configuration on an odd problem (M, N, K off every tile:
200 x 264 x 136, batch 2) with its epilogue and operand majors, and asserts with
``_reference.check_gemm``, the check the GPU tests use. ``bench_gemm`` (``bench=``,
``quack tune``): the inputs of one M x N x K problem and the call to time. torch is imported
inside the functions."""

SHAPE = (2, 200, 264, 136)  # L, M, N, K: tails in M, N and K (K: two full 64-slices and 8)


def verify_gemm(params: dict, device) -> None:
    import torch

    from . import _reference as R
    from .ops import gemm

    L, M, N, K = SHAPE
    g = torch.Generator(device=device).manual_seed(0)  # drawn where used (kernels/_verify.py _gen)
    a, b, bias, c, out = _operands(params, M, N, K, L, device, g)
    act = params["activation"]
    d = gemm(a, b, bias=bias, activation=act, out_dtype=out, c=c, beta=0.5)
    R.check_gemm(a, b, bias, act, c, 0.5, d=d, out_dtype=out)


def _operands(params: dict, m: int, n: int, k: int, batch: int, device, g):
    """a (L, M, K), b (L, K, N) of the parameters' dtype in their major orders, bias (N,)
    and c (L, M, N) when the epilogue reads them."""
    import torch

    dt = getattr(torch, params["dtype"])
    out = getattr(torch, params["d_dtype"])
    a = torch.randn((batch, m, k), generator=g, device=g.device).to(device=device, dtype=dt)
    b = torch.randn((batch, k, n), generator=g, device=g.device).to(device=device, dtype=dt)
    if params["a_major"] == "m":
        a = a.transpose(-1, -2).contiguous().transpose(-1, -2)
    if params["b_major"] == "k":
        b = b.transpose(-1, -2).contiguous().transpose(-1, -2)
    bias = torch.randn(n, generator=g, device=g.device).to(device) if params["has_bias"] else None
    c = (
        torch.randn((batch, m, n), generator=g, device=g.device).to(device=device, dtype=out)
        if params["has_c"]
        else None
    )
    return a, b, bias, c, out


def bench_gemm(params: dict, device, m: int, n: int, k: int):
    """``quack tune``'s call for one problem: D = act(A @ B + bias + beta * C) at M x N x K
    (batch 1, 2-D operands as a model calls it) through ``gemm_fwd``, which runs the
    configuration ``quack.tuning.use_config`` forces."""
    import torch

    from .gemm import gemm_fwd

    g = torch.Generator(device=device).manual_seed(0)  # on the GPU: 8192 x 28672 in ms
    a, b, bias, c, out = _operands(params, m, n, k, 1, device, g)
    a, b, c = a[0], b[0], (c[0] if c is not None else None)
    act = params["activation"]
    return lambda: gemm_fwd(a, b, bias=bias, activation=act, out_dtype=out, c=c, beta=0.5)
