"""A CTA's rows (CuTe DSL): ``RowTiles`` — per-thread fragments of the row (128-bit
vector accesses through a tiled copy), a column predicate, the thread's row index, and the
launch shape from ``quack_kernels._plan.RowPlan`` — with its copies: predicated vector
loads / stores, rows and broadcast vectors (weight / bias) staged in shared memory with
cp.async, fused affine stores. Imported lazily, only from inside compile functions:
importing this module imports cutlass; the kernels reach it through
``quack_kernels._rowreduce``.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, const_expr

from ._plan import RowPlan


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


def cp_async_tiled_copy(dtype, plan: RowPlan, bypass_l1: bool = True):
    """cp.async of (M, N) row tiles into shared memory in the plan's thread / value layout
    (``plan.vec`` elements a thread a vector): each thread copies, and later reads back
    through ``RowTiles.thr``, its own vectors, so no CTA barrier is needed between."""
    return cute.make_tiled_copy_tv(
        cp_async_atom(dtype, plan.vec * dtype.width, bypass_l1=bypass_l1),
        cute.make_ordered_layout((plan.rows_per_cta, plan.threads_per_row), order=(1, 0)),
        cute.make_layout((1, plan.vec)),
    )


def copy_row_tile(tc, thr, plan: RowPlan, mT: cute.Tensor, tile, cluster_y, dst: cute.Tensor, pred=None):
    """cp.async this CTA's tile ``tile`` of ``mT`` (its ``cluster_y`` slice) into ``dst`` (a
    shared-memory stage) with ``tc`` (``cp_async_tiled_copy``) and ``thr``, its thread slice.
    Issues the copies only; the caller commits the group. Traced inline."""
    src = thr.partition_S(cute.local_tile(mT, tiler(plan), (tile, cluster_y)))
    if const_expr(pred is None):
        cute.copy(tc, src, thr.partition_D(dst))
    else:
        cute.copy(tc, src, thr.partition_D(dst), pred=pred)


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
