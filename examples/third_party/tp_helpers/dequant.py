"""Device-side helpers of the example: imported by tp_kernels' compile function, and
preloaded (``[build] preload``) so that import is paid once per compile worker. It
imports cutlass and torch at its top, as a vendored CuTe DSL library does (seconds:
what each worker's first key paid before preload)."""

import cutlass
import cutlass.cute as cute
import torch  # noqa: F401  (the library's torch-facing half; the heavy import preload moves)

CUTLASS_DTYPES = {
    "float32": cutlass.Float32,
    "bfloat16": cutlass.BFloat16,
    "float16": cutlass.Float16,
    "float8_e4m3fn": cutlass.Float8E4M3FN,
    "float8_e5m2": cutlass.Float8E5M2,
}


def dequant_vector(src: cute.Tensor, dst: cute.Tensor, scale: cutlass.Float32):
    """dst = src * scale in float32, converted to dst's type: one thread's fragment
    (register tensors of the same shape)."""
    v = src.load().to(cutlass.Float32) * scale
    dst.store(v.to(dst.element_type))
