"""Device helpers shared by the row-wise kernels (CuTe DSL). Imported lazily,
only from inside compile functions: importing this module imports cutlass.

The building blocks:
- ``RowTiles``: a CTA's view of its rows — per-thread fragments of the row
  (128-bit vector accesses through a tiled copy), a column predicate, the
  thread's row index, and the launch shape from ``quack_kernels._plan.RowPlan``.
- ``row_allreduce``: warp shuffle -> shared memory across the warps of a row ->
  distributed shared memory across the CTAs of a cluster (st.async with an
  mbarrier transaction count), every thread of the row gets the result.
"""

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, const_expr

from ._plan import RowPlan

CUTLASS_DTYPES = {
    "float32": cutlass.Float32,
    "float16": cutlass.Float16,
    "bfloat16": cutlass.BFloat16,
}


def cutlass_dtype(name: str):
    return CUTLASS_DTYPES[name]


def make_tiled_copy(dtype, plan: RowPlan):
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=plan.vec * dtype.width)
    thr_layout = cute.make_ordered_layout((plan.rows_per_cta, plan.threads_per_row), order=(1, 0))
    val_layout = cute.make_layout((1, plan.vec))
    return cute.make_tiled_copy_tv(atom, thr_layout, val_layout)


def cp_async_atom(dtype, num_bits: int, bypass_l1: bool = True):
    """A cp.async (global -> shared) copy atom of ``num_bits`` (32, 64 or 128) per thread.
    Streams bypass L1 (``.cg``) on 16-byte copies; PTX allows ``cp.async.cg`` with a
    16-byte size only, so 4- and 8-byte copies (rows whose N is not a multiple of the
    16-byte vector) use ``.ca`` (an MLIR verification error otherwise). Broadcast
    vectors (weight / bias, re-read by every CTA) pass ``bypass_l1=False``: co-resident
    CTAs share them through L1 (measured on the H200: .cg there cost RMSNorm / LayerNorm
    fwd 6-22 % at N = 65536 / 262144)."""
    mode = (
        cute.nvgpu.cpasync.LoadCacheMode.GLOBAL
        if num_bits == 128 and bypass_l1
        else cute.nvgpu.cpasync.LoadCacheMode.ALWAYS
    )
    return cute.make_copy_atom(
        cute.nvgpu.cpasync.CopyG2SOp(cache_mode=mode), dtype, num_bits_per_copy=num_bits
    )


def smem_rows_ok(
    plan: RowPlan, width: int, count: int, max_bytes: int = 64 * 1024, min_cluster: int = 8
) -> bool:
    """Stage ``count`` row tensors of ``width`` bits in shared memory (``RowTiles.stage_rows``)?
    Only for rows over ``min_cluster`` CTAs or more (one row per CTA) with an even tiling
    (cp.async leaves no column predicate to fill) and 16-byte vectors, within
    ``max_bytes`` a CTA (64 KiB: 3 CTAs / SM). Measured on the H200 (softmax bwd, bf16,
    TB/s, registers vs shared memory): 4096x262144 (16 CTAs) 2.49 / 3.76, 32768x65536 (8)
    3.97 / 4.01, 32768x16384 (2) 4.30 / 3.70."""
    return (
        plan.cluster_n >= max(2, min_cluster)
        and plan.rows_per_cta == 1
        and plan.even
        and plan.vec * width == 128
        and count * plan.tile_n * width // 8 <= max_bytes
    )


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


def broadcast_rows(vec_tensor: cute.Tensor, rows: int) -> cute.Tensor:
    """View a (N,) tensor as (rows, N) with row stride 0, to share a row tiling."""
    n = vec_tensor.shape[0]
    return cute.make_tensor(vec_tensor.iterator, cute.make_layout((rows, n), stride=(0, 1)))


@cute.jit
def column_predicate(tXcX: cute.Tensor, n: cutlass.Constexpr[int]) -> cute.Tensor:
    """Per-vector predicate (1, 1, nvec): the vector's first column is < n (vec divides n)."""
    pred = cute.make_rmem_tensor(
        cute.make_layout(
            (1, cute.size(tXcX, mode=[1]), cute.size(tXcX, mode=[2])),
            stride=(cute.size(tXcX, mode=[2]), 0, 1),
        ),
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
    buf: cute.Tensor,  # smem (rows_per_cta, warps_per_row * cluster_n) fp32, one per stage
    mbar: cute.Pointer,  # smem mbarrier of this stage (cluster only), or None
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
                        mbar, rows_per_cta * warps_per_row * cluster_n * 4
                    )
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


LOG2_E = 1.4426950408889634


@cute.jit
def _lse_combine(m1: Float32, s1: Float32, m2: Float32, s2: Float32):
    """(max, sum of exp(x - max)) pairs -> their union (online softmax). A side
    whose max is -inf (nothing seen) contributes 0, never NaN."""
    m = cute.arch.fmax(m1, m2)
    ms = m
    if m == -Float32.inf:
        ms = Float32(0.0)
    e1 = cute.math.exp2((m1 - ms) * LOG2_E, fastmath=True)
    e2 = cute.math.exp2((m2 - ms) * LOG2_E, fastmath=True)
    return m, s1 * e1 + s2 * e2


@cute.jit
def row_allreduce_pair(
    a: Float32,
    b: Float32,
    kind: cutlass.Constexpr[str],
    threads_per_row: cutlass.Constexpr[int],
    cluster_n: cutlass.Constexpr[int],
    count: cutlass.Constexpr[int],
    buf_a: cute.Tensor,
    buf_b: cute.Tensor,
    mbar: cute.Pointer,
    phase=0,
):
    """All-reduce a pair over the threads (and CTAs) sharing a row in ONE round trip.

    kind "lse":     (max, sum of exp(x - max))  -> row max, row sum of exp(x - row max)
    kind "sum2":    (a, b)                      -> (row sum of a, row sum of b)
    kind "welford": (mean, M2 = sum (x - mean)^2) of ``count`` elements per thread (the
                    same count for every thread) -> row mean, row M2 (Chan's formula)
    """
    g = const_expr(min(threads_per_row, 32))
    if const_expr(kind == "lse"):
        for i in cutlass.range_constexpr(g.bit_length() - 1):
            off = const_expr(g >> (i + 1))
            a, b = _lse_combine(
                a,
                b,
                cute.arch.shuffle_sync_bfly(a, offset=off, mask=-1, mask_and_clamp=31),
                cute.arch.shuffle_sync_bfly(b, offset=off, mask=-1, mask_and_clamp=31),
            )
    elif const_expr(kind == "sum2"):
        a = cute.arch.warp_reduction(a, operator.add, threads_in_group=g)
        b = cute.arch.warp_reduction(b, operator.add, threads_in_group=g)
    else:
        ma = cute.arch.warp_reduction(a, operator.add, threads_in_group=g) * (1.0 / g)
        d = a - ma
        b = cute.arch.warp_reduction(b + d * d * float(count), operator.add, threads_in_group=g)
        a = ma
    warps_per_row = const_expr(max(threads_per_row // 32, 1))
    if const_expr(warps_per_row > 1 or cluster_n > 1):
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        row = warp // warps_per_row
        col = warp % warps_per_row
        if const_expr(cluster_n == 1):
            if lane == 0:
                buf_a[row, col] = a
                buf_b[row, col] = b
            cute.arch.barrier()
        else:
            rank = cute.arch.block_idx_in_cluster()
            rows_per_cta = const_expr(cute.size(buf_a, mode=[0]))
            if warp == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(
                        mbar, rows_per_cta * warps_per_row * cluster_n * 8
                    )
            if lane < cluster_n:
                ci = (row, rank * warps_per_row + col)
                store_remote_f32(a, buf_a.iterator + cute.crd2idx(ci, buf_a.layout), mbar, lane)
                store_remote_f32(b, buf_b.iterator + cute.crd2idx(ci, buf_b.layout), mbar, lane)
            cute.arch.mbarrier_wait(mbar, phase=phase)
        total = const_expr(warps_per_row * cluster_n)
        if const_expr(kind == "lse"):
            va = -Float32.inf
            vb = Float32(0.0)
            for i in cutlass.range_constexpr((total + 31) // 32):
                idx = lane + i * 32
                if idx < total:
                    va, vb = _lse_combine(va, vb, buf_a[row, idx], buf_b[row, idx])
            for i in cutlass.range_constexpr(5):
                off2 = const_expr(16 >> i)
                va, vb = _lse_combine(
                    va,
                    vb,
                    cute.arch.shuffle_sync_bfly(va, offset=off2, mask=-1, mask_and_clamp=31),
                    cute.arch.shuffle_sync_bfly(vb, offset=off2, mask=-1, mask_and_clamp=31),
                )
            a, b = va, vb
        elif const_expr(kind == "sum2"):
            sa = Float32(0.0)
            sb = Float32(0.0)
            for i in cutlass.range_constexpr((total + 31) // 32):
                idx = lane + i * 32
                if idx < total:
                    sa = sa + buf_a[row, idx]
                    sb = sb + buf_b[row, idx]
            a = cute.arch.warp_reduction(sa, operator.add)
            b = cute.arch.warp_reduction(sb, operator.add)
        else:
            sa = Float32(0.0)
            for i in cutlass.range_constexpr((total + 31) // 32):
                idx = lane + i * 32
                if idx < total:
                    sa = sa + buf_a[row, idx]
            mean = cute.arch.warp_reduction(sa, operator.add) * (1.0 / total)
            sb = Float32(0.0)
            for i in cutlass.range_constexpr((total + 31) // 32):
                idx = lane + i * 32
                if idx < total:
                    dd = buf_a[row, idx] - mean
                    sb = sb + buf_b[row, idx] + dd * dd * float(count * g)
            a = mean
            b = cute.arch.warp_reduction(sb, operator.add)
    return a, b


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
                    (p.rows_per_cta, p.warps_per_row * p.cluster_n, self.stages), order=(1, 0, 2)
                ),
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

    def reduce_pair(self, a, b, kind: str, count: int = 1, phase=0):
        """Pair all-reduce in one round trip ("lse" or "welford"); needs stages >= 2."""
        return reduce_pair_stage(a, b, kind, self.plan, self.buf, self.mbar, count, phase)


def reduce_pair_stage(a, b, kind: str, plan: RowPlan, buf, mbar, count: int, phase=0):
    """One-round-trip pair all-reduce (see ``row_allreduce_pair``); uses the two
    first stages of the buffer (a, b) and the first mbarrier."""
    ba = buf[None, None, 0] if const_expr(buf is not None) else None
    bb = buf[None, None, 1] if const_expr(buf is not None) else None
    return row_allreduce_pair(
        Float32(a), Float32(b), kind, plan.threads_per_row, plan.cluster_n, count, ba, bb, mbar, phase
    )


def reduce_stage(val, kind: str, plan: RowPlan, buf, mbar, stage, phase=0):
    """``Reducer.reduce`` as a free function, for dynamic loops (which cannot carry
    Python objects): pass ``red.buf`` and ``red.mbar`` taken before the loop."""
    b = buf[None, None, stage] if const_expr(buf is not None) else None
    mb = (mbar + stage) if const_expr(mbar is not None) else None
    return row_allreduce(Float32(val), kind, plan.threads_per_row, plan.cluster_n, b, mb, phase)


def cta_coords(plan: RowPlan):
    """(tidx, bidx, cluster_y): this thread, its CTA's row tile, and the CTA's slice of
    the row within the cluster (0 without a cluster). Called from kernel bodies."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, cy, _ = cute.arch.block_idx()
    return tidx, bidx, (cy if const_expr(plan.cluster_n > 1) else 0)


def start_ring(plan: RowPlan, dtype, mX: cute.Tensor, stages: int, count: int):
    """The persistent cp.async-ring kernels' common prologue (the norm forward's ring,
    the norm backward's shared-memory path): coordinates, the reducer (4 stages) with its
    cluster barriers signalled, ``count`` ring buffers of ``stages`` row tiles each, and the
    CTA's first row tiles. Returns (tidx, bidx, cluster_y, m, smem, red, bufs, tiles)."""
    tidx, bidx, cluster_y = cta_coords(plan)
    m = cute.size(mX, mode=[0])
    smem = cutlass.memory.SmemAllocator()
    red = Reducer(plan, stages=4)
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


class RowTiles:
    """Thread-level partitions of (M, N) row tensors for one CTA."""

    def __init__(self, plan: RowPlan, dtype, m, tidx, bidx, cluster_y):
        self.plan = plan
        self.dtype = dtype
        self.tidx = tidx
        self.tiled_copy = make_tiled_copy(dtype, plan)
        self.thr = self.tiled_copy.get_slice(tidx)
        self._copies = {dtype: self.tiled_copy}
        self.coord = (bidx, cluster_y)
        self.m = m
        ident = cute.make_identity_tensor((m, plan.n))
        cX = cute.local_tile(ident, tiler(plan), self.coord)
        self.tXcX = self.thr.partition_S(cX)
        self.row = self.tXcX[(0, 0), 0, 0][0]
        self.pred = None if const_expr(plan.even) else column_predicate(self.tXcX, plan.n)

    def copy_for(self, dtype):
        """The tiled copy for tensors of ``dtype`` (same thread / value layout: the plan's
        ``vec`` elements per access, <= 128 bits since the plan is sized for the widest
        dtype). A weight may have another dtype than the rows."""
        if dtype not in self._copies:
            self._copies[dtype] = make_tiled_copy(dtype, self.plan)
        return self._copies[dtype]

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
        """Load a (N,)-broadcast fragment (no row predicate). A vector wider than the rows'
        (an fp32 weight beside bf16 activations: ``vec`` elements > 128 bits) is read
        element by element into the same fragment layout, so the rows keep their 16-byte
        accesses; a weight is read once per CTA (persistent kernels) or after the row's
        reduction, from L2."""
        r = cute.make_rmem_tensor_like(gT)
        if const_expr(not self.plan.even):
            r.fill(0.0)
        if const_expr(gT.element_type.width * self.plan.vec > 128):
            for k in cutlass.range_constexpr(cute.size(gT, mode=[2])):
                if const_expr(self.plan.even):
                    for v in cutlass.range_constexpr(self.plan.vec):
                        r[(v, 0), 0, k] = gT[(v, 0), 0, k]
                else:
                    if self.pred[0, 0, k]:
                        for v in cutlass.range_constexpr(self.plan.vec):
                            r[(v, 0), 0, k] = gT[(v, 0), 0, k]
        else:
            cute.copy(self.copy_for(gT.element_type), gT, r, pred=self.pred)
        return r

    @cute.jit
    def store(self, val_ssa, gT: cute.Tensor):
        r = cute.make_rmem_tensor_like(gT)
        r.store(val_ssa.to(gT.element_type))
        if self.row < self.m:
            cute.copy(self.tiled_copy, r, gT, pred=self.pred)

    # ---- row tensors staged in shared memory with cp.async (``smem_rows_ok`` plans): the
    # row is read from shared memory as often as needed instead of being kept in registers.

    def stage_rows(self, smem, *tensors):
        """cp.async this CTA's tile of each (M, N) tensor into a new shared-memory tile
        (one commit group); returns their fragment views (``part``'s layout). Pair with
        ``wait_rows`` before the first read; each thread reads only what it copied."""
        views = []
        for mT in tensors:
            sT = smem.allocate_tensor(
                mT.element_type, cute.make_ordered_layout(tiler(self.plan), order=(1, 0)), byte_alignment=16
            )
            self._prefetch_rows(mT, sT)
            views.append(self.thr.partition_S(sT))
        cute.arch.cp_async_commit_group()
        return views

    @cute.jit
    def _prefetch_rows(self, mT: cute.Tensor, sT: cute.Tensor):
        dtype = mT.element_type
        atom = cp_async_atom(dtype, self.plan.vec * dtype.width)
        thr_layout = cute.make_ordered_layout(
            (self.plan.rows_per_cta, self.plan.threads_per_row), order=(1, 0)
        )
        tc = cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, self.plan.vec)))
        thr = tc.get_slice(self.tidx)
        g = thr.partition_S(cute.local_tile(mT, tiler(self.plan), self.coord))
        d = thr.partition_D(sT)
        # rows past M copy nothing: their (garbage) values reach only their own row's
        # reduction (one row per cluster) and are never stored
        if self.row < self.m:
            cute.copy(tc, g, d)

    def wait_rows(self):
        cute.arch.cp_async_wait_group(0)

    # ---- broadcast vectors (weight / bias) staged in shared memory with cp.async:
    # issued at kernel start, read after the reductions. Keeps them out of the
    # registers while the row is reduced, without an L2 round trip on the tail.

    def alloc_smem_bcast(self, smem, dtype, spread: bool = False):
        """A (1, tile_n) shared-memory tile for one broadcast vector (rows_per_cta == 1).

        ``spread``, for a vector wider than 16 bytes a fragment vector (an fp32 weight
        beside 16-bit rows: 8 x 4 bytes): the tile is laid out so that each 16-byte chunk
        of every thread's vectors sits beside the same chunk of the next thread's, i.e.
        column v0 + c * v1 + vec * t + vec * tpr * k (v0 < c = 16 bytes of elements) at
        v0 + c * t + c * tpr * v1 + vec * tpr * k. Read back by the same threads through
        ``thr.partition_S`` (any layout of the logical tile works), a warp's 16-byte
        loads cover 512 contiguous bytes: no bank conflict, where the plain layout (32
        bytes a thread) costs two shared-memory wavefronts for every one."""
        p = self.plan
        c = 128 // dtype.width
        if const_expr(spread and p.vec > c and p.vec % c == 0 and p.rows_per_cta == 1):
            layout = cute.make_layout(
                (1, (c, p.vec // c, p.threads_per_row, p.nvec)),
                stride=(p.tile_n, (1, c * p.threads_per_row, c, p.vec * p.threads_per_row)),
            )
            return smem.allocate_tensor(dtype, layout, byte_alignment=16)
        return smem.allocate_tensor(
            dtype, cute.make_layout((1, p.tile_n), stride=(p.tile_n, 1)), byte_alignment=16
        )

    def stage_bcast(self, smem, dtype, *vectors):
        """``alloc_smem_bcast`` + ``prefetch_bcast`` for each vector given; an absent
        (None) vector stays None. Returns the shared-memory tiles in order. ``dtype`` is
        the vectors' element type (the weight dtype, which may differ from the rows')."""
        tiles = []
        for v in vectors:
            sv = None
            if v is not None:
                sv = self.alloc_smem_bcast(smem, dtype)
                self.prefetch_bcast(v, sv)
            tiles.append(sv)
        return tiles

    @cute.jit
    def stage_bcast_own(self, mV: cute.Tensor, sV: cute.Tensor):
        """Copy this thread's own elements of a (N,) vector into ``sV`` (element-wise
        loads, for vectors wider than 128 bits a fragment vector: an fp32 weight beside
        16-bit rows); the same thread reads them back, so no barrier is needed. Columns
        past N are written as 0: readers load whole fragments unpredicated (uninitialized
        shared memory there made dx NaN through sum(dy * w * x))."""
        g = self.part_bcast(mV)
        d = self.thr.partition_S(sV)
        for k in cutlass.range_constexpr(cute.size(g, mode=[2])):
            if const_expr(self.plan.even):
                for v in cutlass.range_constexpr(self.plan.vec):
                    d[(v, 0), 0, k] = g[(v, 0), 0, k]
            else:
                if self.pred[0, 0, k]:
                    for v in cutlass.range_constexpr(self.plan.vec):
                        d[(v, 0), 0, k] = g[(v, 0), 0, k]
                else:
                    for v in cutlass.range_constexpr(self.plan.vec):
                        d[(v, 0), 0, k] = Float32(0.0).to(d.element_type)

    @cute.jit
    def prefetch_bcast(self, mV: cute.Tensor, sV: cute.Tensor):
        """cp.async this CTA's slice of a (N,) vector into ``sV``; commit one group."""
        dtype = mV.element_type
        atom = cp_async_atom(dtype, self.plan.vec * dtype.width, bypass_l1=False)
        thr_layout = cute.make_ordered_layout(
            (self.plan.rows_per_cta, self.plan.threads_per_row), order=(1, 0)
        )
        tc = cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, self.plan.vec)))
        tidx, _, _ = cute.arch.thread_idx()
        thr = tc.get_slice(tidx)
        full = broadcast_rows(mV, self.plan.rows_per_cta)
        g = thr.partition_S(cute.local_tile(full, tiler(self.plan), (0, self.coord[1])))
        d = thr.partition_D(sV)
        cute.copy(tc, g, d, pred=self.pred)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def load_smem_bcast(self, mV: cute.Tensor, sV: cute.Tensor):
        """This thread's fragment of a prefetched vector, from shared memory (waits for
        this thread's cp.async groups; each thread reads only what it copied)."""
        cute.arch.cp_async_wait_group(0)
        src = self.thr.partition_S(sV)
        r = cute.make_rmem_tensor_like(self.part_bcast(mV))
        if const_expr(not self.plan.even):
            r.fill(0.0)
        cute.copy(self.copy_for(sV.element_type), src, r, pred=self.pred)
        return r

    @cute.jit
    def store_affine_smem(self, y_ssa, gT: cute.Tensor, sW, sB, mW, mB, wait: cutlass.Constexpr = True):
        """Store ``y * w + b`` (fp32 fragment ``y_ssa``; ``sW`` / ``sB`` prefetched tiles
        or None) one vector at a time, so only one vector of w / b is live at once.
        ``wait=False``: the caller already waited for the tiles' cp.async group (a ring
        of later groups may still be in flight)."""
        if const_expr(wait):
            cute.arch.cp_async_wait_group(0)
        yf = cute.make_rmem_tensor(y_ssa.shape, Float32)
        yf.store(y_ssa)
        r = cute.make_rmem_tensor_like(gT)
        if const_expr(sW is not None):
            tW = self.thr.partition_S(sW)
        if const_expr(sB is not None):
            tB = self.thr.partition_S(sB)
        for k in cutlass.range_constexpr(cute.size(yf, mode=[2])):
            yk = yf[None, 0, k].load()
            # (reshape: a ``spread`` tile's thread view has a nested vector mode, same order)
            if const_expr(sW is not None):
                yk = yk * tW[None, 0, k].load().reshape(yk.shape).to(Float32)
            if const_expr(sB is not None):
                yk = yk + tB[None, 0, k].load().reshape(yk.shape).to(Float32)
            r[None, 0, k].store(yk.to(gT.element_type))
        if self.row < self.m:
            cute.copy(self.tiled_copy, r, gT, pred=self.pred)

    @cute.jit
    def store_affine(self, y_ssa, gT: cute.Tensor, gW, gB):
        """Store ``y * w + b`` (fp32 fragment ``y_ssa``) with w / b (``part_bcast`` views or
        None) read from global memory element-wise one vector at a time: for weights wider
        than the rows (fp32 beside 16-bit x), keeping one vector of them live."""
        yf = cute.make_rmem_tensor(y_ssa.shape, Float32)
        yf.store(y_ssa)
        r = cute.make_rmem_tensor_like(gT)
        for k in cutlass.range_constexpr(cute.size(yf, mode=[2])):
            for v in cutlass.range_constexpr(self.plan.vec):
                yv = yf[(v, 0), 0, k]
                if const_expr(self.plan.even):
                    if const_expr(gW is not None):
                        yv = yv * Float32(gW[(v, 0), 0, k])
                    if const_expr(gB is not None):
                        yv = yv + Float32(gB[(v, 0), 0, k])
                else:
                    if self.pred[0, 0, k]:
                        if const_expr(gW is not None):
                            yv = yv * Float32(gW[(v, 0), 0, k])
                        if const_expr(gB is not None):
                            yv = yv + Float32(gB[(v, 0), 0, k])
                r[(v, 0), 0, k] = yv.to(gT.element_type)
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
