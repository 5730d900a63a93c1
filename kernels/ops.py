"""The kernels as ``torch.library`` custom ops (namespace ``quack_kernels``), with fake
implementations and registered autograd, so that ``torch.compile(fullgraph=True)`` traces
them forward and backward without a graph break. The ops are opaque to the compiler:
compiling and loading a kernel (``@jit_cache``: memory -> disk -> compile worker) happens
inside the op's real implementation, at run time, never in the traced graph.

The differentiable functions (``rmsnorm``, ``layernorm``, ``softmax``, ``cross_entropy``)
live here, not in their family modules: this module imports the families' torch wrappers,
so a family importing it back made every family's source fingerprint cover every other
family (an edit to softmax.py moved every RMSNorm object). The GEMM's custom op (its
fake implementation, autograd and autocast kernel) lives in ``_gemm_ops`` and the
direct-path test in ``_dispatch``: this module was past the house cap with them.

Imports torch at the top: the family modules import it only inside functions, so that
importing them stays torch-free (``quack build`` and the loaders import them). The real
implementations are registered for every device: on a CPU tensor they raise the torch
wrappers' ValueError ("must be a CUDA tensor"); on meta / fake tensors the fake
implementations run.

An absent optional output (rmsnorm's residual_out, a norm's dweight / dbias) is an empty
tensor, since a custom op cannot return None.
"""

from typing import Optional

import torch
from torch import Tensor

from . import cross_entropy as _ce
from . import gemm as _gemm
from . import layernorm as _ln
from . import rmsnorm as _rms
from . import softmax as _sm
from ._dispatch import NS
from ._dispatch import direct as _direct
from ._gemm_args import check_scales as check_gemm_scales
from ._gemm_ops import autocast_operands, gemm_op, scaled_gemm_op

_F32 = torch.float32


def _rows_shape(x: Tensor):
    return x.shape[:-1]


def _empty(x: Tensor) -> Tensor:
    return x.new_empty((0,))


# --------------------------------------------------------------------------- RMSNorm


@torch.library.custom_op(f"{NS}::rmsnorm_fwd", mutates_args=())
def rmsnorm_fwd(
    x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor], eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    y, rstd, ro = _rms.rmsnorm_fwd(x, weight, bias, residual, eps)
    return y, rstd, (ro if ro is not None else _empty(x))


@rmsnorm_fwd.register_fake
def _(x, weight, bias, residual, eps):
    ro = torch.empty_like(x) if residual is not None else _empty(x)
    return torch.empty_like(x), x.new_empty(_rows_shape(x), dtype=_F32), ro


@torch.library.custom_op(f"{NS}::rmsnorm_bwd", mutates_args=())
def rmsnorm_bwd(
    x: Tensor, weight: Optional[Tensor], dy: Tensor, rstd: Tensor, bias: Optional[Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    out = _rms.rmsnorm_bwd(x, weight, dy, rstd, bias)
    dx, dw = out[0], out[1]
    db = out[2] if bias is not None else None
    return (dx, dw if dw is not None else _empty(x), db if db is not None else _empty(x))


@rmsnorm_bwd.register_fake
def _(x, weight, dy, rstd, bias):
    n = x.shape[-1]
    dw = x.new_empty((n,), dtype=weight.dtype) if weight is not None else _empty(x)
    db = x.new_empty((n,), dtype=bias.dtype) if bias is not None else _empty(x)
    return torch.empty_like(x), dw, db


def _rms_setup(ctx, inputs, output):
    x, weight, bias, residual, eps = inputs
    y, rstd, ro = output
    h = ro if residual is not None else x
    ctx.save_for_backward(h, weight, rstd, bias)
    ctx.has_residual = residual is not None
    ctx.needs = (weight is not None, bias is not None)


def _rms_backward(ctx, dy, drstd, dro):
    h, weight, rstd, bias = ctx.saved_tensors
    dh, dw, db = rmsnorm_bwd(h, weight, dy.contiguous(), rstd, bias)
    if ctx.has_residual and dro is not None and dro.numel() > 0:
        dh = dh + dro
    return (
        dh,
        dw if ctx.needs[0] else None,
        db if ctx.needs[1] else None,
        dh if ctx.has_residual else None,
        None,
    )


torch.library.register_autograd(f"{NS}::rmsnorm_fwd", _rms_backward, setup_context=_rms_setup)


def rmsnorm(x, weight=None, bias=None, residual=None, eps: float = 1e-6):
    """Differentiable RMSNorm (the ``quack_kernels::rmsnorm_fwd`` custom op with its
    registered autograd: works under ``torch.compile(fullgraph=True)``). Returns y, or
    ``(y, x + residual)`` when a residual is given."""
    if _direct(x, weight, bias, residual):
        y, _, ro = _rms.rmsnorm_fwd(x, weight, bias, residual, float(eps))
    else:
        y, _, ro = rmsnorm_fwd(x, weight, bias, residual, float(eps))
    return (y, ro) if residual is not None else y


# --------------------------------------------------------------------------- LayerNorm


@torch.library.custom_op(f"{NS}::layernorm_fwd", mutates_args=())
def layernorm_fwd(
    x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    return _ln.layernorm_fwd(x, weight, bias, eps)


@layernorm_fwd.register_fake
def _(x, weight, bias, eps):
    s = _rows_shape(x)
    return torch.empty_like(x), x.new_empty(s, dtype=_F32), x.new_empty(s, dtype=_F32)


@torch.library.custom_op(f"{NS}::layernorm_bwd", mutates_args=())
def layernorm_bwd(
    x: Tensor, weight: Optional[Tensor], dy: Tensor, mean: Tensor, rstd: Tensor, bias: Optional[Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    dx, dw, db = _ln.layernorm_bwd(x, weight, dy, mean, rstd, bias)
    return (dx, dw if dw is not None else _empty(x), db if db is not None else _empty(x))


@layernorm_bwd.register_fake
def _(x, weight, dy, mean, rstd, bias):
    n = x.shape[-1]
    dw = x.new_empty((n,), dtype=weight.dtype) if weight is not None else _empty(x)
    db = x.new_empty((n,), dtype=bias.dtype) if bias is not None else _empty(x)
    return torch.empty_like(x), dw, db


def _ln_setup(ctx, inputs, output):
    x, weight, bias, eps = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd, bias)
    ctx.needs = (weight is not None, bias is not None)


def _ln_backward(ctx, dy, dmean, drstd):
    x, weight, mean, rstd, bias = ctx.saved_tensors
    dx, dw, db = layernorm_bwd(x, weight, dy.contiguous(), mean, rstd, bias)
    return dx, dw if ctx.needs[0] else None, db if ctx.needs[1] else None, None


torch.library.register_autograd(f"{NS}::layernorm_fwd", _ln_backward, setup_context=_ln_setup)


def layernorm(x, weight=None, bias=None, eps: float = 1e-5):
    """Differentiable LayerNorm (the ``quack_kernels::layernorm_fwd`` custom op with its
    registered autograd; works under ``torch.compile(fullgraph=True)``); returns y."""
    if _direct(x, weight, bias):
        return _ln.layernorm_fwd(x, weight, bias, float(eps))[0]
    return layernorm_fwd(x, weight, bias, float(eps))[0]


# --------------------------------------------------------------------------- softmax


@torch.library.custom_op(f"{NS}::softmax_fwd", mutates_args=())
def softmax_fwd(x: Tensor) -> Tensor:
    return _sm.softmax_fwd(x)


@softmax_fwd.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op(f"{NS}::softmax_bwd", mutates_args=())
def softmax_bwd(dy: Tensor, y: Tensor) -> Tensor:
    return _sm.softmax_bwd(dy, y)


@softmax_bwd.register_fake
def _(dy, y):
    return torch.empty_like(y)


def _sm_setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _sm_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return softmax_bwd(dy.contiguous(), y)


torch.library.register_autograd(f"{NS}::softmax_fwd", _sm_backward, setup_context=_sm_setup)


def softmax(x):
    """Differentiable softmax over the last dim (the ``quack_kernels::softmax_fwd`` custom
    op with its registered autograd; works under ``torch.compile(fullgraph=True)``)."""
    if _direct(x):
        return _sm.softmax_fwd(x)
    return softmax_fwd(x)


# --------------------------------------------------------------------------- cross-entropy


@torch.library.custom_op(f"{NS}::cross_entropy_fwd", mutates_args=())
def cross_entropy_fwd(
    logits: Tensor, target: Tensor, weight: Optional[Tensor], ignore_index: int, label_smoothing: float
) -> tuple[Tensor, Tensor]:
    return _ce.cross_entropy_fwd(logits, target, ignore_index, weight, label_smoothing)


@cross_entropy_fwd.register_fake
def _(logits, target, weight, ignore_index, label_smoothing):
    s = _rows_shape(logits)
    return logits.new_empty(s, dtype=_F32), logits.new_empty(s, dtype=_F32)


@torch.library.custom_op(f"{NS}::cross_entropy_bwd", mutates_args=())
def cross_entropy_bwd(
    logits: Tensor,
    target: Tensor,
    dloss: Tensor,
    lse: Tensor,
    weight: Optional[Tensor],
    ignore_index: int,
    label_smoothing: float,
) -> Tensor:
    return _ce.cross_entropy_bwd(logits, target, dloss, lse, ignore_index, weight, label_smoothing)


@cross_entropy_bwd.register_fake
def _(logits, target, dloss, lse, weight, ignore_index, label_smoothing):
    return torch.empty_like(logits)


def _ce_setup(ctx, inputs, output):
    logits, target, weight, ignore_index, label_smoothing = inputs
    _, lse = output
    ctx.save_for_backward(logits, target, lse, weight)
    ctx.args = (ignore_index, label_smoothing)


def _ce_backward(ctx, dloss, dlse):
    logits, target, lse, weight = ctx.saved_tensors
    dx = cross_entropy_bwd(logits, target, dloss.float().contiguous(), lse, weight, *ctx.args)
    return dx, None, None, None, None


torch.library.register_autograd(f"{NS}::cross_entropy_fwd", _ce_backward, setup_context=_ce_setup)


def cross_entropy(
    logits,
    target,
    ignore_index: int = -100,
    reduction: str = "mean",
    weight=None,
    label_smoothing: float = 0.0,
):
    """Differentiable cross-entropy with torch's semantics (the
    ``quack_kernels::cross_entropy_fwd`` custom op with its registered autograd; works
    under ``torch.compile(fullgraph=True)``). reduction 'none', 'sum' or 'mean' (divided
    by the summed class weights of the non-ignored targets: their count without weights)."""
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
    if _direct(logits, target, weight):
        loss, _ = _ce.cross_entropy_fwd(logits, target, int(ignore_index), weight, float(label_smoothing))
    else:
        loss, _ = cross_entropy_fwd(logits, target, weight, int(ignore_index), float(label_smoothing))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    valid = target != ignore_index
    if weight is None:
        return loss.sum() / valid.sum()
    # torch: divided by the summed weights of the non-ignored targets
    n = logits.shape[-1]
    return loss.sum() / (weight.float()[target.clamp(0, n - 1)] * valid).sum()


# --------------------------------------------------------------------------- GEMM


def gemm(a, b, *, bias=None, activation=None, out_dtype=None, c=None, beta: float = 1.0):
    """Differentiable D = act(a @ b + bias + beta * c) on the Hopper GEMM (the
    ``quack_kernels::gemm`` custom op with its registered autograd: dA and dB through the
    same kernel; works under ``torch.compile(fullgraph=True)``). a (M, K) / (L, M, K), b
    (K, N) / (L, K, N) float16 / bfloat16; activation None, "relu", "gelu_tanh" or "silu";
    out_dtype float16 / bfloat16 / float32 (default a's). Inside ``torch.autocast("cuda")``
    a and b are cast to the autocast dtype first (``_gemm_ops.autocast_operands``), on either path."""
    if torch.is_autocast_enabled("cuda"):
        # Cast here, not only in the op's AutocastCUDA kernel: the direct path never reaches
        # that kernel, and under torch.compile (torch 2.11) the ambient autocast dtype is
        # not in the key of torch's graph caches, so a graph traced under bfloat16 autocast
        # was reused under float16 (bfloat16 output; test_gemm_gpu's autocast test, on the
        # H200). Here the casts are graph nodes of their dtype.
        a, b = autocast_operands(a, b)
    if _direct(a, b, bias, c):
        return _gemm.gemm_fwd(a, b, bias, activation or "none", out_dtype, c, float(beta))
    return gemm_op(a, b, bias, c, activation or "none", out_dtype, float(beta))


def scaled_gemm(
    a,
    b,
    scale_a,
    scale_b,
    *,
    bias=None,
    activation=None,
    out_dtype=None,
    c=None,
    beta: float = 1.0,
    fast_accum: bool = False,
):
    """D = act(scale_a * scale_b * (a @ b) + bias + beta * c) on the Hopper GEMM with fp8
    operands, as ``torch._scaled_mm`` takes them: a (M, K) row-major, b (K, N) column-major
    (a row-major (N, K) weight, transposed), both float8_e4m3fn or both float8_e5m2 (also
    batched, (L, M, K) @ (L, K, N)); scale_a, scale_b float32 tensors of one element (per
    tensor); out_dtype bfloat16 (default), float16 or float32. ``fast_accum`` (torch's
    use_fast_accum): the products accumulate in the fp8 tensor cores' own accumulator
    (fewer mantissa bits: faster, larger tiles); off, each 128-deep K slice is added into
    an fp32 total (_gemm_plan.promotes). The ``quack_kernels::scaled_gemm`` custom op: a
    fake implementation (torch.compile(fullgraph=True)), no backward."""
    if isinstance(a, Tensor):
        check_gemm_scales(a, scale_a, scale_b)  # before the dispatcher's own schema message
    if _direct(a, b, scale_a, scale_b, bias, c):
        return _gemm.gemm_fwd(
            a,
            b,
            bias,
            activation or "none",
            out_dtype,
            c,
            float(beta),
            scale_a=scale_a,
            scale_b=scale_b,
            fast_accum=fast_accum,
        )
    return scaled_gemm_op(
        a, b, scale_a, scale_b, bias, c, activation or "none", out_dtype, float(beta), fast_accum
    )
