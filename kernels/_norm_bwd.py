"""The persistent backward of RMSNorm and LayerNorm (one CuTe DSL kernel builder for both).

RMSNorm:   xhat = x * rstd;           dx = rstd * (g - xhat * mean(g * xhat))
LayerNorm: xhat = (x - mean) * rstd;  dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
with g = dy * w (dy without a weight); dw = sum_rows(dy * xhat), db = sum_rows(dy).

The grid is the number of co-resident CTAs (clusters); each loops over row tiles,
accumulates dw / db in fp32 registers and writes one partial row per CTA row slot,
summed by the caller. Rows of one CTA each (N >= 4096 for 16-bit dtypes) stream x and
dy through a cp.async shared-memory ring (see ``bwd_smem_stages``); the reductions are
independent of mean / rstd there (sum(g * x) and sum(g), combined after), so the loads
of the next tiles stay in flight across the reduction's round trip.

Imported only from inside compile functions and torch wrappers (no cutlass, no torch at
the top level: the builder imports them inside).
"""

from ._plan import WIDTHS, io_width, plan_rows, resolve_weight_dtype

BWD_BUDGET = 32  # row elements per thread kept in registers (two rows: x and dy)

# Default of the "w_perm" knob (the configuration overrides; measured on the H200): a
# weight wider than 16 bytes a fragment vector (fp32 beside 16-bit rows) kept in shared
# memory in the conflict-free layout (``RowTiles.alloc_smem_bcast(spread=True)``).
W_PERM = True
# A wide weight (fp32 beside 16-bit rows) in shared memory, read per use (measured, see
# ``w_smem_ok``), also on rows of one CTA (N in [4096, 16384] for 16-bit rows) instead of
# in registers for the whole loop, by kind.
W_SMEM_WIDE_ONE_CTA = {"rms": True, "layer": False}


def bwd_plan(dtype: str, n: int, weight_dtype: str = "same", has_weight: bool = True):
    """The launch plan of the backward (the wrapper sizes its grid with the same one): by
    the rows' dtype; a wider weight is read element-wise once per CTA."""
    return plan_rows(n, io_width(dtype), budget=BWD_BUDGET)


def bwd_smem_stages(plan, width: int, tune: dict | None = None) -> int:
    """Pipeline depth of the shared-memory backward (x and dy tiles of ``width`` bits per
    stage, at most ``tune["stages"]`` = 4), or 0 for the register path. Used for one row
    per CTA (N >= 4096 for 16-bit dtypes; split over a cluster above 16384) while two or
    more stages fit in ``tune["smem_kb"]`` (default 128 KiB: measured faster than 192 at
    N = 262144)."""
    tune = tune or {}
    if not tune.get("smem", True):
        return 0
    if plan.rows_per_cta != 1 or plan.vec * width < 32:
        return 0
    if plan.n < tune.get("smem_min_n", 0):
        return 0
    stage_bytes = 2 * plan.tile_n * width // 8
    s = min(tune.get("stages", 4), tune.get("smem_kb", 128) * 1024 // stage_bytes)
    return s if s >= 2 else 0


def w_smem_ok(plan, tune: dict | None = None, wide: bool = False, kind: str = "rms") -> bool:
    """Keep the weight in shared memory (read per use) in the shared-memory backward? By
    default for rows over clusters of 16 CTAs, and for a ``wide`` weight (fp32 beside
    16-bit rows) on rows of one CTA where ``W_SMEM_WIDE_ONE_CTA[kind]`` (``tune["w_smem"]``
    overrides). Measured on the H200 (LayerNorm bwd, bf16 rows, TB/s, registers vs shared
    memory): 4096x262144 3.64 / 3.71, fp32 w 3.09 / 3.40; 32768x65536 3.82 / 3.73, fp32 w
    3.81 / 3.59."""
    tune = tune or {}
    default = plan.cluster_n >= 16 or (wide and plan.cluster_n == 1 and W_SMEM_WIDE_ONE_CTA[kind])
    return tune.get("w_smem", default)


def search_space(kind: str, params: dict) -> list:
    """``quack tune``'s backward candidates of ``kind`` ("rms" / "layer"; they share this
    kernel): the heuristic, the register path, other pipeline depths and shared-memory
    budgets, and the other choice of where the weight lives. Pruned to one candidate per
    kernel they build: the compiled code and the grid depend only on the resolved (stages,
    weight in shared memory, its layout), so e.g. on rows the register path takes every
    shared-memory knob would compile the same kernel under another key."""
    from ._configs import NormBwdConfig as C

    dt, n = params["dtype"], params["n"]
    has_w = params.get("has_weight", True)
    width = WIDTHS[dt]
    wide = WIDTHS[resolve_weight_dtype(dt, params.get("weight_dtype", "same"))] > width
    plan = bwd_plan(dt, n)
    raw = [C(), C(smem=False), *(C(stages=st, smem_kb=kb) for st in (2, 3) for kb in (128, 192))]
    raw += [C(w_smem=True), C(w_smem=False), C(w_smem=True, w_perm=not W_PERM)]
    out, seen = [], set()
    for c in raw:
        k = c.knobs()
        st = bwd_smem_stages(plan, width, k)
        ws = bool(has_w and st >= 2 and w_smem_ok(plan, k, wide, kind))
        sig = (st, ws, ws and bool(k.get("w_perm", W_PERM)))
        if sig not in seen:
            seen.add(sig)
            out.append(c)
    return out


def bwd_grid(m: int, plan, width: int, device, tune: dict | None = None, w_bytes: int = 0) -> int:
    """CTAs (per cluster rank) of the persistent backward: as many as can be resident
    at once. 128-thread CTAs: 2 per SM; 256-thread CTAs: 1 (registers); fewer when the
    shared-memory pipeline does not fit. Clusters of 4+ CTAs: one cluster less than
    SMs / cluster size (GPC granularity: on the H200, 15 clusters of 8 and 7 of 16 are
    co-resident, not 16 and 8; one more runs as a second wave, ~1.7x slower)."""
    from . import _torch as kt

    tiles = -(-m // plan.rows_per_cta)
    ctas_per_sm = 2 if plan.num_threads <= 128 else 1
    st = bwd_smem_stages(plan, width, tune)
    if st:
        smem = st * 2 * plan.tile_n * width // 8 + w_bytes + 1024
        ctas_per_sm = max(1, min(ctas_per_sm, (227 * 1024) // smem))
    clusters = kt.sm_count(device) * ctas_per_sm // plan.cluster_n
    if plan.cluster_n >= 4:
        clusters -= 1
    return max(1, min(tiles, clusters))


def compile_norm_bwd(
    kind: str, dtype: str, n: int, has_weight: bool, has_bias: bool, weight_dtype: str, tune: dict
):
    """Build the backward of ``kind`` ("rms" or "layer"). Runtime signature:
    fn(x, w|None, dy, mean|None, rstd, dx, dw_partial|None, db_partial|None, num_blocks)
    with the partials (num_blocks * rows_per_cta, n) fp32. ``mean`` only for "layer",
    ``db_partial`` only with ``has_bias``."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, const_expr

    from . import _rowreduce as rr

    layer = kind == "layer"
    dt = rr.cutlass_dtype(dtype)
    wdt = rr.cutlass_dtype(resolve_weight_dtype(dtype, weight_dtype))
    plan = bwd_plan(dtype, n, weight_dtype, has_weight)
    stages = bwd_smem_stages(plan, dt.width, tune)
    # The shared-memory backward of the largest rows keeps the weight in shared memory,
    # read per use, instead of in registers for the whole loop (255 registers at N =
    # 262144; see ``w_smem_ok``).
    w_smem = has_weight and stages >= 2 and w_smem_ok(plan, tune, wdt.width > dt.width, kind)
    w_perm = bool(tune.get("w_perm", W_PERM))
    inv_n = 1.0 / plan.n

    def dual_reduce(a, b, rbuf, rmbar, it):
        """(sum a, sum b) over the row in one round trip; double-buffered by iteration."""
        j = it % 2
        mb = (rmbar + j) if const_expr(plan.cluster_n > 1) else None
        ba = rbuf[None, None, 2 * j] if const_expr(rbuf is not None) else None
        bb = rbuf[None, None, 2 * j + 1] if const_expr(rbuf is not None) else None
        return rr.row_allreduce_pair(
            Float32(a), Float32(b), "sum2", plan.threads_per_row, plan.cluster_n, 1, ba, bb, mb, (it // 2) % 2
        )

    def row_sum(v):
        return v.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)

    def weight_frag(t, sW, rW, shape):
        """The weight fragment as fp32: from shared memory (``w_smem``; a load per use,
        ordered after the previous reduction's barriers) or from registers."""
        if const_expr(sW is not None):
            # reshape: a ``spread`` tile's thread view nests the vector mode (same order)
            return t.thr.partition_S(sW).load().reshape(shape).to(Float32)
        return rW.load().to(Float32)

    @cute.kernel
    def kernel_smem(
        mX: cute.Tensor, mW, mdY: cute.Tensor, mMean, mRstd: cute.Tensor, mdX: cute.Tensor, mdW, mdB
    ):
        # Large rows (one row per CTA of a cluster): x and dy of the next ``stages - 1``
        # row tiles stream into shared memory with per-thread cp.async while the current
        # tile is reduced, so loads stay in flight across the cluster round trip.
        # Each thread copies and reads back only its own vectors: no CTA barrier.
        tidx, bidx, cluster_y, m, smem, red, (sX, sdY), t0 = rr.start_ring(plan, dt, mX, stages, 2)
        tc = rr.cp_async_tiled_copy(dt, plan)
        thr = tc.get_slice(tidx)
        num_tiles = m
        grid_m = cute.arch.grid_dim()[0]
        # prologue: tiles 0 .. stages-2 of this CTA
        for s in cutlass.range_constexpr(stages - 1):
            ts = bidx + s * grid_m
            if ts < num_tiles:
                rr.copy_row_tile(tc, thr, plan, mX, ts, cluster_y, sX[None, None, s], t0.pred)
                rr.copy_row_tile(tc, thr, plan, mdY, ts, cluster_y, sdY[None, None, s], t0.pred)
            cute.arch.cp_async_commit_group()
        sW = None
        rW = None
        if const_expr(w_smem):
            sW = t0.alloc_smem_bcast(smem, wdt, spread=w_perm)
            t0.stage_bcast_own(mW, sW)
        elif const_expr(mW is not None):
            rW = t0.load_bcast(t0.part_bcast(mW))
        dw_acc = cute.make_rmem_tensor_like(t0.part(mdX), Float32)
        dw_acc.fill(0.0)
        db_acc = cute.make_rmem_tensor_like(t0.part(mdX), Float32)
        db_acc.fill(0.0)
        rstd_next = Float32(0.0)
        mean_next = Float32(0.0)
        if bidx < num_tiles:
            rstd_next = Float32(mRstd[bidx])
            if const_expr(layer):
                mean_next = Float32(mMean[bidx])
        red.wait_cluster()
        rbuf, rmbar = red.buf, red.mbar
        for tile in cutlass.range(bidx, num_tiles, grid_m, unroll=1):
            it = (tile - bidx) // grid_m
            t = rr.RowTiles(plan, dt, m, tidx, tile, cluster_y)
            rstd = rstd_next
            mean = mean_next
            if tile + grid_m < num_tiles:
                rstd_next = Float32(mRstd[tile + grid_m])
                if const_expr(layer):
                    mean_next = Float32(mMean[tile + grid_m])
            # refill the stage read by the previous iteration with tile it + stages - 1
            tn = tile + (stages - 1) * grid_m
            sn = (it + stages - 1) % stages
            if tn < num_tiles:
                rr.copy_row_tile(tc, thr, plan, mX, tn, cluster_y, sX[None, None, sn], t.pred)
                rr.copy_row_tile(tc, thr, plan, mdY, tn, cluster_y, sdY[None, None, sn], t.pred)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(stages - 1)
            sc = it % stages
            tXs = t.thr.partition_S(sX[None, None, sc])
            tdYs = t.thr.partition_S(sdY[None, None, sc])
            rx = cute.make_rmem_tensor_like(t.part(mX))
            rdy = cute.make_rmem_tensor_like(t.part(mX))
            if const_expr(not plan.even):
                rx.fill(0.0)
                rdy.fill(0.0)
            cute.copy(t.tiled_copy, tXs, rx, pred=t.pred)
            cute.copy(t.tiled_copy, tdYs, rdy, pred=t.pred)
            x = rx.load().to(Float32)
            g = rdy.load().to(Float32)
            if const_expr(mW is not None):
                g = g * weight_frag(t, sW, rW, g.shape)
            # The reductions need neither mean nor rstd: sum(g * xhat) = rstd * (sum(g * x)
            # - mean * sum(g)); columns past N hold x = dy = 0.
            if const_expr(layer):
                sgx, sg = dual_reduce(row_sum(g * x), row_sum(g), rbuf, rmbar, it)
                c1 = (sgx - mean * sg) * rstd * inv_n
                c0 = sg * inv_n
            else:
                sgx = rr.reduce_stage(row_sum(g * x), "sum", plan, rbuf, rmbar, it % 2, (it // 2) % 2)
                c1 = sgx * rstd * inv_n
            # second pass re-reads shared memory (keeps the row out of the registers)
            rx2 = cute.make_rmem_tensor_like(t.part(mX))
            rdy2 = cute.make_rmem_tensor_like(t.part(mX))
            if const_expr(not plan.even):
                rx2.fill(0.0)
                rdy2.fill(0.0)
            cute.copy(t.tiled_copy, tXs, rx2, pred=t.pred)
            cute.copy(t.tiled_copy, tdYs, rdy2, pred=t.pred)
            x2 = rx2.load().to(Float32)
            dy2 = rdy2.load().to(Float32)
            if const_expr(layer):
                xhat = (x2 - mean) * rstd
            else:
                xhat = x2 * rstd
            g2 = dy2
            if const_expr(mW is not None):
                g2 = dy2 * weight_frag(t, sW, rW, dy2.shape)
            if const_expr(layer):
                dx = (g2 - c0 - xhat * c1) * rstd
            else:
                dx = (g2 - xhat * c1) * rstd
            rdx = cute.make_rmem_tensor_like(t.part(mX))
            rdx.store(dx.to(dt))
            cute.copy(t.tiled_copy, rdx, t.part(mdX), pred=t.pred)
            if const_expr(mdW is not None):
                dw_acc.store(dw_acc.load() + dy2 * xhat)
            if const_expr(mdB is not None):
                db_acc.store(db_acc.load() + dy2)
        cute.arch.cp_async_wait_group(0)
        store_partials(tidx, bidx, cluster_y, dw_acc, db_acc, mdW, mdB)

    @cute.kernel
    def kernel(mX: cute.Tensor, mW, mdY: cute.Tensor, mMean, mRstd: cute.Tensor, mdX: cute.Tensor, mdW, mdB):
        tidx, bidx, cluster_y = rr.cta_coords(plan)
        m = cute.size(mX, mode=[0])
        smem = cutlass.memory.SmemAllocator()
        red = rr.Reducer(plan, stages=4)
        red.allocate(smem)
        red.init_cluster(tidx)
        t0 = rr.RowTiles(plan, dt, m, tidx, 0, cluster_y)
        if const_expr(mW is not None):
            w = t0.load_bcast(t0.part_bcast(mW)).load().to(Float32)
        # Persistent over row tiles: tile = bidx, bidx + grid, ...; dw / db partial sums
        # stay in registers, one partial row per (CTA, row slot), summed by the caller.
        dw_acc = cute.make_rmem_tensor_like(t0.part(mdX), Float32)
        dw_acc.fill(0.0)
        db_acc = cute.make_rmem_tensor_like(t0.part(mdX), Float32)
        db_acc.fill(0.0)
        red.wait_cluster()
        rbuf, rmbar = red.buf, red.mbar
        num_tiles = cute.ceil_div(m, plan.rows_per_cta)
        grid_m = cute.arch.grid_dim()[0]
        for tile in cutlass.range(bidx, num_tiles, grid_m, unroll=1):
            it = (tile - bidx) // grid_m
            t = rr.RowTiles(plan, dt, m, tidx, tile, cluster_y)
            x = t.load(t.part(mX)).load().to(Float32)
            dy = t.load(t.part(mdY)).load().to(Float32)
            rstd = t.read_row_scalar(mRstd)
            if const_expr(layer):
                xhat = (x - t.read_row_scalar(mMean)) * rstd
            else:
                xhat = x * rstd
            g = dy
            if const_expr(mW is not None):
                g = dy * w
            # columns past N: dy = 0, so g = 0 and they add nothing
            if const_expr(layer):
                sgx, sg = dual_reduce(row_sum(g * xhat), row_sum(g), rbuf, rmbar, it)
                dx = (g - sg * inv_n - xhat * (sgx * inv_n)) * rstd
            else:
                sgx = rr.reduce_stage(row_sum(g * xhat), "sum", plan, rbuf, rmbar, it % 2, (it // 2) % 2)
                dx = (g - xhat * (sgx * inv_n)) * rstd
            t.store(dx, t.part(mdX))
            if const_expr(mdW is not None):
                dw_acc.store(dw_acc.load() + dy * xhat)
            if const_expr(mdB is not None):
                db_acc.store(db_acc.load() + dy)
        store_partials(tidx, bidx, cluster_y, dw_acc, db_acc, mdW, mdB)

    def store_partials(tidx, bidx, cluster_y, dw_acc, db_acc, mdW, mdB):
        """Each CTA row slot's dw / db partial row (traced inline in the kernels)."""
        if const_expr(mdW is not None):
            tp = rr.RowTiles(plan, dt, cute.size(mdW, mode=[0]), tidx, bidx, cluster_y)
            tp.store_fp32_rows(dw_acc, mdW)
        if const_expr(mdB is not None):
            tq = rr.RowTiles(plan, dt, cute.size(mdB, mode=[0]), tidx, bidx, cluster_y)
            tq.store_fp32_rows(db_acc, mdB)

    bwd_kernel = kernel_smem if stages >= 2 else kernel

    @cute.jit
    def launch(
        mX: cute.Tensor,
        mW,
        mdY: cute.Tensor,
        mMean,
        mRstd: cute.Tensor,
        mdX: cute.Tensor,
        mdW,
        mdB,
        num_blocks: Int32,
        stream,
    ):
        bwd_kernel(mX, mW, mdY, mMean, mRstd, mdX, mdW, mdB).launch(
            grid=[num_blocks, plan.cluster_n, 1],
            block=[plan.num_threads, 1, 1],
            cluster=[1, plan.cluster_n, 1] if plan.cluster_n > 1 else None,
            stream=stream,
        )

    x, m = rr.fake_rows(dt, n, plan.vec)
    dy, _ = rr.fake_rows(dt, n, plan.vec, m)
    dx, _ = rr.fake_rows(dt, n, plan.vec, m)
    w = rr.fake_vec(wdt, n) if has_weight else None
    mean = rr.fake_vec(Float32, m, align=4) if layer else None
    rstd = rr.fake_vec(Float32, m, align=4)
    dw = rr.fake_rows(Float32, n, plan.vec)[0] if has_weight else None
    db = rr.fake_rows(Float32, n, plan.vec)[0] if has_bias else None
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        launch, x, w, dy, mean, rstd, dx, dw, db, Int32(1), stream, options="--enable-tvm-ffi"
    )


def run_norm_bwd(kind: str, compile_fn, x, weight, dy, mean, rstd, bias_dtype):
    """The torch side of both backwards: validate, size the persistent grid, launch,
    sum the partials (fp32). ``compile_fn(dt, n, has_w, has_b, wdt)`` returns the compiled
    kernel and the knobs of the configuration it was compiled with (the grid follows them). Returns (dx, dweight|None, dbias|None): dweight in the
    weight's dtype, dbias in ``bias_dtype`` (None: no bias, no dbias)."""
    import torch

    from . import _torch as kt

    x2 = kt.rows(x, "x")
    m, n = x2.shape
    dt = kt.dtype_name(x2, "x")
    dy2 = kt.like_rows(dy, "dy", x)
    w, _, wdt = kt.affine(weight, None, n, x)
    rs = kt.per_row(rstd, "rstd", m, x)
    mu = kt.per_row(mean, "mean", m, x) if kind == "layer" else None
    dx = torch.empty_like(x2)
    has_bias = bias_dtype is not None
    if m == 0:
        dw = torch.zeros(n, dtype=weight.dtype, device=x.device) if weight is not None else None
        db = torch.zeros(n, dtype=bias_dtype, device=x.device) if has_bias else None
        return dx.view(x.shape), dw, db
    plan = bwd_plan(dt, n, wdt, w is not None)
    fn, tune = compile_fn(dt, n, w is not None, has_bias, wdt)
    width = kt.DTYPE_BITS[dt]
    w_bytes = 0
    wbits = kt.DTYPE_BITS[resolve_weight_dtype(dt, wdt)]
    if w is not None and bwd_smem_stages(plan, width, tune) and w_smem_ok(plan, tune, wbits > width, kind):
        w_bytes = plan.tile_n * wbits // 8
    grid = bwd_grid(m, plan, width, x.device, tune, w_bytes)
    rows = grid * plan.rows_per_cta
    dw_part = torch.empty(rows, n, dtype=torch.float32, device=x.device) if w is not None else None
    db_part = torch.empty(rows, n, dtype=torch.float32, device=x.device) if has_bias else None
    fn(x2, w, dy2, mu, rs, dx, dw_part, db_part, grid)
    dw = dw_part.sum(0).to(weight.dtype) if w is not None else None
    db = db_part.sum(0).to(bias_dtype) if has_bias else None
    return dx.view(x.shape), dw, db
