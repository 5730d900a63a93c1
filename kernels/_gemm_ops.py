"""The GEMM's ``torch.library`` custom ops: ``quack_kernels::gemm`` (its real and fake
implementations, registered autograd (dA and dB through the same kernel) and autocast
kernel, so ``torch.compile(fullgraph=True)`` traces it) and ``quack_kernels::scaled_gemm``
(fp8 with per-tensor scales: real and fake implementations, a backward that refuses).
``ops.gemm`` and ``ops.scaled_gemm`` are the functions users call. Imports torch at the top: imported by ``ops`` (which the build's scan of the package
leaves out)."""

from typing import Optional

import torch
from torch import Tensor

from . import gemm as _gemm
from ._dispatch import NS
from ._gemm_args import check_dtypes as check_gemm_dtypes
from ._gemm_args import check_scales as check_gemm_scales

# --------------------------------------------------------------------------- GEMM


@torch.library.custom_op(f"{NS}::gemm", mutates_args=())
def gemm_op(
    a: Tensor,
    b: Tensor,
    bias: Optional[Tensor],
    c: Optional[Tensor],
    activation: str,
    out_dtype: Optional[torch.dtype],
    beta: float,
) -> Tensor:
    return _gemm.gemm_fwd(a, b, bias, activation, out_dtype, c, beta)


def _fake_out(op: str, a, b, dtype) -> Tensor:
    """The output a fake implementation returns: (..., M, N) of ``dtype``."""
    if (
        a.dim() not in (2, 3)
        or b.dim() != a.dim()
        or a.shape[-1] != b.shape[-2]
        or a.shape[:-2] != b.shape[:-2]
    ):
        raise ValueError(
            f"{op}: a {tuple(a.shape)} @ b {tuple(b.shape)}: expected (M, K) @ (K, N) or (L, M, K) @ (L, K, N)"
        )
    return a.new_empty((*a.shape[:-1], b.shape[-1]), dtype=dtype)


@gemm_op.register_fake
def _(a, b, bias, c, activation, out_dtype, beta):
    check_gemm_dtypes(a, b, out_dtype)
    return _fake_out("gemm", a, b, out_dtype if out_dtype is not None else a.dtype)


def _gemm_setup(ctx, inputs, output):
    a, b, bias, c, activation, out_dtype, beta = inputs
    ctx.save_for_backward(a, b, bias, c, output if activation == "relu" else None)
    ctx.activation, ctx.beta = activation, beta


def _act_grad(ctx, g, a, b, bias, c, out):
    """dD -> d(pre-activation), fp32. relu's from the output's sign; gelu / silu at the
    pre-activation, recomputed by the same kernel without the activation."""
    act = ctx.activation
    if act == "none":
        return g.float()
    if act == "relu":
        return g.float() * (out > 0)
    pre = gemm_op(a, b, bias, c, "none", torch.float32, ctx.beta).detach().requires_grad_()
    with torch.enable_grad():
        y = _gemm.torch_activation(pre, act)
        (dpre,) = torch.autograd.grad(y, pre, g.float())
    return dpre


def _gemm_backward(ctx, g):
    a, b, bias, c, out = ctx.saved_tensors
    dpre = _act_grad(ctx, g, a, b, bias, c, out)
    gp = dpre.to(a.dtype)
    # dA = dD @ B^T, dB = A^T @ dD: the same kernel on transposed views (column-major operands)
    need = ctx.needs_input_grad
    da = gemm_op(gp, b.transpose(-1, -2), None, None, "none", a.dtype, 1.0) if need[0] else None
    db = gemm_op(a.transpose(-1, -2), gp, None, None, "none", b.dtype, 1.0) if need[1] else None
    dbias = None
    if bias is not None and need[2]:
        dbias = dpre.reshape(-1, dpre.shape[-1]).sum(0).to(bias.dtype)
    dc = (dpre * ctx.beta).to(c.dtype) if c is not None and need[3] else None
    return da, db, dbias, dc, None, None, None


torch.library.register_autograd(f"{NS}::gemm", _gemm_backward, setup_context=_gemm_setup)


def autocast_operands(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """a and b in the CUDA autocast dtype, as torch's autocast treats matmul (a float16 /
    bfloat16 / float32 CUDA operand is cast; anything else is left for the op's own checks
    to name). bias and c are not cast: the kernel reads any float dtype and adds in fp32,
    so casting them would only lose bits; the output dtype follows the cast operands (the
    autocast dtype), as torch's matmul's does."""
    dt = torch.get_autocast_dtype("cuda")

    def cast(t):
        return t.to(dt) if t.is_cuda and t.dtype in (torch.float16, torch.bfloat16, torch.float32) else t

    return cast(a), cast(b)


@torch.library.impl(f"{NS}::gemm", "AutocastCUDA")
def _gemm_autocast(a, b, bias, c, activation, out_dtype, beta):
    # Runs ahead of autograd when a torch.autocast("cuda") region is active: the casts are
    # recorded by autograd (gradients reach float32 weights as float32), then the op runs
    # on the cast operands with autocast off, as torch's own autocast kernels redispatch.
    # Without it, float32 operands (AMP training keeps weights in float32) were refused.
    # Not torch.library.register_autocast: it casts to one dtype fixed at registration,
    # where the autocast dtype (bf16 or fp16) is the region's, read here at each call.
    a, b = autocast_operands(a, b)
    with torch.autocast("cuda", enabled=False):
        return gemm_op(a, b, bias, c, activation, out_dtype, beta)


# --------------------------------------------------------------------------- fp8


@torch.library.custom_op(f"{NS}::scaled_gemm", mutates_args=())
def scaled_gemm_op(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    bias: Optional[Tensor],
    c: Optional[Tensor],
    activation: str,
    out_dtype: Optional[torch.dtype],
    beta: float,
    fast_accum: bool,
) -> Tensor:
    return _gemm.gemm_fwd(
        a, b, bias, activation, out_dtype, c, beta, scale_a=scale_a, scale_b=scale_b, fast_accum=fast_accum
    )


@scaled_gemm_op.register_fake
def _(a, b, scale_a, scale_b, bias, c, activation, out_dtype, beta, fast_accum):
    check_gemm_dtypes(a, b, out_dtype, scaled=True)
    check_gemm_scales(a, scale_a, scale_b)
    return _fake_out("scaled_gemm", a, b, out_dtype if out_dtype is not None else torch.bfloat16)


def _no_backward(ctx, g):
    # fp8 training recipes quantize the gradients themselves (their own scales, e5m2) and
    # call the forward op on them; a silent fp32 or bf16 backward would hide that choice
    raise NotImplementedError(
        "quack_kernels.ops.scaled_gemm has no backward: compute dA and dB with scaled_gemm (or "
        "gemm) on the gradients your fp8 recipe quantizes, or detach the fp8 operands"
    )


def _no_setup(ctx, inputs, output):
    pass


torch.library.register_autograd(f"{NS}::scaled_gemm", _no_backward, setup_context=_no_setup)
