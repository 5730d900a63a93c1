"""Validation of the GEMM's torch inputs (``gemm.gemm_fwd``) and their views as the
kernel's (M, K, L) / (N, K, L) operands. Imports torch: import it from inside functions.

Every refusal names the argument and what is allowed: the kernel reads A and B through TMA,
whose descriptors need a 16-byte aligned base and 16-byte multiples for every stride but
the unit one; D is written the same way."""

import dataclasses

import torch

from ._gemm_plan import ACTIVATIONS

_AB = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
_FP8 = {torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}
_D = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclasses.dataclass
class GemmArgs:
    m: int
    n: int
    k: int
    batch: int
    dtype: str
    d_dtype: str
    out_dtype: torch.dtype
    a_major: str
    b_major: str
    a3: torch.Tensor | None  # (M, K, L)
    b3: torch.Tensor | None  # (N, K, L)
    c: torch.Tensor | None  # (L, M, N) of out_dtype, unit stride along N
    scaled: bool = False  # fp8 a and b, with per-tensor scales (check_scales)


def _tensor(t, name):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _major(t3, name: str, inner: str, outer: str) -> str:
    """'inner' when the last dim is unit-stride, 'outer' when the one before is (a
    transposed view), else a ValueError."""
    if t3.stride(-1) == 1 or t3.shape[-1] == 1:
        return inner
    if t3.stride(-2) == 1 or t3.shape[-2] == 1:
        return outer
    raise ValueError(
        f"{name} has strides {tuple(t3.stride())}: one of its last two dims must be unit-stride "
        f"(row- or column-major); pass {name}.contiguous()"
    )


def _aligned(t3, name: str, strides, esize: int) -> None:
    if t3.data_ptr() % 16:
        raise ValueError(
            f"{name}: data pointer {t3.data_ptr():#x} is not 16-byte aligned (TMA); pass a clone"
        )
    for dim, s in strides:
        if (s * esize) % 16:
            raise ValueError(
                f"{name}: stride {s} of dim {dim} is {s * esize} bytes, not a multiple of 16 (TMA needs "
                f"16-byte aligned rows: a multiple of {16 // esize} elements); pad it or use torch.matmul"
            )


def operand(t, name: str):
    """A (L, rows, cols) operand with a TMA-friendly batch stride (any value serves L = 1)."""
    if t.shape[0] == 1:
        rows, cols = t.shape[1:]
        s = t.stride()
        return t.as_strided((1, rows, cols), (max(rows * cols, 16), s[1], s[2]))
    return t


def check_dtypes(a, b, out_dtype, scaled: bool = False) -> None:
    """a's, b's and D's dtypes (TypeError naming the one that is not supported); ``scaled``:
    the fp8 op (scaled_gemm), whose a and b are float8_e4m3fn or float8_e5m2. Also the ops'
    fake implementations' check: a torch.compile trace stops at the dtype the kernel would
    refuse, with this message, not at run time. Reads no size, so it adds no shape guard."""
    if scaled and a.dtype not in _FP8:
        raise TypeError(
            f"a has dtype {a.dtype}; scaled_gemm takes fp8 a and b (float8_e4m3fn, float8_e5m2); "
            "16-bit operands: quack_kernels.ops.gemm"
        )
    if not scaled and a.dtype in _FP8:
        raise TypeError(
            f"a has dtype {a.dtype}: fp8 operands need their per-tensor scales, "
            "quack_kernels.ops.scaled_gemm(a, b, scale_a, scale_b)"
        )
    if not scaled and a.dtype not in _AB:
        raise TypeError(
            f"a has dtype {a.dtype}; supported: float16, bfloat16 (cast a and b, or call inside "
            'torch.autocast("cuda"), which casts them)'
        )
    if b.dtype != a.dtype:
        raise TypeError(f"b has dtype {b.dtype} but a has {a.dtype}: a and b must share one dtype")
    if out_dtype is not None and out_dtype not in _D:
        raise TypeError(f"out_dtype {out_dtype}; supported: float16, bfloat16, float32")


def check_scales(a, scale_a, scale_b) -> None:
    """fp8's per-tensor scales (torch._scaled_mm's): float32 tensors of one element on a's
    device, read by the kernel (no host sync)."""
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if not isinstance(s, torch.Tensor):
            raise TypeError(
                f"{name} must be a float32 tensor of one element on the GPU, got {type(s).__name__} "
                f"(a Python number: torch.tensor([{name}], device=a.device))"
            )
        if s.dtype != torch.float32 or s.numel() != 1 or s.device != a.device:
            raise ValueError(
                f"{name} must be a float32 tensor of one element on {a.device} (a per-tensor scale); "
                f"got {s.dtype} of shape {tuple(s.shape)} on {s.device}"
            )


def check(
    a, b, bias, activation, out_dtype, c, beta, scale_a=None, scale_b=None, fast_accum=False
) -> GemmArgs:
    """``scale_a`` / ``scale_b``: fp8 a and b (both given, or neither for 16-bit operands);
    ``fast_accum``: fp8 only (_gemm_plan.promotes)."""
    _tensor(a, "a")
    _tensor(b, "b")
    scaled = scale_a is not None or scale_b is not None
    if a.dim() not in (2, 3) or b.dim() != a.dim():
        raise ValueError(
            f"a and b must both be 2-D (M, K) @ (K, N) or both 3-D (L, M, K) @ (L, K, N); got "
            f"a {tuple(a.shape)}, b {tuple(b.shape)}"
        )
    if b.device != a.device:
        raise ValueError(f"a and b must be on one device; got {a.device} and {b.device}")
    check_dtypes(a, b, out_dtype, scaled)
    if scaled:
        check_scales(a, scale_a, scale_b)
    elif not isinstance(fast_accum, bool) or fast_accum:
        raise ValueError(f"fast_accum={fast_accum!r} applies to fp8 operands (scaled_gemm) only")
    three = a.dim() == 3
    # sizes and strides read from a and b themselves: views ([None], then the kernel's
    # permutation) cost ~1.5 us each of a call's host time
    batch, m, k = a.shape if three else (1, *a.shape)
    b_batch, b_k, n = b.shape if three else (1, *b.shape)
    if b_batch != batch or b_k != k:
        raise ValueError(
            f"b has shape {tuple(b.shape)}, expected {'(' + str(batch) + ', ' if three else '('}{k}, N) for a {tuple(a.shape)}"
        )
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS[1:]} or None, got {activation!r}")
    # fp8 D is not written (an fp8 output needs its own scale): bfloat16, torch's usual pick
    out_dtype = (torch.bfloat16 if scaled else a.dtype) if out_dtype is None else out_dtype
    if not isinstance(beta, (int, float)) or isinstance(beta, bool):
        raise TypeError(f"beta must be a float, got {type(beta).__name__}")
    if bias is not None:
        _tensor(bias, "bias")
        if bias.device != a.device or bias.shape != (n,) or not bias.is_floating_point():
            raise ValueError(
                f"bias must be a float ({n},) tensor on {a.device}; got {tuple(bias.shape)} {bias.dtype} on {bias.device}"
            )
    cc = None
    if c is not None:
        _tensor(c, "c")
        want = (batch, m, n) if a.dim() == 3 else (m, n)
        if c.device != a.device or tuple(c.shape) != want or not c.is_floating_point():
            raise ValueError(
                f"c must be a float {want} tensor on {a.device}; got {tuple(c.shape)} {c.dtype} on {c.device}"
            )
        cc = (c if three else c[None]).to(out_dtype)
        if cc.stride(-1) != 1:
            cc = cc.contiguous()
    name = (_FP8 if scaled else _AB)[a.dtype]
    args = GemmArgs(m, n, k, batch, name, _D[out_dtype], out_dtype, "k", "k", None, None, cc, scaled)
    if not (m and n and k):
        return args
    args.a_major = _major(a, "a", "k", "m")
    # the kernel's B is (N, K): b (K, N) row-major is N-major, a transposed (N, K) weight K-major
    args.b_major = _major(b, "b", "n", "k")
    if scaled and (args.a_major, args.b_major) != ("k", "k"):
        # fp8 WGMMA reads both operands K-major from shared memory (no transpose for 8 bits)
        raise ValueError(
            f"fp8 a must be row-major (M, K) and b column-major (K, N) (b = w.t() of a row-major "
            f"(N, K) weight w), as torch._scaled_mm takes them; got a strides {tuple(a.stride())}, "
            f"b strides {tuple(b.stride())}: pass a.contiguous() / b.t().contiguous().t()"
        )
    es = a.element_size()
    sa = a.stride() if three else (0, *a.stride())
    sb = b.stride() if three else (0, *b.stride())
    _aligned(
        a,
        "a",
        [(a.dim() - 2 if args.a_major == "k" else a.dim() - 1, sa[1] if args.a_major == "k" else sa[2])]
        + ([(0, sa[0])] if batch > 1 else []),
        es,
    )
    _aligned(
        b,
        "b",
        [(b.dim() - 2 if args.b_major == "n" else b.dim() - 1, sb[1] if args.b_major == "n" else sb[2])]
        + ([(0, sb[0])] if batch > 1 else []),
        es,
    )
    osz = out_dtype.itemsize
    if (n * osz) % 16:
        raise ValueError(
            f"b: N = {n} columns of a {out_dtype} output are {n * osz} bytes a row, not a multiple of 16 "
            f"(TMA stores D in 16-byte aligned rows); pad N to a multiple of {16 // osz}"
        )
    if batch == 1:  # one view each, with operand()'s batch stride: (M, K, 1) and (N, K, 1)
        args.a3 = a.as_strided((m, k, 1), (sa[1], sa[2], max(m * k, 16)))
        args.b3 = b.as_strided((n, k, 1), (sb[2], sb[1], max(n * k, 16)))
    else:
        args.a3 = a.permute(1, 2, 0)  # (M, K, L)
        args.b3 = b.permute(2, 1, 0)  # (N, K, L)
    return args
