"""RMSNorm forward and backward in CuTe DSL.

forward:  h = x (+ residual, rounded to x's dtype: the stored residual_out);
          rstd = 1 / sqrt(mean(h^2) + eps);  y = h * rstd (* w) (+ b)
backward: dx = rstd * (dy*w - h * mean(dy*w*h) * rstd^2);  dw = sum_rows(dy * h * rstd)

Top level imports only quack: torch and cutlass are imported inside functions.
"""

from quack import jit_cache
from quack.params import Bool, Config, Dtype, Int

from . import _tuning
from ._configs import NormBwdConfig, RmsNormFwdConfig
from ._plan import N_MAX, N_MIN, WIDTHS, WeightDtype, plan_rows, resolve_weight_dtype, size_class


def fwd_class(params: dict) -> str | None:
    """The forward's tuning-table class (kernels/tuned/*.toml): for 16-bit rows, the weight
    kind ("same" / "wide": wider than the rows) and the default plan's cluster size
    ("wide/cluster4"); None for fp32 rows (the kernel's heuristic)."""
    dtype, width = params["dtype"], WIDTHS[params["dtype"]]
    if width != 16:
        return None
    kind = "wide" if WIDTHS[resolve_weight_dtype(dtype, params["weight_dtype"])] > width else "same"
    return f"{kind}/cluster{plan_rows(params['n'], width, budget=64).cluster_n}"


def search_space(params: dict) -> list[RmsNormFwdConfig]:
    """``quack tune``'s candidates for a forward problem: the table's default, the
    heuristic, and the measured variants that apply to the problem's plan."""
    width = WIDTHS[params["dtype"]]
    wide = WIDTHS[resolve_weight_dtype(params["dtype"], params["weight_dtype"])] > width
    cands = [RmsNormFwdConfig()]
    if width == 16 and not params["has_residual"]:
        for mb in (3, 4):
            cands.append(RmsNormFwdConfig(x_smem=True, x_min_blocks=mb, x_smem_wide=wide or None))
        if wide:
            cands.append(
                RmsNormFwdConfig(ring=False, x_smem=True, x_smem_wide=True, x_rows=2, x_min_blocks=3)
            )
            cands.append(RmsNormFwdConfig(ring=True, ring_budget=128, wide_perm=True))
            for st in (3, 4):
                cands.append(RmsNormFwdConfig(ring_threads=512, ring_pipe=True, ring_wregs="wb", stages=st))
    return cands


# --------------------------------------------------------------------------- forward


@jit_cache(
    "rmsnorm_fwd",
    params={
        "dtype": Dtype(),
        "n": Int(min=N_MIN, max=N_MAX),
        "has_weight": Bool(),
        "has_bias": Bool(),
        "has_residual": Bool(),
        "weight_dtype": WeightDtype(),
        "config": Config(RmsNormFwdConfig, derive=_tuning.derive("rmsnorm_fwd", RmsNormFwdConfig, fwd_class)),
    },
    reference=f"{__package__}._verify:verify_rmsnorm_fwd",
    search_space=search_space,
    bench=f"{__package__}._verify:bench_rmsnorm_fwd",
)
def compile_rmsnorm_fwd(
    dtype: str,
    n: int,
    has_weight: bool = True,
    has_bias: bool = False,
    has_residual: bool = False,
    weight_dtype: str = "same",
    config: RmsNormFwdConfig | None = None,
):
    """Compile RMSNorm forward for rows of ``n`` elements of ``dtype`` (any batch size),
    weight / bias of ``weight_dtype`` ("same": ``dtype``).
    Runtime signature: fn(x, w|None, b|None, residual|None, y, residual_out|None, rstd, eps,
    num_blocks); num_blocks is the persistent grid (``fwd_grid``; ignored by the
    one-row-tile-per-CTA launch)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, const_expr

    from . import _rowreduce as rr
    from ._plan import smem_bcast_ok
    from ._xs_rows import xs_rows_kernel, xs_rows_launch_kwargs

    dt = rr.cutlass_dtype(dtype)
    wdt = rr.cutlass_dtype(resolve_weight_dtype(dtype, weight_dtype))
    kn = config.knobs()  # type: ignore[union-attr]  # derived by bind (_tuning)
    plan = plan_rows(n, dt.width, budget=64)
    # a weight wider than the rows (fp32 beside 16-bit x) is read after the reduction,
    # element-wise: early, it would hold 2x the registers through the reduction
    late_wb = wdt.width > dt.width
    stage_wb = kn.get("stage_wb", True) and smem_bcast_ok(plan, wdt.width, int(has_weight) + int(has_bias))
    # 3 CTAs/SM (80 registers) on the staged path; the late, element-wise fp32 weight
    # path would spill there (ptxas: 52 bytes at N = 65536), so it keeps 128 registers
    min_blocks = kn.get("min_blocks", 3) if stage_wb else kn.get("late_min_blocks", 0)
    # x through shared memory (``x_smem_ok``): cp.async'ed, read for the reduction and read
    # again for y, so x is not live in registers across the cluster reduction (a wide weight
    # only with the knob "x_smem_wide": read from L2 after the reduction)
    x_smem = x_smem_ok(plan, dt.width, has_residual, kn) and (
        not late_wb or bool(kn.get("x_smem_wide", False))
    )
    xs = X_SMEM | {k[2:]: v for k, v in kn.items() if k in ("x_ca", "x_w_regs", "x_min_blocks")}
    w_regs = False
    if x_smem:
        w_regs = bool(xs["w_regs"]) and not late_wb
        stage_wb = stage_wb and not w_regs
        min_blocks = int(xs["min_blocks"])
    # knob "x_rows": the x-through-shared-memory forward for that many rows a CTA,
    # the weight read from L2 once for all of them (``_xs_rows.xs_rows_kernel``)
    x_rows = int(kn.get("x_rows", 1)) if x_smem and not has_residual else 1
    if x_rows > 1:
        kernel_xr = xs_rows_kernel("rms", plan, dt, x_rows, bool(xs["ca"]))
    rcfg = _ring_cfg(dtype, n, has_weight, has_bias, has_residual, weight_dtype, kn)
    if rcfg is not None:
        from ._norm_fwd import ring_kernel, ring_launch_kwargs, ring_plan

        rplan = ring_plan(n, dtype, rcfg)
        ring = ring_kernel("rms", rplan, dt, wdt, rcfg)

    @cute.kernel
    def kernel(mX: cute.Tensor, mW, mB, mR, mY: cute.Tensor, mRo, mRstd: cute.Tensor, eps: Float32):
        tidx, bidx, cluster_y, m, smem, red, t = rr.start_rows(plan, dt, mX, stages=1)
        rX = t.load(t.part(mX))
        if const_expr(mR is not None):
            rR = t.load(t.part(mR))
        sW = None
        sB = None
        if const_expr(stage_wb):
            # weight / bias: cp.async into shared memory, read after the reduction
            sW, sB = t.stage_bcast(smem, wdt, mW, mB)
        elif const_expr(not late_wb):
            if const_expr(mW is not None):
                rW = t.load_bcast(t.part_bcast(mW))
            if const_expr(mB is not None):
                rB = t.load_bcast(t.part_bcast(mB))
        h = rX.load().to(Float32)
        if const_expr(mR is not None):
            h = h + rR.load().to(Float32)
            if const_expr(dt.width < 32):
                # normalize the stored residual (x's dtype): the backward differentiates at
                # it with this rstd, so forward and backward describe one function (at small
                # N, where |h|^2 ~ eps, dx is ill-conditioned in h)
                h = h.to(dt).to(Float32)
            t.store(h, t.part(mRo))
        red.wait_cluster()
        ss = red.reduce((h * h).reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0), "sum", 0)
        rstd = cute.math.rsqrt(ss * (1.0 / plan.n) + eps, fastmath=True)
        if const_expr(stage_wb):
            t.store_affine_smem(h * rstd, t.part(mY), sW, sB, mW, mB)
        elif const_expr(late_wb):
            t.store_affine(
                h * rstd,
                t.part(mY),
                t.part_bcast(mW) if const_expr(mW is not None) else None,
                t.part_bcast(mB) if const_expr(mB is not None) else None,
            )
        else:
            y = h * rstd
            if const_expr(mW is not None):
                y = y * rW.load().to(Float32)
            if const_expr(mB is not None):
                y = y + rB.load().to(Float32)
            t.store(y, t.part(mY))
        t.write_row_scalar(mRstd, rstd)

    @cute.kernel
    def kernel_xs(mX: cute.Tensor, mW, mB, mY: cute.Tensor, mRstd: cute.Tensor, eps: Float32):
        # x through shared memory (``x_smem_ok``): not live in registers across the reduction
        tidx, bidx, cluster_y, m, smem, red, t = rr.start_rows(plan, dt, mX, stages=1)
        sX = smem.allocate_tensor(
            dt, cute.make_ordered_layout(rr.tiler(plan), order=(1, 0)), byte_alignment=128
        )
        tc = cute.make_tiled_copy_tv(
            rr.cp_async_atom(dt, plan.vec * dt.width, bypass_l1=not xs["ca"]),
            cute.make_ordered_layout((plan.rows_per_cta, plan.threads_per_row), order=(1, 0)),
            cute.make_layout((1, plan.vec)),
        )
        thr = tc.get_slice(tidx)
        if t.row < m:
            cute.copy(tc, thr.partition_S(cute.local_tile(mX, rr.tiler(plan), t.coord)), thr.partition_D(sX))
        cute.arch.cp_async_commit_group()
        sW = None
        sB = None
        if const_expr(w_regs):
            if const_expr(mW is not None):
                rW = t.load_bcast(t.part_bcast(mW))
            if const_expr(mB is not None):
                rB = t.load_bcast(t.part_bcast(mB))
        elif const_expr(stage_wb):
            sW, sB = t.stage_bcast(smem, wdt, mW, mB)
        # x's group only (a staged weight's group may still be in flight)
        cute.arch.cp_async_wait_group(1 if const_expr(stage_wb) else 0)
        tX = t.thr.partition_S(sX)
        h = tX.load().to(Float32)
        sst = (h * h).reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
        # after the thread's partial sum: ptxas keeps values live across the cluster wait
        # (the row in fp32 here: 104 registers instead of 58)
        red.wait_cluster()
        ss = red.reduce(sst, "sum", 0)
        rstd = cute.math.rsqrt(ss * (1.0 / plan.n) + eps, fastmath=True)
        t.write_row_scalar(mRstd, rstd)
        y = tX.load().to(Float32) * rstd
        if const_expr(w_regs):
            if const_expr(mW is not None):
                y = y * rW.load().to(Float32)
            if const_expr(mB is not None):
                y = y + rB.load().to(Float32)
            t.store(y, t.part(mY))
        elif const_expr(stage_wb):
            t.store_affine_smem(y, t.part(mY), sW, sB, mW, mB)
        else:
            t.store_affine(
                y,
                t.part(mY),
                t.part_bcast(mW) if const_expr(mW is not None) else None,
                t.part_bcast(mB) if const_expr(mB is not None) else None,
            )

    @cute.jit
    def launch(
        mX: cute.Tensor,
        mW,
        mB,
        mR,
        mY: cute.Tensor,
        mRo,
        mRstd: cute.Tensor,
        eps: Float32,
        num_blocks: Int32,
        stream,
    ):
        m = cute.size(mX, mode=[0])
        if const_expr(rcfg is not None):
            kw = ring_launch_kwargs(rplan, m, stream, num_blocks, rcfg)
            ring(mX, mW, mB, mY, None, mRstd, eps).launch(**kw)
        elif const_expr(x_rows > 1):
            kernel_xr(mX, mW, mB, mY, None, mRstd, eps).launch(
                **xs_rows_launch_kwargs(plan, m, stream, x_rows, min_blocks)
            )
        elif const_expr(x_smem):
            kernel_xs(mX, mW, mB, mY, mRstd, eps).launch(
                **rr.launch_kwargs(plan, m, stream, min_blocks=min_blocks)
            )
        else:
            kernel(mX, mW, mB, mR, mY, mRo, mRstd, eps).launch(
                **rr.launch_kwargs(plan, m, stream, min_blocks=min_blocks)
            )

    x, m = rr.fake_rows(dt, n, plan.vec)
    y, _ = rr.fake_rows(dt, n, plan.vec, m)
    w = rr.fake_vec(wdt, n) if has_weight else None
    b = rr.fake_vec(wdt, n) if has_bias else None
    r = rr.fake_rows(dt, n, plan.vec, m)[0] if has_residual else None
    ro = rr.fake_rows(dt, n, plan.vec, m)[0] if has_residual else None
    rstd = rr.fake_vec(Float32, m, align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        launch, x, w, b, r, y, ro, rstd, Float32(1e-6), Int32(1), stream, options="--enable-tvm-ffi"
    )


# The row-tile forward with x through shared memory (the reference library's copy path at
# large N: cp.async, read twice): by the plan's cluster size, from X_SMEM_MIN_CLUSTER up;
# "ca": cp.async through L1 (.ca, as the
# reference) instead of .cg; "w_regs": the weight read into registers before the
# reduction (the reference's order) instead of cp.async'ed into shared memory;
# "min_blocks": CTAs per SM asked of ptxas. RmsNormFwdConfig overrides: "x_smem", "x_ca",
# "x_w_regs", "x_min_blocks", "x_smem_min_cluster".
X_SMEM_MIN_CLUSTER = 8
X_SMEM = {"ca": False, "w_regs": True, "min_blocks": 4}


def x_smem_ok(plan, width: int, has_residual: bool, tune: dict) -> bool:
    """The row-tile forward stages x in shared memory (16-bit rows, one row a CTA over a
    cluster of ``X_SMEM_MIN_CLUSTER`` CTAs or more, even tiling, 16-byte vectors, no
    residual; measured only so: fp32 rows would need 64 KiB a CTA, 3 CTAs / SM). The
    caller also leaves out weights wider than the rows (read element-wise from L2) unless
    its knobs say otherwise. ``tune``: the forward's knobs (``RmsNormFwdConfig.knobs()``)."""
    on = tune.get("x_smem", plan.cluster_n >= tune.get("x_smem_min_cluster", X_SMEM_MIN_CLUSTER))
    return bool(on) and (
        width == 16
        and plan.cluster_n > 1
        and plan.rows_per_cta == 1
        and plan.even
        and plan.vec * width == 128
        and not has_residual
    )


def fwd_ring_cfg(
    dtype: str, n: int, has_weight: bool, has_bias: bool, has_residual: bool, weight_dtype: str, config
):
    """The persistent, cp.async-pipelined forward (``quack_kernels._norm_fwd``) for rows
    over clusters of ``RING_MIN_CLUSTER`` (4) CTAs or more (N >= 65536 for 16-bit dtypes)
    with a weight wider than the rows and no residual, or None (one row tile per CTA);
    knobs: the forward's ``config`` (``ring_cfg``)."""
    return _ring_cfg(dtype, n, has_weight, has_bias, has_residual, weight_dtype, config.knobs())


def fwd_config(dtype: str, n: int, has_weight: bool, has_bias: bool, has_residual: bool, weight_dtype: str):
    """The configuration a call with these parameters compiles (the table's, by the
    process's arch and GPU): the launch grid must follow the same one."""
    spec = compile_rmsnorm_fwd.spec
    args = (dtype, n, has_weight, has_bias, has_residual, weight_dtype)
    return _tuning.derived_config(spec, args)


def _ring_cfg(dtype, n, has_weight, has_bias, has_residual, weight_dtype, kn: dict):
    from ._norm_fwd import ring_cfg

    return ring_cfg("rms", dtype, n, has_weight, has_bias, has_residual, weight_dtype, kn)


# The forward's measured knob sets (x through shared memory, two rows a CTA, for a weight
# wider than the rows at clusters of 4; the pipelined ring over clusters of 8 CTAs of 512
# threads at N = 262144) are rows of kernels/tuned/sm_90a.toml, by
# ``fwd_class``; ``search_space`` lists them as candidates (docs/kernels.md, docs/tuning.md).


def fwd_grid(m: int, dtype: str, n: int, rcfg, device) -> int:
    """CTAs (per cluster rank) of the ring forward (1, ignored, without one)."""
    from ._norm_fwd import ring_grid

    return ring_grid(m, dtype, n, rcfg, device)


# --------------------------------------------------------------------------- backward


def bwd_class(params: dict) -> str | None:
    """The backward's tuning-table class: the row-length class (``_plan.size_class``)."""
    return size_class(params["dtype"], params["n"])


def bwd_search_space(params: dict) -> list[NormBwdConfig]:
    """``quack tune``'s backward candidates (``_norm_bwd.search_space``, shared with
    LayerNorm's backward)."""
    from ._norm_bwd import search_space

    return search_space("rms", params)


@jit_cache(
    "rmsnorm_bwd",
    params={
        "dtype": Dtype(),
        "n": Int(min=N_MIN, max=N_MAX),
        "has_weight": Bool(),
        "has_bias": Bool(),
        "weight_dtype": WeightDtype(),
        "config": Config(NormBwdConfig, derive=_tuning.derive("rmsnorm_bwd", NormBwdConfig, bwd_class)),
    },
    reference=f"{__package__}._verify:verify_rmsnorm_bwd",
    search_space=bwd_search_space,
    bench=f"{__package__}._verify:bench_rmsnorm_bwd",
)
def compile_rmsnorm_bwd(
    dtype: str,
    n: int,
    has_weight: bool = True,
    has_bias: bool = False,
    weight_dtype: str = "same",
    config: NormBwdConfig | None = None,
):
    """Compile RMSNorm backward (persistent; ``quack_kernels._norm_bwd``). Runtime signature:
    fn(x, w|None, dy, None, rstd, dx, dw_partial|None, db_partial|None, num_blocks) where
    the partials are (num_blocks * rows_per_cta, n) fp32, summed by the caller;
    ``has_bias`` adds db = sum_rows(dy)."""
    from ._norm_bwd import compile_norm_bwd

    return compile_norm_bwd("rms", dtype, n, has_weight, has_bias, weight_dtype, config.knobs())  # type: ignore[union-attr]


def bwd_smem_stages(plan, width: int, config: NormBwdConfig) -> int:
    """Pipeline depth of the shared-memory backward (``quack_kernels._norm_bwd``) under
    ``config``."""
    from ._norm_bwd import bwd_smem_stages as stages

    return stages(plan, width, config.knobs())


def _bwd_grid(m: int, plan, width: int, device, config: NormBwdConfig) -> int:
    from ._norm_bwd import bwd_grid

    return bwd_grid(m, plan, width, device, config.knobs())


# --------------------------------------------------------------------------- torch-facing


def _eps(eps):
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    return float(eps)


def rmsnorm_fwd(x, weight=None, bias=None, residual=None, eps: float = 1e-6):
    """RMSNorm over the last dim. Returns ``(y, rstd, residual_out)``: y like x,
    rstd float32 of shape x.shape[:-1], residual_out = x + residual in x's dtype (None without
    residual); y and rstd normalize that stored, rounded residual_out (the backward's input).
    weight / bias may have another float dtype than x (e.g. fp32 with bf16 x)."""
    import torch

    from . import _torch as kt

    x2 = kt.rows(x, "x")
    m, n = x2.shape
    dt = kt.dtype_name(x2, "x")
    w, b, wdt = kt.affine(weight, bias, n, x)
    r2 = kt.like_rows(residual, "residual", x) if residual is not None else None
    eps = _eps(eps)
    y = torch.empty_like(x2)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    ro = torch.empty_like(x2) if r2 is not None else None
    if m > 0:
        args = (dt, n, w is not None, b is not None, r2 is not None, wdt)
        cfg = fwd_config(*args)
        fn = compile_rmsnorm_fwd(*args, cfg)
        rcfg = fwd_ring_cfg(*args, cfg)
        grid = fwd_grid(m, dt, n, rcfg, x.device)
        fn(x2, w, b, r2, y, ro, rstd, eps, grid)
    shape = x.shape
    return (y.view(shape), rstd.view(shape[:-1]), ro.view(shape) if ro is not None else None)


def rmsnorm_bwd(x, weight, dy, rstd, bias=None):
    """Gradients of y = RMSNorm(x) * weight (+ bias). ``x`` is the normalized input (x +
    residual when a residual was added), rstd from the forward. Returns ``(dx, dweight)``,
    or ``(dx, dweight, dbias)`` when ``bias`` is given (only its dtype is used); dweight /
    dbias in the weight's / bias's dtype (None when absent), summed in fp32."""
    from ._norm_bwd import run_norm_bwd

    def compile_fn(dt, n, has_w, has_b, wdt):
        cfg = _tuning.derived_config(compile_rmsnorm_bwd.spec, (dt, n, has_w, has_b, wdt))
        return compile_rmsnorm_bwd(dt, n, has_w, has_b, wdt, cfg), cfg.knobs()

    dx, dw, db = run_norm_bwd(
        "rms", compile_fn, x, weight, dy, None, rstd, bias.dtype if bias is not None else None
    )
    return (dx, dw) if bias is None else (dx, dw, db)
