"""The GEMM's hooks. ``verify_gemm`` (``quack verify --run``; ``reference=`` of
``compile_gemm``): runs the configuration on an odd problem (M, N, K off every tile:
200 x 264 x 136, batch 2; fp8: K = 272, 16-byte rows of one-byte elements) with its
epilogue, operand majors and fp8 scales, and asserts with ``_reference.check_gemm``, the
check the GPU tests use. ``bench_gemm`` (``bench=``, ``quack tune``): the inputs of one
M x N x K problem and the call to time. torch is imported inside the functions."""

SHAPE = (2, 200, 264, 136)  # L, M, N, K: tails in M, N and K (K: two full 64-slices and 8)
SHAPE_FP8 = (2, 200, 264, 272)  # fp8: two full 128-slices and 16 (rows 16-byte aligned)
SCALES = (0.5, 0.25)  # fp8's scale_a, scale_b: powers of two, exact in any product


def verify_gemm(params: dict, device) -> None:
    import torch

    from . import _reference as R

    L, M, N, K = SHAPE_FP8 if _fp8(params) else SHAPE
    g = torch.Generator(device=device).manual_seed(0)  # drawn where used (kernels/_verify.py _gen)
    a, b, bias, c, out, scales = _operands(params, M, N, K, L, device, g)
    act = params["activation"]
    d = _call(params, a, b, bias, c, out, scales)()
    R.check_gemm(a, b, bias, act, c, 0.5, d=d, out_dtype=out, **_scale_kw(params, scales))


def _fp8(params: dict) -> bool:
    from ._gemm_plan import FP8_DTYPES

    return params["dtype"] in FP8_DTYPES


def _scale_kw(params: dict, scales) -> dict:
    if scales is None:
        return {}
    return {"scale_a": scales[0], "scale_b": scales[1], "fast_accum": params.get("fast_accum", False)}


def _call(params: dict, a, b, bias, c, out, scales):
    """The op call (through the torch-facing ops, as a user calls it)."""
    from .ops import gemm, scaled_gemm

    act = params["activation"]
    if scales is None:
        return lambda: gemm(a, b, bias=bias, activation=act, out_dtype=out, c=c, beta=0.5)
    fast = params.get("fast_accum", False)
    return lambda: scaled_gemm(
        a, b, *scales, bias=bias, activation=act, out_dtype=out, c=c, beta=0.5, fast_accum=fast
    )


def _operands(params: dict, m: int, n: int, k: int, batch: int, device, g):
    """a (L, M, K), b (L, K, N) of the parameters' dtype in their major orders, bias (N,)
    and c (L, M, N) when the epilogue reads them, fp8's scales (else None)."""
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
    scales = None
    if _fp8(params):
        scales = tuple(torch.tensor([s], device=device, dtype=torch.float32) for s in SCALES)
    return a, b, bias, c, out, scales


def bench_gemm(params: dict, device, m: int, n: int, k: int):
    """``quack tune``'s call for one problem: D = act(A @ B + bias + beta * C) at M x N x K
    (batch 1, 2-D operands as a model calls it; fp8 with its scales) through ``gemm_fwd``,
    which runs the configuration ``quack.tuning.use_config`` forces."""
    import torch

    from .gemm import gemm_fwd

    g = torch.Generator(device=device).manual_seed(0)  # on the GPU: 8192 x 28672 in ms
    a, b, bias, c, out, scales = _operands(params, m, n, k, 1, device, g)
    a, b, c = a[0], b[0], (c[0] if c is not None else None)
    act = params["activation"]
    kw = _scale_kw(params, scales)
    return lambda: gemm_fwd(a, b, bias=bias, activation=act, out_dtype=out, c=c, beta=0.5, **kw)
