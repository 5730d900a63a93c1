"""Input validation and small torch helpers for the torch-facing kernel functions.
Import this only from inside functions (it imports torch)."""

import torch

from ._plan import N_MAX, N_MIN

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
DTYPE_BITS = {"float32": 32, "float16": 16, "bfloat16": 16}


def check_tensor(t, name):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def dtype_name(t, name) -> str:
    try:
        return DTYPE_NAMES[t.dtype]
    except KeyError:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: float32, float16, bfloat16") from None


def _aligned(t) -> bool:
    return t.data_ptr() % 16 == 0


def rows(x, name="x"):
    """Validate a (..., N) CUDA tensor and view it as a contiguous, 16-byte aligned (M, N)."""
    check_tensor(x, name)
    if not x.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got device {x.device}")
    dtype_name(x, name)
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least 1 dimension (..., N), got a scalar")
    n = x.shape[-1]
    if not (N_MIN <= n <= N_MAX):
        raise ValueError(f"{name}: row length N = {n} (last dim) is out of range [{N_MIN}, {N_MAX}]")
    if x.numel() > 0 and x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride {x.stride(-1)}, expected 1)")
    x2 = x.reshape(-1, n)
    if not x2.is_contiguous() or not _aligned(x2):
        x2 = x2.contiguous()
        if not _aligned(x2):
            x2 = x2.clone()
    return x2


def like_rows(t, name, ref, ref_name="x", dtype=None):
    """Validate a tensor that must match ``ref``'s shape (and dtype) and device."""
    check_tensor(t, name)
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")
    want = ref.dtype if dtype is None else dtype
    if t.dtype != want:
        raise TypeError(f"{name} has dtype {t.dtype}, expected {want} (same as {ref_name})")
    if tuple(t.shape) != tuple(ref.shape):
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}, expected {tuple(ref.shape)} (same as {ref_name})"
        )
    return rows(t, name)


def vector(t, name, n, ref, ref_name="x", dtype=None):
    """Validate a per-column (N,) vector (weight / bias)."""
    if t is None:
        return None
    check_tensor(t, name)
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")
    want = ref.dtype if dtype is None else dtype
    if t.dtype != want:
        raise TypeError(f"{name} has dtype {t.dtype}, expected {want} (same as {ref_name})")
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{name} must have shape ({n},), got {tuple(t.shape)}")
    if t.stride(0) != 1 or not _aligned(t):
        t = t.contiguous().clone()
    return t


def per_row(t, name, m, ref, dtype=torch.float32):
    """Validate a per-row (M,) fp32 vector (rstd / mean / lse)."""
    check_tensor(t, name)
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but x is on {ref.device}")
    if t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype}, expected {dtype}")
    if t.numel() != m:
        raise ValueError(f"{name} must have {m} elements (one per row), got {t.numel()}")
    return t.reshape(m).contiguous()


def sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def device_index(device) -> int:
    """The CUDA ordinal of ``device`` (a torch.device or index; the current device when it
    names none)."""
    d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return d.index if d.index is not None else torch.cuda.current_device()


def affine(weight, bias, n, x):
    """Validate a norm's weight and bias: (N,) vectors on x's device, of one float dtype
    (any of float32 / float16 / bfloat16, independent of x's: the mixed-precision case).
    Returns (weight, bias, weight_dtype) with weight_dtype "same" when it equals x's
    dtype (one configuration, one compile key)."""
    ref = weight if weight is not None else bias
    if ref is None:
        return None, None, "same"
    check_tensor(ref, "weight" if weight is not None else "bias")
    wname = dtype_name(ref, "weight" if weight is not None else "bias")
    if weight is not None and bias is not None:
        check_tensor(bias, "bias")
        if bias.dtype != weight.dtype:
            raise TypeError(
                f"bias has dtype {bias.dtype} but weight has {weight.dtype}: "
                "weight and bias must share one dtype"
            )
    w = vector(weight, "weight", n, x, dtype=ref.dtype)
    b = vector(bias, "bias", n, x, dtype=ref.dtype)
    return w, b, ("same" if wname == dtype_name(x, "x") else wname)
