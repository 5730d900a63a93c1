"""Row all-reduces (CuTe DSL): warp shuffle -> shared memory across the warps of a row ->
distributed shared memory across the CTAs of a cluster (st.async with an mbarrier
transaction count); every thread of the row gets the result. ``row_allreduce`` (sum /
max), ``row_allreduce_pair`` (lse / sum2 / welford pairs in one round trip) and
``Reducer``, the shared memory and cluster mbarriers behind them. Imported lazily, only
from inside compile functions: importing this module imports cutlass; the kernels reach
it through ``quack_kernels._rowreduce``.
"""

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from ._plan import RowPlan


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


# ---- split cluster all-reduces (the pipelined ring, ``_ring_pipe``): ``send_*`` reduces
# within the warp and pushes each warp's partial to every CTA of the cluster; ``finish_*``
# waits for the row's partials and reduces them. Between the two the CTA works on another
# row, so the cluster round trip overlaps it. Cluster plans with one row a CTA only.


@cute.jit
def send_sum(
    val: Float32, threads_per_row: cutlass.Constexpr[int], cluster_n: cutlass.Constexpr[int], buf, mbar
):
    """Warp sum of ``val``, pushed into slot (0, rank * warps + warp) of ``buf`` in every
    CTA of the cluster (completing bytes on their ``mbar``)."""
    val = cute.arch.warp_reduction(val, operator.add, threads_in_group=32)
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    warps = const_expr(threads_per_row // 32)
    rank = cute.arch.block_idx_in_cluster()
    if warp == 0:
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(mbar, warps * cluster_n * 4)
    if lane < cluster_n:
        slot = buf.iterator + cute.crd2idx((0, rank * warps + warp), buf.layout)
        store_remote_f32(val, slot, mbar, lane)


@cute.jit
def finish_sum(total: cutlass.Constexpr[int], buf, mbar, phase):
    """Wait for the ``total`` partials of ``send_sum`` in ``buf`` and sum them."""
    cute.arch.mbarrier_wait(mbar, phase=phase)
    lane = cute.arch.lane_idx()
    v = Float32(0.0)
    for i in cutlass.range_constexpr((total + 31) // 32):
        idx = lane + i * 32
        if idx < total:
            v = v + buf[0, idx]
    return cute.arch.warp_reduction(v, operator.add)


@cute.jit
def send_welford(
    a: Float32,
    b: Float32,
    threads_per_row: cutlass.Constexpr[int],
    cluster_n: cutlass.Constexpr[int],
    buf_a,
    buf_b,
    mbar,
    count: cutlass.Constexpr[int],
):
    """Warp (mean, M2) of the threads' (mean, M2) over ``count`` elements each (Chan's
    formula, equal counts), pushed like ``send_sum`` into ``buf_a`` / ``buf_b``."""
    ma = cute.arch.warp_reduction(a, operator.add, threads_in_group=32) * (1.0 / 32)
    d = a - ma
    b = cute.arch.warp_reduction(b + d * d * float(count), operator.add, threads_in_group=32)
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    warps = const_expr(threads_per_row // 32)
    rank = cute.arch.block_idx_in_cluster()
    if warp == 0:
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(mbar, warps * cluster_n * 8)
    if lane < cluster_n:
        ci = (0, rank * warps + warp)
        store_remote_f32(ma, buf_a.iterator + cute.crd2idx(ci, buf_a.layout), mbar, lane)
        store_remote_f32(b, buf_b.iterator + cute.crd2idx(ci, buf_b.layout), mbar, lane)


@cute.jit
def finish_welford(total: cutlass.Constexpr[int], count: cutlass.Constexpr[int], buf_a, buf_b, mbar, phase):
    """Wait for the ``total`` warp pairs of ``send_welford`` (``count`` elements each) and
    merge them: (row mean, row M2)."""
    cute.arch.mbarrier_wait(mbar, phase=phase)
    lane = cute.arch.lane_idx()
    sa = Float32(0.0)
    for i in cutlass.range_constexpr((total + 31) // 32):
        idx = lane + i * 32
        if idx < total:
            sa = sa + buf_a[0, idx]
    mean = cute.arch.warp_reduction(sa, operator.add) * (1.0 / total)
    sb = Float32(0.0)
    for i in cutlass.range_constexpr((total + 31) // 32):
        idx = lane + i * 32
        if idx < total:
            dd = buf_a[0, idx] - mean
            sb = sb + buf_b[0, idx] + dd * dd * float(count)
    return mean, cute.arch.warp_reduction(sb, operator.add)
