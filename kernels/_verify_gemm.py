"""The GEMM's reference hook (``quack verify --run``; ``reference=`` of ``compile_gemm``):
runs the configuration on an odd problem (M, N, K off every tile: 200 x 264 x 136, batch 2)
with its epilogue and operand majors, and asserts with ``_reference.check_gemm``, the check
the GPU tests use. torch is imported inside the function."""

SHAPE = (2, 200, 264, 136)  # L, M, N, K: tails in M, N and K (K: two full 64-slices and 8)


def verify_gemm(params: dict, device) -> None:
    import torch

    from . import _reference as R
    from .ops import gemm

    L, M, N, K = SHAPE
    dt = getattr(torch, params["dtype"])
    out = getattr(torch, params["d_dtype"])
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn((L, M, K), generator=g).to(device=device, dtype=dt)
    b = torch.randn((L, K, N), generator=g).to(device=device, dtype=dt)
    if params["a_major"] == "m":
        a = a.transpose(-1, -2).contiguous().transpose(-1, -2)
    if params["b_major"] == "k":
        b = b.transpose(-1, -2).contiguous().transpose(-1, -2)
    bias = torch.randn(N, generator=g).to(device) if params["has_bias"] else None
    c = torch.randn((L, M, N), generator=g).to(device=device, dtype=out) if params["has_c"] else None
    act = params["activation"]
    d = gemm(a, b, bias=bias, activation=act, out_dtype=out, c=c, beta=0.5)
    R.check_gemm(a, b, bias, act, c, 0.5, d=d, out_dtype=out)
