"""Host side of a row kernel's compile (CuTe DSL): dtype names -> cutlass types, fake
tensors with a symbolic M (one .o for every batch size) and the launch kwargs of a
``quack_kernels._plan.RowPlan`` (grid, block, cluster, occupancy hints). Imported lazily,
only from inside compile functions: importing this module imports cutlass; the kernels
reach it through ``quack_kernels._rowreduce`` (``rr.fake_rows``, ``rr.launch_kwargs``...).
"""

import cutlass
import cutlass.cute as cute

from ._plan import RowPlan

CUTLASS_DTYPES = {
    "float32": cutlass.Float32,
    "float16": cutlass.Float16,
    "bfloat16": cutlass.BFloat16,
    "float8_e4m3fn": cutlass.Float8E4M3FN,
    "float8_e5m2": cutlass.Float8E5M2,
}


def cutlass_dtype(name: str):
    return CUTLASS_DTYPES[name]


def fake_rows(dtype, n: int, vec: int, m=None):
    """A fake (M, n) row-major tensor with symbolic M: one .o for every batch size."""
    from cutlass.cute.runtime import make_fake_tensor

    if m is None:
        m = cute.sym_int()
    return make_fake_tensor(dtype, (m, n), stride=(n, 1), assumed_align=16), m


def fake_vec(dtype, length, align: int = 16):
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(dtype, (length,), stride=(1,), assumed_align=align)


def launch_kwargs(plan: RowPlan, m, stream, min_blocks: int = 0):
    """``min_blocks`` > 0 asks ptxas for that many resident CTAs per SM (caps the
    registers per thread; shared memory carve-out set to the maximum)."""
    kw = dict(
        grid=[cute.ceil_div(m, plan.rows_per_cta), plan.cluster_n, 1],
        block=[plan.num_threads, 1, 1],
        cluster=[1, plan.cluster_n, 1] if plan.cluster_n > 1 else None,
        stream=stream,
    )
    if min_blocks > 0:
        kw.update(min_blocks_per_mp=min_blocks, preferred_smem_carveout=100)
    return kw
