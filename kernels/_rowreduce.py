"""Device helpers shared by the row-wise kernels (CuTe DSL): the one handle every kernel
imports (``from . import _rowreduce as rr``). Imported lazily, only from inside compile
functions: importing this module imports cutlass.

This module holds the row kernels' common prologues (``cta_coords``, ``start_rows``,
``start_ring``: coordinates, the reducer's shared memory, the CTA's row tiles) and
re-exports the building blocks, each in its own module:
- ``_rowtiles``: ``RowTiles``, a CTA's view of its rows — per-thread fragments of the
  row (128-bit vector accesses through a tiled copy), a column predicate, the thread's
  row index, and the launch shape from ``quack_kernels._plan.RowPlan`` — and its copies;
- ``_allreduce``: ``row_allreduce`` / ``row_allreduce_pair`` / ``Reducer``: warp
  shuffle -> shared memory across the warps of a row -> distributed shared memory
  across the CTAs of a cluster (st.async with an mbarrier transaction count), every
  thread of the row gets the result;
- ``_launch``: dtype names, fake tensors (symbolic M), launch kwargs.
"""

import cutlass
import cutlass.cute as cute
from cutlass import const_expr

from . import _allreduce, _launch, _rowtiles
from ._plan import RowPlan

# Re-exported by assignment from module handles, never ``from ._x import name``: the source
# fingerprint (quack.cache.keys.source_files) resolves such a name with
# find_spec("quack_kernels._x.name"), which imports ``_x`` -- and cutlass -- in a process
# that only loads prebuilt objects (tests/test_bundles_e2e.py: cutlass stays unimported).
LOG2_E = _allreduce.LOG2_E
Reducer = _allreduce.Reducer
reduce_pair_stage = _allreduce.reduce_pair_stage
reduce_stage = _allreduce.reduce_stage
row_allreduce = _allreduce.row_allreduce
row_allreduce_pair = _allreduce.row_allreduce_pair
store_remote_f32 = _allreduce.store_remote_f32
send_sum = _allreduce.send_sum
finish_sum = _allreduce.finish_sum
send_welford = _allreduce.send_welford
finish_welford = _allreduce.finish_welford
CUTLASS_DTYPES = _launch.CUTLASS_DTYPES
cutlass_dtype = _launch.cutlass_dtype
fake_rows = _launch.fake_rows
fake_vec = _launch.fake_vec
launch_kwargs = _launch.launch_kwargs
RowTiles = _rowtiles.RowTiles
broadcast_rows = _rowtiles.broadcast_rows
column_predicate = _rowtiles.column_predicate
cp_async_atom = _rowtiles.cp_async_atom
cp_async_tiled_copy = _rowtiles.cp_async_tiled_copy
copy_row_tile = _rowtiles.copy_row_tile
make_tiled_copy = _rowtiles.make_tiled_copy
smem_rows_ok = _rowtiles.smem_rows_ok
tiler = _rowtiles.tiler

__all__ = [
    "CUTLASS_DTYPES",
    "LOG2_E",
    "Reducer",
    "RowTiles",
    "broadcast_rows",
    "column_predicate",
    "cp_async_atom",
    "cp_async_tiled_copy",
    "copy_row_tile",
    "cta_coords",
    "cutlass_dtype",
    "fake_rows",
    "finish_sum",
    "finish_welford",
    "fake_vec",
    "launch_kwargs",
    "make_tiled_copy",
    "reduce_pair_stage",
    "reduce_stage",
    "row_allreduce",
    "row_allreduce_pair",
    "send_sum",
    "send_welford",
    "smem_rows_ok",
    "start_ring",
    "start_rows",
    "store_remote_f32",
    "tiler",
]


def cta_coords(plan: RowPlan):
    """(tidx, bidx, cluster_y): this thread, its CTA's row tile, and the CTA's slice of
    the row within the cluster (0 without a cluster). Called from kernel bodies."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, cy, _ = cute.arch.block_idx()
    return tidx, bidx, (cy if const_expr(plan.cluster_n > 1) else 0)


def start_ring(plan: RowPlan, dtype, mX: cute.Tensor, stages: int, count: int, red_stages: int = 4):
    """The persistent cp.async-ring kernels' common prologue (the norm forward's ring,
    the norm backward's shared-memory path): coordinates, the reducer (4 stages) with its
    cluster barriers signalled, ``count`` ring buffers of ``stages`` row tiles each, and the
    CTA's first row tiles. Returns (tidx, bidx, cluster_y, m, smem, red, bufs, tiles)."""
    tidx, bidx, cluster_y = cta_coords(plan)
    m = cute.size(mX, mode=[0])
    smem = cutlass.memory.SmemAllocator()
    red = Reducer(plan, stages=red_stages)
    red.allocate(smem)
    sl = cute.make_layout((1, plan.tile_n, stages), stride=(plan.tile_n, 1, plan.tile_n))
    bufs = [smem.allocate_tensor(dtype, sl, byte_alignment=128) for _ in range(count)]
    red.init_cluster(tidx)
    return tidx, bidx, cluster_y, m, smem, red, bufs, RowTiles(plan, dtype, m, tidx, 0, cluster_y)


def start_rows(plan: RowPlan, dtype, mX: cute.Tensor, stages: int):
    """The row kernels' common prologue: coordinates, the reducer's shared memory with
    its cluster barriers signalled (pair with ``red.wait_cluster()``), and the CTA's
    row tiles over ``mX``. Returns (tidx, bidx, cluster_y, m, smem, red, tiles)."""
    tidx, bidx, cluster_y = cta_coords(plan)
    m = cute.size(mX, mode=[0])
    smem = cutlass.memory.SmemAllocator()
    red = Reducer(plan, stages=stages)
    red.allocate(smem)
    red.init_cluster(tidx)
    return tidx, bidx, cluster_y, m, smem, red, RowTiles(plan, dtype, m, tidx, bidx, cluster_y)
