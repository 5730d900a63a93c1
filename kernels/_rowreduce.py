"""Device helpers shared by the row-wise kernels (CuTe DSL). Imported lazily,
only from inside compile functions: importing this module imports cutlass.

The building blocks:
- ``RowTiles``: a CTA's view of its rows — per-thread fragments of the row
  (128-bit vector accesses through a tiled copy), a column predicate, the
  thread's row index, and the launch shape from ``kernels._plan.RowPlan``.
- ``row_allreduce``: warp shuffle -> shared memory across the warps of a row ->
  distributed shared memory across the CTAs of a cluster (st.async with an
  mbarrier transaction count), every thread of the row gets the result.
"""

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Boolean, const_expr

from kernels._plan import RowPlan

CUTLASS_DTYPES = {
    "float32": cutlass.Float32,
    "float16": cutlass.Float16,
    "bfloat16": cutlass.BFloat16,
}


def cutlass_dtype(name: str):
    return CUTLASS_DTYPES[name]


def make_tiled_copy(dtype, plan: RowPlan):
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype,
                               num_bits_per_copy=plan.vec * dtype.width)
    thr_layout = cute.make_ordered_layout((plan.rows_per_cta, plan.threads_per_row), order=(1, 0))
    val_layout = cute.make_layout((1, plan.vec))
    return cute.make_tiled_copy_tv(atom, thr_layout, val_layout)


def tiler(plan: RowPlan):
    return (plan.rows_per_cta, plan.tile_n)


def fake_rows(dtype, n: int, vec: int, m=None):
    """A fake (M, n) row-major tensor with symbolic M: one .o for every batch size."""
    from cutlass.cute.runtime import make_fake_tensor

    if m is None:
        m = cute.sym_int()
    return make_fake_tensor(dtype, (m, n), stride=(n, 1), assumed_align=16), m


def fake_vec(dtype, length, align: int = 16):
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(dtype, (length,), stride=(1,), assumed_align=align)


def launch_kwargs(plan: RowPlan, m, stream):
    return dict(
        grid=[cute.ceil_div(m, plan.rows_per_cta), plan.cluster_n, 1],
        block=[plan.num_threads, 1, 1],
        cluster=[1, plan.cluster_n, 1] if plan.cluster_n > 1 else None,
        stream=stream,
    )


def broadcast_rows(vec_tensor: cute.Tensor, rows: int) -> cute.Tensor:
    """View a (N,) tensor as (rows, N) with row stride 0, to share a row tiling."""
    n = vec_tensor.shape[0]
    return cute.make_tensor(vec_tensor.iterator, cute.make_layout((rows, n), stride=(0, 1)))


@cute.jit
def column_predicate(tXcX: cute.Tensor, n: cutlass.Constexpr[int]) -> cute.Tensor:
    """Per-vector predicate (1, 1, nvec): the vector's first column is < n (vec divides n)."""
    pred = cute.make_rmem_tensor(
        cute.make_layout((1, cute.size(tXcX, mode=[1]), cute.size(tXcX, mode=[2])),
                         stride=(cute.size(tXcX, mode=[2]), 0, 1)),
        Boolean,
    )
    for k in cutlass.range_constexpr(cute.size(tXcX, mode=[2])):
        pred[0, 0, k] = cute.elem_less(tXcX[(0, 0), 0, k][1], n)
    return pred


@cute.jit
def store_remote_f32(val: Float32, smem_ptr: cute.Pointer, mbar_ptr: cute.Pointer, peer: Int32):
    """st.async of one fp32 into the peer CTA's shared memory; completes ``bytes``
    on the peer's mbarrier."""
    rptr = cute.arch.map_dsmem_ptr(smem_ptr, peer).toint()
    rmbar = cute.arch.map_dsmem_ptr(mbar_ptr, peer).toint()
    cute.arch.inline_ptx(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [{$r0}], {$r1}, [{$r2}];",
        read_only_args=[Int32(rptr), Float32(val), Int32(rmbar)],
    )


def _op(kind: str):
    if kind == "sum":
        return operator.add
    return cute.arch.fmax


@cute.jit
def row_allreduce(
    val: Float32,
    kind: cutlass.Constexpr[str],
    threads_per_row: cutlass.Constexpr[int],
    cluster_n: cutlass.Constexpr[int],
    buf: cute.Tensor,       # smem (rows_per_cta, warps_per_row * cluster_n) fp32, one per stage
    mbar: cute.Pointer,     # smem mbarrier of this stage (cluster only), or None
    phase=0,
):
    """All-reduce ``val`` over the threads (and CTAs) sharing a row."""
    op = _op(kind)
    init = Float32(0.0) if const_expr(kind == "sum") else -Float32.inf
    val = cute.arch.warp_reduction(val, op, threads_in_group=min(threads_per_row, 32))
    warps_per_row = const_expr(max(threads_per_row // 32, 1))
    if const_expr(warps_per_row > 1 or cluster_n > 1):
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        row = warp // warps_per_row
        col = warp % warps_per_row
        if const_expr(cluster_n == 1):
            if lane == 0:
                buf[row, col] = val
            cute.arch.barrier()
            v = init
            if lane < warps_per_row:
                v = buf[row, lane]
            val = cute.arch.warp_reduction(v, op)
        else:
            rank = cute.arch.block_idx_in_cluster()
            rows_per_cta = const_expr(cute.size(buf, mode=[0]))
            if warp == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(
                        mbar, rows_per_cta * warps_per_row * cluster_n * 4)
            if lane < cluster_n:
                slot = buf.iterator + cute.crd2idx((row, rank * warps_per_row + col), buf.layout)
                store_remote_f32(val, slot, mbar, lane)
            cute.arch.mbarrier_wait(mbar, phase=phase)
            total = const_expr(warps_per_row * cluster_n)
            v = init
            for i in cutlass.range_constexpr((total + 31) // 32):
                idx = lane + i * 32
                if idx < total:
                    v = op(v, buf[row, idx])
            val = cute.arch.warp_reduction(v, op)
    return val


class Reducer:
    """Shared memory for a kernel's row reductions: ``stages`` independent
    all-reduces (each used once per CTA), plus the cluster mbarriers."""

    def __init__(self, plan: RowPlan, stages: int):
        self.plan = plan
        self.stages = stages

    @property
    def needed(self) -> bool:
        return self.plan.warps_per_row > 1 or self.plan.cluster_n > 1

    def allocate(self, smem):
        p = self.plan
        self.buf = None
        self.mbar = None
        if self.needed:
            self.buf = smem.allocate_tensor(
                Float32,
                cute.make_ordered_layout(
                    (p.rows_per_cta, p.warps_per_row * p.cluster_n, self.stages), order=(1, 0, 2)),
                byte_alignment=16,
            )
        if p.cluster_n > 1:
            self.mbar = smem.allocate_array(Int64, num_elems=self.stages)

    @cute.jit
    def init_cluster(self, tidx):
        """Initialize the mbarriers and signal the cluster; pair with ``wait_cluster``
        before the first reduction (overlap the row loads in between)."""
        if const_expr(self.plan.cluster_n > 1):
            if tidx < self.stages:
                cute.arch.mbarrier_init(self.mbar + tidx, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.cluster_arrive_relaxed()

    def wait_cluster(self):
        if const_expr(self.plan.cluster_n > 1):
            cute.arch.cluster_wait()

    def reduce(self, val, kind: str, stage, phase=0):
        """All-reduce over the row. ``stage`` picks the buffer (and mbarrier); a
        loop reusing stages alternates two of them and passes the mbarrier
        ``phase`` (flips each time the stage is reused)."""
        return reduce_stage(val, kind, self.plan, self.buf, self.mbar, stage, phase)


def reduce_stage(val, kind: str, plan: RowPlan, buf, mbar, stage, phase=0):
    """``Reducer.reduce`` as a free function, for dynamic loops (which cannot carry
    Python objects): pass ``red.buf`` and ``red.mbar`` taken before the loop."""
    b = buf[None, None, stage] if const_expr(buf is not None) else None
    mb = (mbar + stage) if const_expr(mbar is not None) else None
    return row_allreduce(Float32(val), kind, plan.threads_per_row, plan.cluster_n, b, mb, phase)


class RowTiles:
    """Thread-level partitions of (M, N) row tensors for one CTA."""

    def __init__(self, plan: RowPlan, dtype, m, tidx, bidx, cluster_y):
        self.plan = plan
        self.tiled_copy = make_tiled_copy(dtype, plan)
        self.thr = self.tiled_copy.get_slice(tidx)
        self.coord = (bidx, cluster_y)
        self.m = m
        ident = cute.make_identity_tensor((m, plan.n))
        cX = cute.local_tile(ident, tiler(plan), self.coord)
        self.tXcX = self.thr.partition_S(cX)
        self.row = self.tXcX[(0, 0), 0, 0][0]
        self.pred = None if const_expr(plan.even) else column_predicate(self.tXcX, plan.n)

    def part(self, mT: cute.Tensor):
        """This thread's fragment view (vec, 1, nvec) of a (M, N) tensor."""
        return self.thr.partition_S(cute.local_tile(mT, tiler(self.plan), self.coord))

    def part_bcast(self, mV: cute.Tensor):
        """Fragment view of a (N,) tensor broadcast over the CTA's rows."""
        full = broadcast_rows(mV, self.plan.rows_per_cta)
        return self.thr.partition_S(cute.local_tile(full, tiler(self.plan), (0, self.coord[1])))

    @cute.jit
    def load(self, gT: cute.Tensor, fill: cutlass.Constexpr = 0.0):
        """Load a fragment into registers; columns past N and rows past M read as ``fill``."""
        r = cute.make_rmem_tensor_like(gT)
        if const_expr(not self.plan.even):
            r.fill(fill)
        if self.row < self.m:
            cute.copy(self.tiled_copy, gT, r, pred=self.pred)
        else:
            r.fill(fill)
        return r

    @cute.jit
    def load_bcast(self, gT: cute.Tensor):
        """Load a (N,)-broadcast fragment (no row predicate)."""
        r = cute.make_rmem_tensor_like(gT)
        if const_expr(not self.plan.even):
            r.fill(0.0)
        cute.copy(self.tiled_copy, gT, r, pred=self.pred)
        return r

    @cute.jit
    def store(self, val_ssa, gT: cute.Tensor):
        r = cute.make_rmem_tensor_like(gT)
        r.store(val_ssa.to(gT.element_type))
        if self.row < self.m:
            cute.copy(self.tiled_copy, r, gT, pred=self.pred)

    @cute.jit
    def read_row_scalar(self, mV: cute.Tensor):
        """mV[row] as fp32 (0 for rows past M)."""
        v = Float32(0.0)
        if self.row < self.m:
            v = Float32(mV[self.row])
        return v

    @cute.jit
    def write_row_scalar(self, mV: cute.Tensor, val):
        """mV[row] = val, once per row (first thread of the row, CTA rank 0 of a cluster)."""
        if self.row < self.m:
            tidx, _, _ = cute.arch.thread_idx()
            if tidx % self.plan.threads_per_row == 0:
                if const_expr(self.plan.cluster_n > 1):
                    if self.coord[1] == 0:
                        mV[self.row] = val.to(mV.element_type)
                else:
                    mV[self.row] = val.to(mV.element_type)

    @cute.jit
    def mask_cols(self, val_ssa, fill: cutlass.Constexpr = 0.0):
        """``val_ssa`` (fp32, fragment-shaped) with columns >= N set to ``fill``."""
        r = cute.make_rmem_tensor(val_ssa.shape, Float32)
        r.store(val_ssa)
        for k in cutlass.range_constexpr(cute.size(self.tXcX, mode=[2])):
            if not self.pred[0, 0, k]:
                for v in cutlass.range_constexpr(self.plan.vec):
                    r[(v, 0), 0, k] = Float32(fill)
        return r.load()

    @cute.jit
    def store_fp32_rows(self, frag: cute.Tensor, mOut: cute.Tensor):
        """Scalar stores of an fp32 fragment into (rows, N) fp32 ``mOut`` at this
        thread's coordinates (used once per CTA, for partial sums)."""
        if self.row < self.m:
            for k in cutlass.range_constexpr(cute.size(frag, mode=[2])):
                col0 = self.tXcX[(0, 0), 0, k][1]
                if col0 < self.plan.n:
                    for v in cutlass.range_constexpr(self.plan.vec):
                        mOut[self.row, col0 + v] = frag[(v, 0), 0, k]
