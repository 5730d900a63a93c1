"""The kernels' references and tolerances, defined ONCE: what each kernel family is specified
to compute (in float32, from the same rounded inputs the kernel reads) and how close its
outputs must be. ``quack verify --run`` (the reference hooks in ``_verify``) and the GPU tests
(tests/kernels/*_gpu.py) both call the ``check_*`` functions here; two copies drifted once
(issue 24: 43 false "wrong result" reports), and tests/kernels/test_reference_hooks.py fails if
a private copy comes back.

Imports torch: import this module lazily (the hooks and tests do), never from a kernel module's
top level, so registering kernels stays torch-free. Not among the kernels' sources: the kernel
modules name ``_verify`` only in strings, so an edit here leaves every cache key alone.

Tolerances (``tolerance``) depend on the compared output's dtype, on N and on the rows summed
into it; input and weight dtypes enter through that output dtype only, because the reference
reads the very (rounded) inputs the kernel read, so input rounding is no error.
- bfloat16 1e-2, float16 1e-3 (atol and rtol): the output is the fp32 result rounded once to
  its dtype, at most half an ulp away (bf16 2^-9 ~ 2.0e-3, fp16 2^-11 ~ 4.9e-4 relative), plus
  the fp32 differences below (~1e-5); 1e-2 / 1e-3 leave at least 2x over that.
- float32 1e-4: fp32 results of N-term reductions (sums of squares, max / sum of exp, dot
  products) whose order differs from torch's (tree across threads and CTAs vs torch's kernels),
  plus approximate rsqrt / ex2 / lg2 (~2^-22 relative): ~sqrt(N) * 2^-24 typical, 3.1e-5 at
  N_MAX = 2^18; the bound grows with sqrt(N) should N_MAX grow (``tolerance``).
- A sum over ``rows`` rows (dweight, dbias): atol * sqrt(rows), the random walk of rows errors
  of O(1) terms; rtol unchanged (the rounding of the sum itself is relative).
- Probabilities (softmax y / dx, cross-entropy dlogits): values <= 1, mostly << 1 (1/N), so the
  error is relative (rtol as above) and atol covers only underflow (fp16 subnormals below 6e-5,
  flush-to-zero of fp32 denormals): a tenth of the O(1) atol, so that a 1/N-sized value is
  still checked.
"""

import math

import torch

TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-4}
_FP32_ACC = 3 * 2.0**-24  # times sqrt(N): fp32 accumulation-order difference, with margin
_F32_MAX = torch.finfo(torch.float32).max


def tolerance(dtype, *, n: int, rows: int = 1, probabilities: bool = False) -> tuple[float, float]:
    """(atol, rtol) for an output of ``dtype`` computed over rows of ``n`` elements, summed
    over ``rows`` rows, holding probabilities or O(1) values (the module docstring says why)."""
    t = TOL[dtype]
    if dtype == torch.float32:
        # 1e-4 >= 3 sqrt(N) 2^-24 for every N <= N_MAX (2^18: 9.2e-5); beyond, the bound rules
        t = max(t, _FP32_ACC * math.sqrt(n))
    atol = t * math.sqrt(rows)
    return (atol / 10 if probabilities else atol), t


def assert_close(
    got, ref, what: str, *, n: int, rows: int = 1, probabilities: bool = False, dtype=None, rounded_to=None
):
    """``got`` (the kernel's output) against the fp32 ``ref`` with ``tolerance`` of got's
    dtype, which must be ``dtype`` when given (the kernel's contract: a wrong output dtype is a
    wrong result, and the tolerance must not follow it). ``rounded_to``: the dtype whose
    tolerance applies instead, for an fp32 value computed from intermediates rounded to it
    (e.g. a sum of a bf16 softmax's outputs)."""
    assert got is not None, f"{what}: missing (None)"
    if dtype is not None:
        assert got.dtype == dtype, f"{what}: dtype {got.dtype}, expected {dtype}"
    atol, rtol = tolerance(rounded_to or got.dtype, n=n, rows=rows, probabilities=probabilities)
    g, r = got.float(), ref.float()
    if g.shape == r.shape and g.device == r.device:
        # The passing case in one fused pass and one device sync: torch.isclose's own test,
        # |got - ref| <= atol + rtol |ref|, with the bound capped to a finite value, so a NaN
        # (either side) or an infinity fails it and goes on to the exact checks below. Those
        # two (the NaN test, then torch.testing.assert_close) cost ~0.2 ms of CPU and two
        # syncs per output: a second of the GPU tier's ~6,000 checks and of verify --run's.
        bound = (rtol * r.abs()).add_(atol).clamp_(max=_F32_MAX)
        if bool((g - r).abs_().le_(bound).all()):
            return
    assert not torch.isnan(got).any(), f"{what}: NaN (an element the kernel never wrote?)"
    torch.testing.assert_close(g, r, atol=atol, rtol=rtol, msg=lambda s: f"{what}: {s}")


def _check(got: dict, ref: dict, spec: dict, n: int, rows: int) -> None:
    """Every output in ``got`` (a subset of the family's outputs: autograd wrappers return
    some) against ``ref``; ``spec``: name -> (expected dtype, summed over rows, probabilities)."""
    unknown = set(got) - set(spec)
    assert not unknown, f"no reference for outputs {sorted(unknown)}; known: {sorted(spec)}"
    for name, value in got.items():
        dtype, summed, probs = spec[name]
        if ref[name] is None:
            assert value is None, f"{name}: expected None (the input it belongs to is absent)"
            continue
        assert_close(
            value, ref[name], name, n=n, rows=rows if summed else 1, probabilities=probs, dtype=dtype
        )


def _f(t):
    return None if t is None else t.float()


def _rows(x) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


# --------------------------------------------------------------------------- RMSNorm


def rmsnorm_fwd_ref(x, w, b, r, eps: float) -> dict:
    """y = h * rstd (* w) (+ b), rstd = 1 / sqrt(mean(h^2) + eps), where h = x + r ROUNDED to
    x's dtype: the kernel stores the residual in x's dtype and normalizes that stored value
    (kernels/_rms_fwd.py: the backward differentiates at it, so forward and backward are one
    function; at small N, |h|^2 ~ eps, the unrounded sum differs by up to 3e-2 in rstd)."""
    h = x.float()
    if r is not None:
        h = (h + r.float()).to(x.dtype).float()
    rstd = torch.rsqrt(h.pow(2).mean(-1) + eps)
    y = h * rstd[..., None]
    if w is not None:
        y = y * w.float()
    if b is not None:
        y = y + b.float()
    return {"y": y, "rstd": rstd, "residual_out": h if r is not None else None}


def check_rmsnorm_fwd(x, w, b, r, eps: float, **got) -> None:
    """``got``: any of y, rstd, residual_out (``rmsnorm_fwd``'s outputs)."""
    spec = {"y": (x.dtype, False, False), "rstd": (torch.float32, False, False)}
    spec["residual_out"] = (x.dtype, False, False)
    _check(got, rmsnorm_fwd_ref(x, w, b, r, eps), spec, x.shape[-1], _rows(x))


def rmsnorm_bwd_ref(h, w, dy, eps: float, has_bias: bool = False) -> dict:
    """fp32 autograd of y = h * rstd(h) (* w) (+ b) at ``h`` (the normalized input: the stored
    residual when one was added): dx, dw = sum_rows(dy * h * rstd), db = sum_rows(dy)."""
    n = h.shape[-1]
    hr = h.detach().float().requires_grad_()
    wr = w.detach().float().requires_grad_() if w is not None else None
    y = hr * torch.rsqrt(hr.pow(2).mean(-1, keepdim=True) + eps)
    (y * wr if wr is not None else y).backward(dy.float())
    db = dy.float().reshape(-1, n).sum(0) if has_bias else None
    return {"dx": hr.grad, "dw": wr.grad if wr is not None else None, "db": db}


def check_rmsnorm_bwd(h, w, dy, eps: float, bias_dtype=None, **got) -> None:
    """``got``: any of dx, dw (w's dtype), db (``bias_dtype``: the bias's dtype)."""
    spec = {"dx": (h.dtype, False, False), "dw": (w.dtype if w is not None else None, True, False)}
    spec["db"] = (bias_dtype, True, False)
    _check(got, rmsnorm_bwd_ref(h, w, dy, eps, bias_dtype is not None), spec, h.shape[-1], _rows(h))


# --------------------------------------------------------------------------- LayerNorm


def layernorm_fwd_ref(x, w, b, eps: float) -> dict:
    """torch's layer_norm in fp32 with its mean and rstd (biased variance)."""
    xf = x.float()
    y = torch.nn.functional.layer_norm(xf, (x.shape[-1],), _f(w), _f(b), eps)
    return {"y": y, "mean": xf.mean(-1), "rstd": torch.rsqrt(xf.var(-1, unbiased=False) + eps)}


def check_layernorm_fwd(x, w, b, eps: float, **got) -> None:
    """``got``: any of y, mean, rstd (``layernorm_fwd``'s outputs)."""
    spec = {"y": (x.dtype, False, False), "mean": (torch.float32, False, False)}
    spec["rstd"] = (torch.float32, False, False)
    _check(got, layernorm_fwd_ref(x, w, b, eps), spec, x.shape[-1], _rows(x))


def layernorm_bwd_ref(x, w, b, dy, eps: float) -> dict:
    """fp32 autograd of torch's layer_norm: dx, dw, db (None where w / b are absent)."""
    xr = x.detach().float().requires_grad_()
    wr = w.detach().float().requires_grad_() if w is not None else None
    br = b.detach().float().requires_grad_() if b is not None else None
    torch.nn.functional.layer_norm(xr, (x.shape[-1],), wr, br, eps).backward(dy.float())
    return {"dx": xr.grad, "dw": None if wr is None else wr.grad, "db": None if br is None else br.grad}


def check_layernorm_bwd(x, w, b, dy, eps: float, **got) -> None:
    """``got``: any of dx, dw (w's dtype), db (b's dtype)."""
    spec = {"dx": (x.dtype, False, False), "dw": (w.dtype if w is not None else None, True, False)}
    spec["db"] = (b.dtype if b is not None else None, True, False)
    _check(got, layernorm_bwd_ref(x, w, b, dy, eps), spec, x.shape[-1], _rows(x))


# --------------------------------------------------------------------------- softmax


def softmax_fwd_ref(x) -> dict:
    return {"y": torch.softmax(x.float(), -1)}


def check_softmax_fwd(x, **got) -> None:
    _check(got, softmax_fwd_ref(x), {"y": (x.dtype, False, True)}, x.shape[-1], _rows(x))


def softmax_bwd_ref(dy, y) -> dict:
    """dx = y * (dy - sum(y * dy)) at the STORED y (the backward reads it, rounded)."""
    yf, dyf = y.float(), dy.float()
    return {"dx": yf * (dyf - (yf * dyf).sum(-1, keepdim=True))}


def check_softmax_bwd(dy, y, **got) -> None:
    _check(got, softmax_bwd_ref(dy, y), {"dx": (y.dtype, False, True)}, y.shape[-1], _rows(y))


# --------------------------------------------------------------------------- cross-entropy


def cross_entropy_ref(
    x, t, ignore_index: int = -100, weight=None, label_smoothing: float = 0.0, *, reduction="none"
):
    """torch's cross_entropy in fp32 (the wrappers' semantics: ``quack_kernels.cross_entropy``)."""
    return torch.nn.functional.cross_entropy(
        x.float(),
        t,
        weight=_f(weight),
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        reduction=reduction,
    )


def cross_entropy_fwd_ref(x, t, ignore_index=-100, weight=None, label_smoothing=0.0) -> dict:
    """Per-row loss (0 on ignored rows) and the row's logsumexp (every row)."""
    loss = cross_entropy_ref(x, t, ignore_index, weight, label_smoothing)
    return {"loss": loss, "lse": torch.logsumexp(x.float(), -1)}


def check_cross_entropy_fwd(x, t, ignore_index=-100, weight=None, label_smoothing=0.0, **got) -> None:
    """``got``: any of loss, lse (float32 whatever the logits' dtype)."""
    spec = {"loss": (torch.float32, False, False), "lse": (torch.float32, False, False)}
    ref = cross_entropy_fwd_ref(x, t, ignore_index, weight, label_smoothing)
    _check(got, ref, spec, x.shape[-1], _rows(x))


def cross_entropy_bwd_ref(x, t, dloss, ignore_index=-100, weight=None, label_smoothing=0.0, reduction="none"):
    """dlogits: fp32 autograd of ``cross_entropy_ref`` with upstream gradient ``dloss``."""
    xr = x.detach().float().requires_grad_()
    loss = torch.nn.functional.cross_entropy(
        xr,
        t,
        weight=_f(weight),
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        reduction=reduction,
    )
    loss.backward(dloss.float())
    return {"dx": xr.grad}


def check_cross_entropy_bwd(
    x, t, dloss, ignore_index=-100, weight=None, label_smoothing=0.0, reduction="none", **got
) -> None:
    """``got``: dx (the logits' dtype); softmax-sized values, probabilities' tolerance."""
    ref = cross_entropy_bwd_ref(x, t, dloss, ignore_index, weight, label_smoothing, reduction)
    _check(got, ref, {"dx": (x.dtype, False, True)}, x.shape[-1], _rows(x))


# --------------------------------------------------------------------------- GEMM


def gemm_ref(a, b, bias=None, activation="none", c=None, beta=1.0, scale_a=None, scale_b=None):
    """act(a @ b + bias + beta * c) in fp32 (float64 products summed in fp32: the reference
    the kernel's error is measured against), from the very inputs the kernel read; fp8 a
    and b with their per-tensor scales: act(scale_a * scale_b * (a @ b) + ...)."""
    from .gemm import torch_activation

    prod = torch.matmul(a.double(), b.double())
    if scale_a is not None:
        prod = prod * (scale_a.double() * scale_b.double())
    pre = prod.float()
    if bias is not None:
        pre = pre + bias.float()
    if c is not None:
        pre = pre + beta * c.float()
    return torch_activation(pre, activation)


def check_gemm(
    a,
    b,
    bias=None,
    activation="none",
    c=None,
    beta=1.0,
    *,
    d,
    out_dtype=None,
    scale_a=None,
    scale_b=None,
    fast_accum=False,
) -> None:
    """The issue-28 criterion: the kernel's error against the fp32 reference at most 2x
    torch.matmul's own (the same epilogue in fp32 torch, rounded to the output dtype), plus
    one ulp of the output dtype's rounding at the largest value (an equal-error kernel and
    torch can round a tie differently). fp8 a and b (``scale_a`` / ``scale_b`` given): torch's
    is torch._scaled_mm's with the same ``fast_accum``, as cuBLAS accumulates fp8."""
    scaled = scale_a is not None
    want = out_dtype or (torch.bfloat16 if scaled else a.dtype)
    assert d.dtype == want, f"d: dtype {d.dtype}, expected {want}"
    assert not torch.isnan(d).any(), "d: NaN (an element the kernel never wrote?)"
    ref = gemm_ref(a, b, bias, activation, c, beta, scale_a, scale_b)
    from .gemm import torch_activation

    pre = _scaled_mm(a, b, scale_a, scale_b, fast_accum) if scaled else torch.matmul(a, b).float()
    pre = pre + (bias.float() if bias is not None else 0.0) + (beta * c.float() if c is not None else 0.0)
    torch_err = (torch_activation(pre, activation).to(want).float() - ref).abs().max().item()
    err = (d.float() - ref).abs().max().item()
    ulp = torch.finfo(want).eps * ref.abs().max().item()
    assert err <= 2 * torch_err + ulp, (
        f"d: max error {err:.3g} vs torch.matmul's {torch_err:.3g} (bound 2x + {ulp:.3g})"
    )


def _scaled_mm(a, b, scale_a, scale_b, fast_accum: bool):
    """torch._scaled_mm's fp32 product of fp8 a and b (2-D only there: a batch one by one).
    It takes N in multiples of 16 only (cuBLASLt's fp8 rule; the kernel takes any N whose
    output rows are 16-byte aligned): b is padded with zero columns, the output cut back.
    Two e5m2 operands it refuses ("Multiplication of two Float8_e5m2 matrices is not
    supported": cuBLASLt has no such kernel; seen on the H200): torch's product of those is
    torch.matmul's in fp32 (every e5m2 value and product is exact there, TF32 or not), an
    fp32 accumulation, so no looser than cuBLAS's fp8 one would be."""
    if a.dtype == b.dtype == torch.float8_e5m2:
        return torch.matmul(a.float(), b.float()) * (scale_a * scale_b)

    def one(x, y):
        k, n = y.shape
        n16 = -(-n // 16) * 16
        if n16 != n:
            pad = torch.zeros((n16, k), dtype=y.dtype, device=y.device).t()  # column-major
            pad[:, :n].copy_(y)
            y = pad
        out = torch._scaled_mm(x, y, scale_a, scale_b, out_dtype=torch.float32, use_fast_accum=fast_accum)
        return out[:, :n]

    if a.dim() == 2:
        return one(a, b)
    return torch.stack([one(x, y) for x, y in zip(a, b)])


CHECKS = {
    "rmsnorm_fwd": check_rmsnorm_fwd,
    "rmsnorm_bwd": check_rmsnorm_bwd,
    "layernorm_fwd": check_layernorm_fwd,
    "layernorm_bwd": check_layernorm_bwd,
    "softmax_fwd": check_softmax_fwd,
    "softmax_bwd": check_softmax_bwd,
    "cross_entropy_fwd": check_cross_entropy_fwd,
    "cross_entropy_bwd": check_cross_entropy_bwd,
    "gemm": check_gemm,
}
