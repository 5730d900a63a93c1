"""RMSNorm forward and backward in CuTe DSL.

forward:  h = x (+ residual);  rstd = 1 / sqrt(mean(h^2) + eps);  y = h * rstd (* w) (+ b)
backward: dx = rstd * (dy*w - h * mean(dy*w*h) * rstd^2);  dw = sum_rows(dy * h * rstd)

Top level imports only quack: torch and cutlass are imported inside functions.
"""

from quack import jit_cache
from quack.params import Bool, Dtype, Int

from ._plan import N_MAX, N_MIN


# Tuning knobs read at compile time (benchmark experiments call ``.raw`` after setting them).
_TUNE: dict = {}

# --------------------------------------------------------------------------- forward

@jit_cache(
    "rmsnorm_fwd",
    params={"dtype": Dtype(), "n": Int(min=N_MIN, max=N_MAX), "has_weight": Bool(),
            "has_bias": Bool(), "has_residual": Bool()},
    reference=f"{__name__}:_verify_rmsnorm_fwd",
)
def compile_rmsnorm_fwd(dtype: str, n: int, has_weight: bool = True, has_bias: bool = False,
                        has_residual: bool = False):
    """Compile RMSNorm forward for rows of ``n`` elements of ``dtype`` (any batch size).
    Runtime signature: fn(x, w|None, b|None, residual|None, y, residual_out|None, rstd, eps)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, const_expr

    from . import _rowreduce as rr
    from ._plan import plan_rows, smem_bcast_ok

    dt = rr.cutlass_dtype(dtype)
    plan = plan_rows(n, dt.width, budget=64)
    stage_wb = _TUNE.get("stage_wb", True) and smem_bcast_ok(plan, dt.width,
                                                             int(has_weight) + int(has_bias))
    min_blocks = _TUNE.get("min_blocks", 3) if stage_wb else 0

    @cute.kernel
    def kernel(mX: cute.Tensor, mW, mB, mR, mY: cute.Tensor, mRo, mRstd: cute.Tensor,
               eps: Float32):
        tidx, bidx, cluster_y, m, smem, red, t = rr.start_rows(plan, dt, mX, stages=1)
        rX = t.load(t.part(mX))
        if const_expr(mR is not None):
            rR = t.load(t.part(mR))
        sW = None
        sB = None
        if const_expr(stage_wb):
            # weight / bias: cp.async into shared memory, read after the reduction
            sW, sB = t.stage_bcast(smem, dt, mW, mB)
        else:
            if const_expr(mW is not None):
                rW = t.load_bcast(t.part_bcast(mW))
            if const_expr(mB is not None):
                rB = t.load_bcast(t.part_bcast(mB))
        h = rX.load().to(Float32)
        if const_expr(mR is not None):
            h = h + rR.load().to(Float32)
            t.store(h, t.part(mRo))
        red.wait_cluster()
        ss = red.reduce((h * h).reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0),
                        "sum", 0)
        rstd = cute.math.rsqrt(ss * (1.0 / plan.n) + eps, fastmath=True)
        if const_expr(stage_wb):
            t.store_affine_smem(h * rstd, t.part(mY), sW, sB, mW, mB)
        else:
            y = h * rstd
            if const_expr(mW is not None):
                y = y * rW.load().to(Float32)
            if const_expr(mB is not None):
                y = y + rB.load().to(Float32)
            t.store(y, t.part(mY))
        t.write_row_scalar(mRstd, rstd)

    @cute.jit
    def launch(mX: cute.Tensor, mW, mB, mR, mY: cute.Tensor, mRo, mRstd: cute.Tensor,
               eps: Float32, stream):
        m = cute.size(mX, mode=[0])
        kernel(mX, mW, mB, mR, mY, mRo, mRstd, eps).launch(
            **rr.launch_kwargs(plan, m, stream, min_blocks=min_blocks))

    x, m = rr.fake_rows(dt, n, plan.vec)
    y, _ = rr.fake_rows(dt, n, plan.vec, m)
    w = rr.fake_vec(dt, n) if has_weight else None
    b = rr.fake_vec(dt, n) if has_bias else None
    r = rr.fake_rows(dt, n, plan.vec, m)[0] if has_residual else None
    ro = rr.fake_rows(dt, n, plan.vec, m)[0] if has_residual else None
    rstd = rr.fake_vec(Float32, m, align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(launch, x, w, b, r, y, ro, rstd, Float32(1e-6), stream,
                        options="--enable-tvm-ffi")


# --------------------------------------------------------------------------- backward

@jit_cache(
    "rmsnorm_bwd",
    params={"dtype": Dtype(), "n": Int(min=N_MIN, max=N_MAX), "has_weight": Bool()},
    reference=f"{__name__}:_verify_rmsnorm_bwd",
)
def compile_rmsnorm_bwd(dtype: str, n: int, has_weight: bool = True):
    """Compile RMSNorm backward. Runtime signature:
    fn(x, w|None, dy, rstd, dx, dw_partial|None) where dw_partial is (num_ctas, n) fp32
    (one partial sum per CTA, summed by the caller)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, const_expr

    from . import _rowreduce as rr
    from ._plan import plan_rows

    dt = rr.cutlass_dtype(dtype)
    plan = plan_rows(n, dt.width, budget=32)
    stages = bwd_smem_stages(plan, dt.width)

    @cute.kernel
    def kernel_smem(mX: cute.Tensor, mW, mdY: cute.Tensor, mRstd: cute.Tensor, mdX: cute.Tensor,
                    mdW, rows_per_block: Int32):
        # Large rows (one row per CTA of a cluster): x and dy of the next ``stages - 1``
        # row tiles stream into shared memory with per-thread cp.async while the current
        # tile is reduced, so loads stay in flight across the cluster round trip.
        # Each thread copies and reads back only its own vectors: no CTA barrier.
        tidx, _, _ = cute.arch.thread_idx()
        bidx, cy, _ = cute.arch.block_idx()
        cluster_y = cy
        m = cute.size(mX, mode=[0])
        smem = cutlass.utils.SmemAllocator()
        red = rr.Reducer(plan, stages=2)
        red.allocate(smem)
        sl = cute.make_layout((1, plan.tile_n, stages), stride=(plan.tile_n, 1, plan.tile_n))
        sX = smem.allocate_tensor(dt, sl, byte_alignment=128)
        sdY = smem.allocate_tensor(dt, sl, byte_alignment=128)
        red.init_cluster(tidx)
        t0 = rr.RowTiles(plan, dt, m, tidx, 0, cluster_y)
        atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(
            cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL), dt,
            num_bits_per_copy=plan.vec * dt.width)
        tc = cute.make_tiled_copy_tv(
            atom, cute.make_ordered_layout((plan.rows_per_cta, plan.threads_per_row), order=(1, 0)),
            cute.make_layout((1, plan.vec)))
        thr = tc.get_slice(tidx)
        num_tiles = m
        grid_m = cute.arch.grid_dim()[0]
        # prologue: tiles 0 .. stages-2 of this CTA
        for s in cutlass.range_constexpr(stages - 1):
            ts = bidx + s * grid_m
            if ts < num_tiles:
                cute.copy(tc, thr.partition_S(cute.local_tile(mX, rr.tiler(plan), (ts, cluster_y))),
                          thr.partition_D(sX[None, None, s]), pred=t0.pred)
                cute.copy(tc, thr.partition_S(cute.local_tile(mdY, rr.tiler(plan), (ts, cluster_y))),
                          thr.partition_D(sdY[None, None, s]), pred=t0.pred)
            cute.arch.cp_async_commit_group()
        if const_expr(mW is not None):
            rW = t0.load_bcast(t0.part_bcast(mW))
        dw_acc = cute.make_rmem_tensor_like(t0.part(mdX), Float32)
        dw_acc.fill(0.0)
        rstd_next = Float32(0.0)
        if bidx < num_tiles:
            rstd_next = Float32(mRstd[bidx])
        red.wait_cluster()
        rbuf, rmbar = red.buf, red.mbar
        for tile in cutlass.range(bidx, num_tiles, grid_m, unroll=1):
            it = (tile - bidx) // grid_m
            t = rr.RowTiles(plan, dt, m, tidx, tile, cluster_y)
            rstd = rstd_next
            if tile + grid_m < num_tiles:
                rstd_next = Float32(mRstd[tile + grid_m])
            # refill the stage read by the previous iteration with tile it + stages - 1
            tn = tile + (stages - 1) * grid_m
            sn = (it + stages - 1) % stages
            if tn < num_tiles:
                cute.copy(tc, thr.partition_S(cute.local_tile(mX, rr.tiler(plan), (tn, cluster_y))),
                          thr.partition_D(sX[None, None, sn]), pred=t.pred)
                cute.copy(tc, thr.partition_S(cute.local_tile(mdY, rr.tiler(plan), (tn, cluster_y))),
                          thr.partition_D(sdY[None, None, sn]), pred=t.pred)
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
                g = g * rW.load().to(Float32)
            # sum(g * xhat) = rstd * sum(g * x): rstd is needed only after the reduction
            dot = rr.reduce_stage(
                (g * x).reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0),
                "sum", plan, rbuf, rmbar, it % 2, (it // 2) % 2)
            c = dot * rstd * rstd * (1.0 / plan.n)
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
            g2 = dy2
            if const_expr(mW is not None):
                g2 = dy2 * rW.load().to(Float32)
            dx = (g2 - x2 * c) * rstd
            rdx = cute.make_rmem_tensor_like(t.part(mX))
            rdx.store(dx.to(dt))
            cute.copy(t.tiled_copy, rdx,
                      t.part(mdX),
                      pred=t.pred)
            if const_expr(mdW is not None):
                dw_acc.store(dw_acc.load() + dy2 * (x2 * rstd))
        cute.arch.cp_async_wait_group(0)
        if const_expr(mdW is not None):
            tp = rr.RowTiles(plan, dt, cute.size(mdW, mode=[0]), tidx, bidx, cluster_y)
            tp.store_fp32_rows(dw_acc, mdW)

    @cute.kernel
    def kernel(mX: cute.Tensor, mW, mdY: cute.Tensor, mRstd: cute.Tensor, mdX: cute.Tensor,
               mdW, rows_per_block: Int32):
        tidx, bidx, cluster_y = rr.cta_coords(plan)
        m = cute.size(mX, mode=[0])
        smem = cutlass.utils.SmemAllocator()
        red = rr.Reducer(plan, stages=2)
        red.allocate(smem)
        red.init_cluster(tidx)
        t0 = rr.RowTiles(plan, dt, m, tidx, 0, cluster_y)
        if const_expr(mW is not None):
            w = t0.load_bcast(t0.part_bcast(mW)).load().to(Float32)
        # Persistent over row tiles: tile = bidx, bidx + grid, ...; dw partial sums stay
        # in registers, one partial row per (CTA, row slot), summed by the caller.
        dw_acc = cute.make_rmem_tensor_like(t0.part(mdX), Float32)
        dw_acc.fill(0.0)
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
            xhat = x * rstd
            g = dy
            if const_expr(mW is not None):
                g = dy * w
            dot = rr.reduce_stage(
                (g * xhat).reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0),
                "sum", plan, rbuf, rmbar, it % 2, (it // 2) % 2)
            dx = (g - xhat * (dot * (1.0 / plan.n))) * rstd
            t.store(dx, t.part(mdX))
            if const_expr(mdW is not None):
                dw_acc.store(dw_acc.load() + dy * xhat)
        if const_expr(mdW is not None):
            tp = rr.RowTiles(plan, dt, cute.size(mdW, mode=[0]), tidx, bidx, cluster_y)
            tp.store_fp32_rows(dw_acc, mdW)

    bwd_kernel = kernel_smem if stages >= 2 else kernel

    @cute.jit
    def launch(mX: cute.Tensor, mW, mdY: cute.Tensor, mRstd: cute.Tensor, mdX: cute.Tensor,
               mdW, num_blocks: Int32, stream):
        bwd_kernel(mX, mW, mdY, mRstd, mdX, mdW, num_blocks).launch(
            grid=[num_blocks, plan.cluster_n, 1],
            block=[plan.num_threads, 1, 1],
            cluster=[1, plan.cluster_n, 1] if plan.cluster_n > 1 else None,
            stream=stream,
        )

    x, m = rr.fake_rows(dt, n, plan.vec)
    dy, _ = rr.fake_rows(dt, n, plan.vec, m)
    dx, _ = rr.fake_rows(dt, n, plan.vec, m)
    w = rr.fake_vec(dt, n) if has_weight else None
    rstd = rr.fake_vec(Float32, m, align=4)
    dw = rr.fake_rows(Float32, n, plan.vec)[0] if has_weight else None
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(launch, x, w, dy, rstd, dx, dw, Int32(1), stream,
                        options="--enable-tvm-ffi")


def bwd_smem_stages(plan, width: int) -> int:
    """Pipeline depth of the shared-memory backward (x and dy tiles per stage, at most
    ``_TUNE["stages"]`` = 4), or 0 for the register path. Used for one row per CTA
    (N >= 4096 for 16-bit dtypes; split over a cluster above 16384) while two or more
    stages fit in ``_TUNE["smem_kb"]`` (default 128 KiB: measured faster than 192 at
    N = 262144)."""
    if not _TUNE.get("smem", True):
        return 0
    if plan.rows_per_cta != 1 or plan.vec * width < 32:
        return 0
    if plan.n < _TUNE.get("smem_min_n", 0):
        return 0
    stage_bytes = 2 * plan.tile_n * width // 8
    s = min(_TUNE.get("stages", 4), _TUNE.get("smem_kb", 128) * 1024 // stage_bytes)
    return s if s >= 2 else 0


# --------------------------------------------------------------------------- torch-facing

def rmsnorm_fwd(x, weight=None, bias=None, residual=None, eps: float = 1e-6):
    """RMSNorm over the last dim. Returns ``(y, rstd, residual_out)``: y like x,
    rstd float32 of shape x.shape[:-1], residual_out = x + residual (None without residual)."""
    from . import _torch as kt
    import torch

    x2 = kt.rows(x, "x")
    m, n = x2.shape
    dt = kt.dtype_name(x2, "x")
    w = kt.vector(weight, "weight", n, x)
    b = kt.vector(bias, "bias", n, x)
    r2 = kt.like_rows(residual, "residual", x) if residual is not None else None
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    y = torch.empty_like(x2)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    ro = torch.empty_like(x2) if r2 is not None else None
    if m > 0:
        fn = compile_rmsnorm_fwd(dt, n, w is not None, b is not None, r2 is not None)
        fn(x2, w, b, r2, y, ro, rstd, float(eps))
    shape = x.shape
    return (y.view(shape), rstd.view(shape[:-1]), ro.view(shape) if ro is not None else None)


def _bwd_grid(m: int, plan, width: int, device) -> int:
    """CTAs (per cluster rank) of the persistent backward: as many as can be resident
    at once. 128-thread CTAs: 2 per SM; 256-thread CTAs: 1 (registers); fewer when the
    shared-memory pipeline does not fit. Clusters of 4+ CTAs: one cluster less than
    SMs / cluster size (GPC granularity: on the H200, 15 clusters of 8 and 7 of 16 are
    co-resident, not 16 and 8; one more runs as a second wave, ~1.7x slower)."""
    from . import _torch as kt

    tiles = -(-m // plan.rows_per_cta)
    ctas_per_sm = 2 if plan.num_threads <= 128 else 1
    st = bwd_smem_stages(plan, width)
    if st:
        smem = st * 2 * plan.tile_n * width // 8 + 1024
        ctas_per_sm = max(1, min(ctas_per_sm, (227 * 1024) // smem))
    clusters = kt.sm_count(device) * ctas_per_sm // plan.cluster_n
    if plan.cluster_n >= 4:
        clusters -= 1
    return max(1, min(tiles, clusters))


def rmsnorm_bwd(x, weight, dy, rstd):
    """Gradients of y = RMSNorm(x) * weight. ``x`` is the normalized input (x + residual
    when a residual was added), rstd from the forward. Returns ``(dx, dweight)``
    (dweight None when weight is None)."""
    from . import _torch as kt
    from ._plan import plan_rows
    import torch

    x2 = kt.rows(x, "x")
    m, n = x2.shape
    dt = kt.dtype_name(x2, "x")
    dy2 = kt.like_rows(dy, "dy", x)
    w = kt.vector(weight, "weight", n, x)
    rs = kt.per_row(rstd, "rstd", m, x)
    dx = torch.empty_like(x2)
    if m == 0:
        dw = torch.zeros_like(weight) if weight is not None else None
        return dx.view(x.shape), dw
    width = 32 if dt == "float32" else 16
    plan = plan_rows(n, width, budget=32)
    grid = _bwd_grid(m, plan, width, x.device)
    dw_part = (torch.empty(grid * plan.rows_per_cta, n, dtype=torch.float32, device=x.device)
               if w is not None else None)
    fn = compile_rmsnorm_bwd(dt, n, w is not None)
    fn(x2, w, dy2, rs, dx, dw_part, grid)
    dw = dw_part.sum(0).to(weight.dtype) if w is not None else None
    return dx.view(x.shape), dw


def _rmsnorm_autograd():
    import torch

    class RMSNormFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias, residual, eps):
            y, rstd, ro = rmsnorm_fwd(x, weight, bias, residual, eps)
            h = ro if ro is not None else x
            ctx.save_for_backward(h, weight, rstd)
            ctx.has_bias = bias is not None
            ctx.has_residual = residual is not None
            if ro is not None:
                return y, ro
            return y

        @staticmethod
        def backward(ctx, dy, *rest):
            h, weight, rstd = ctx.saved_tensors
            dh, dw = rmsnorm_bwd(h, weight, dy.contiguous(), rstd)
            if ctx.has_residual and rest and rest[0] is not None:
                dh = dh + rest[0]
            db = dy.reshape(-1, dy.shape[-1]).float().sum(0).to(dy.dtype) if ctx.has_bias else None
            return dh, dw, db, (dh if ctx.has_residual else None), None

    return RMSNormFunction


_FN = {}


def rmsnorm(x, weight=None, bias=None, residual=None, eps: float = 1e-6):
    """Differentiable RMSNorm (``torch.autograd.Function``). Returns y, or
    ``(y, x + residual)`` when a residual is given."""
    if "rms" not in _FN:
        _FN["rms"] = _rmsnorm_autograd()
    return _FN["rms"].apply(x, weight, bias, residual, eps)


# --------------------------------------------------------------------------- verify

def _verify_rmsnorm_fwd(params: dict, device) -> None:
    import torch

    dt = getattr(torch, params["dtype"])
    n = params["n"]
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(37, n, generator=g).to(device=device, dtype=dt)
    w = torch.randn(n, generator=g).to(device=device, dtype=dt) if params.get("has_weight", True) else None
    b = torch.randn(n, generator=g).to(device=device, dtype=dt) if params.get("has_bias") else None
    r = torch.randn(37, n, generator=g).to(device=device, dtype=dt) if params.get("has_residual") else None
    y, rstd, ro = rmsnorm_fwd(x, w, b, r, 1e-6)
    h = x.float() + (r.float() if r is not None else 0)
    ref_rstd = torch.rsqrt(h.pow(2).mean(-1) + 1e-6)
    ref = h * ref_rstd[:, None] * (w.float() if w is not None else 1) + (b.float() if b is not None else 0)
    tol = 1e-4 if dt == torch.float32 else (2e-2 if dt == torch.bfloat16 else 5e-3)
    torch.testing.assert_close(rstd, ref_rstd, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(y.float(), ref, atol=tol * 4, rtol=tol)


def _verify_rmsnorm_bwd(params: dict, device) -> None:
    import torch

    dt = getattr(torch, params["dtype"])
    n = params["n"]
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(37, n, generator=g).to(device=device, dtype=dt)
    dy = torch.randn(37, n, generator=g).to(device=device, dtype=dt)
    w = torch.randn(n, generator=g).to(device=device, dtype=dt) if params.get("has_weight", True) else None
    xr = x.float().requires_grad_()
    wr = w.float().requires_grad_() if w is not None else None
    rstd = torch.rsqrt(xr.detach().pow(2).mean(-1) + 1e-6)
    yr = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * (wr if wr is not None else 1)
    yr.backward(dy.float())
    dx, dw = rmsnorm_bwd(x, w, dy, rstd)
    tol = 1e-3 if dt == torch.float32 else 3e-2
    torch.testing.assert_close(dx.float(), xr.grad, atol=tol, rtol=tol)
    if w is not None:
        torch.testing.assert_close(dw.float(), wr.grad, atol=tol * 10, rtol=tol)
