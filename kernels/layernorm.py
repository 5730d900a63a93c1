"""LayerNorm forward and backward in CuTe DSL.

mean = mean(x);  rstd = 1 / sqrt(mean((x - mean)^2) + eps);  y = (x - mean) * rstd * w + b
(two-pass variance over the row kept in registers; fp32 math). The backward (dx, dw, db)
is the persistent norm backward of ``quack_kernels._norm_bwd``.

Top level imports only quack: torch and cutlass are imported inside functions.
"""

import functools

from quack import jit_cache
from quack.params import Bool, Config, Dtype, Int

from . import _tuning
from ._configs import LayerNormFwdConfig, NormBwdConfig
from ._ln_row import fits, fwd_class
from ._plan import N_MAX, N_MIN, WIDTHS, WeightDtype, size_class


def _derive_fwd(params: dict, arch: str) -> LayerNormFwdConfig:
    cfg = _tuning.default_config(
        "layernorm_fwd", LayerNormFwdConfig, fwd_class(params), params["dtype"], params["n"], arch
    )
    return cfg if fits(params["n"], WIDTHS[params["dtype"]], cfg.knobs()) else LayerNormFwdConfig()


_derive_fwd.classify = fwd_class  # type: ignore[attr-defined]  # quack tune: a winner's row class
_tuning.declare_classes("layernorm_fwd", r"(same|wide)/(cta256|cluster\d+|rows)")  # fwd_class's names
_derive_fwd.check_rows = functools.partial(_tuning.check_rows, kernel="layernorm_fwd")  # type: ignore[attr-defined]
_derive_fwd.table_path = _tuning.table_path  # type: ignore[attr-defined]


def search_space(params: dict) -> list[LayerNormFwdConfig]:
    """``quack tune``'s forward candidates: the heuristic and the measured variants for the
    problem's plan class (``_ln_row.fwd_class``; docs/kernels.md)."""
    C = LayerNormFwdConfig
    cls = fwd_class(params) or ""
    cands = [C()]
    if cls.endswith("/cta256"):
        # the ring is only ever on for a wider weight: ``ring=False`` elsewhere would be
        # the same kernel under another key
        off = False if cls.startswith("wide") else None
        for mb in (3, 4):
            cands.append(C(x_smem=True, threads=512, x_min_blocks=mb, ring=off))
        cands.append(C(x_smem=True, x_rows=2, x_min_blocks=3, wb_ahead=2, ring=False))
        cands.append(C(x_smem=True, x_rows=4, x_min_blocks=1, wb_ahead=4, threads=512, ring=False))
    elif "/cluster" in cls:
        xs = dict(ring=False, stage_wb=False, x_smem=True, x_smem_cluster=True)
        cands.append(C(**xs, x_min_blocks=3))
        cands.append(C(**xs, x_rows=2, x_min_blocks=3))
        cands.append(C(**{**xs, "ring": True}, ring_pipe=True, x_min_blocks=3, stages=4))
        cands.append(
            C(**{**xs, "ring": True}, ring_pipe=True, x_rows=2, x_min_blocks=3, ring_wregs="b", stages=3)
        )
    elif cls.endswith("/rows"):
        cands.append(
            C(ring=False, stage_wb=False, row_budget=32, x_smem=True, x_rows=4, x_min_blocks=3, wb_ahead=4)
        )
    return [c for c in cands if fits(params["n"], WIDTHS[params["dtype"]], c.knobs())]


@jit_cache(
    "layernorm_fwd",
    params={
        "dtype": Dtype(),
        "n": Int(min=N_MIN, max=N_MAX),
        "has_weight": Bool(),
        "has_bias": Bool(),
        "weight_dtype": WeightDtype(),
        "config": Config(LayerNormFwdConfig, derive=_derive_fwd),
    },
    reference=f"{__package__}._verify:verify_layernorm_fwd",
    search_space=search_space,
    bench=f"{__package__}._verify:bench_layernorm_fwd",
)
def compile_layernorm_fwd(
    dtype: str,
    n: int,
    has_weight: bool = True,
    has_bias: bool = True,
    weight_dtype: str = "same",
    config: LayerNormFwdConfig | None = None,
):
    """Runtime signature: fn(x, w|None, b|None, y, mean, rstd, eps, num_blocks); w / b of
    ``weight_dtype`` ("same": ``dtype``); num_blocks is the grid of the persistent ring
    forward (``fwd_grid``; ignored by the one-row-tile-per-CTA launch)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, const_expr

    from . import _rowreduce as rr
    from ._ln_row import X_MIN_BLOCKS, affine_vec, row_plan, x_smem_ok, xs_kernel
    from ._plan import resolve_weight_dtype, smem_bcast_ok
    from ._xs_rows import xs_rows_kernel, xs_rows_launch_kwargs

    dt = rr.cutlass_dtype(dtype)
    wdt = rr.cutlass_dtype(resolve_weight_dtype(dtype, weight_dtype))
    kn = config.knobs()  # type: ignore[union-attr]  # derived by bind (_tuning)
    plan = row_plan(n, dt.width, kn)
    stage_wb = kn.get("stage_wb", True) and smem_bcast_ok(plan, wdt.width, int(has_weight) + int(has_bias))
    min_blocks = kn.get("min_blocks", 0) if stage_wb else kn.get("rt_min_blocks", 0)
    # x through shared memory (``_ln_row``): the row is not live in registers across the
    # reduction
    x_smem = x_smem_ok(plan, dt.width, kn) and not stage_wb
    x_rows = int(kn.get("x_rows", 1)) if x_smem else 1
    if x_smem:
        min_blocks = int(kn.get("x_min_blocks", X_MIN_BLOCKS))
        kernel_xs = xs_kernel(plan, dt, bool(kn.get("x_ca", False)))
        if x_rows > 1:
            # knob "x_rows": that many rows a CTA, w / b read once for all of them
            kernel_xs = xs_rows_kernel(
                "layer", plan, dt, x_rows, bool(kn.get("x_ca", False)), int(kn.get("wb_ahead", 0))
            )
    wb_vec = bool(kn.get("wb_vec", False)) and plan.even and plan.rows_per_cta == 1 and not stage_wb
    rcfg = _ring_cfg(dtype, n, has_weight, has_bias, weight_dtype, kn)
    if rcfg is not None:
        from ._norm_fwd import ring_kernel, ring_launch_kwargs, ring_plan

        rplan = ring_plan(n, dtype, rcfg)
        ring = ring_kernel("layer", rplan, dt, wdt, rcfg)

    @cute.kernel
    def kernel(
        mX: cute.Tensor, mW, mB, mY: cute.Tensor, mMean: cute.Tensor, mRstd: cute.Tensor, eps: Float32
    ):
        tidx, bidx, cluster_y, m, smem, red, t = rr.start_rows(plan, dt, mX, stages=2)
        x = t.load(t.part(mX)).load().to(Float32)
        sW = None
        sB = None
        if const_expr(stage_wb):
            # weight / bias: cp.async into shared memory now, read after the reduction
            sW, sB = t.stage_bcast(smem, wdt, mW, mB)
        red.wait_cluster()
        if const_expr(plan.even):
            # One round trip: per-thread (mean, M2) of its elements (exact two-pass in
            # registers), merged over the row with Chan's formula (equal counts).
            e = const_expr(plan.elems_per_thread)
            mt = x.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0) * (1.0 / e)
            dt_ = x - mt
            m2t = (dt_ * dt_).reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
            mean, m2 = red.reduce_pair(mt, m2t, "welford", count=e)
            var = m2 * (1.0 / plan.n)
            xc = x - mean
        else:
            mean = red.reduce(x.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0), "sum", 0) * (
                1.0 / plan.n
            )
            xc = x - mean
            sq = xc * xc
            # columns past N were loaded as 0 and now hold -mean: mask them out
            sq = t.mask_cols(sq)
            var = red.reduce(sq.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0), "sum", 1) * (
                1.0 / plan.n
            )
        rstd = cute.math.rsqrt(var + eps, fastmath=True)
        if const_expr(wb_vec):
            # w / b loaded and y stored one vector at a time (``_ln_row.affine_vec``)
            xf = cute.make_rmem_tensor(x.shape, Float32)
            xf.store(x)
            affine_vec(xf, mean, rstd, t, mW, mB, mY)
        elif const_expr(stage_wb):
            t.store_affine_smem(xc * rstd, t.part(mY), sW, sB, mW, mB)
        elif const_expr(wdt.width > dt.width):
            # a weight wider than the rows (fp32 beside 16-bit x): element-wise, one
            # vector at a time (the rows keep their 16-byte accesses)
            t.store_affine(
                xc * rstd,
                t.part(mY),
                t.part_bcast(mW) if const_expr(mW is not None) else None,
                t.part_bcast(mB) if const_expr(mB is not None) else None,
            )
        else:
            # weight / bias loaded after the reductions (L2-resident, shared by all rows):
            # fewer live registers while the row is reduced.
            if const_expr(mW is not None):
                rW = t.load_bcast(t.part_bcast(mW))
            if const_expr(mB is not None):
                rB = t.load_bcast(t.part_bcast(mB))
            y = xc * rstd
            if const_expr(mW is not None):
                y = y * rW.load().to(Float32)
            if const_expr(mB is not None):
                y = y + rB.load().to(Float32)
            t.store(y, t.part(mY))
        t.write_row_scalar(mMean, mean)
        t.write_row_scalar(mRstd, rstd)

    @cute.jit
    def launch(
        mX: cute.Tensor,
        mW,
        mB,
        mY: cute.Tensor,
        mMean: cute.Tensor,
        mRstd: cute.Tensor,
        eps: Float32,
        num_blocks: Int32,
        stream,
    ):
        m = cute.size(mX, mode=[0])
        if const_expr(rcfg is not None):
            kw = ring_launch_kwargs(rplan, m, stream, num_blocks, rcfg)
            ring(mX, mW, mB, mY, mMean, mRstd, eps).launch(**kw)
        elif const_expr(x_rows > 1):
            kernel_xs(mX, mW, mB, mY, mMean, mRstd, eps).launch(
                **xs_rows_launch_kwargs(plan, m, stream, x_rows, min_blocks)
            )
        elif const_expr(x_smem):
            kernel_xs(mX, mW, mB, mY, mMean, mRstd, eps).launch(
                **rr.launch_kwargs(plan, m, stream, min_blocks=min_blocks)
            )
        else:
            kernel(mX, mW, mB, mY, mMean, mRstd, eps).launch(
                **rr.launch_kwargs(plan, m, stream, min_blocks=min_blocks)
            )

    x, m = rr.fake_rows(dt, n, plan.vec)
    y, _ = rr.fake_rows(dt, n, plan.vec, m)
    w = rr.fake_vec(wdt, n) if has_weight else None
    b = rr.fake_vec(wdt, n) if has_bias else None
    mean = rr.fake_vec(Float32, m, align=4)
    rstd = rr.fake_vec(Float32, m, align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        launch, x, w, b, y, mean, rstd, Float32(1e-5), Int32(1), stream, options="--enable-tvm-ffi"
    )


def fwd_ring_cfg(dtype: str, n: int, has_weight: bool, has_bias: bool, weight_dtype: str, config):
    """The persistent, cp.async-pipelined forward (``quack_kernels._norm_fwd``) for rows
    over clusters of ``RING_MIN_CLUSTER`` (4) CTAs or more with a weight / bias, or None
    (one row tile per CTA); knobs: the forward's ``config`` (``ring_cfg``)."""
    return _ring_cfg(dtype, n, has_weight, has_bias, weight_dtype, config.knobs())


def fwd_config(dtype: str, n: int, has_weight: bool, has_bias: bool, weight_dtype: str):
    """The configuration a call with these parameters compiles (the launch grid follows it)."""
    args = (dtype, n, has_weight, has_bias, weight_dtype)
    return _tuning.derived_config(compile_layernorm_fwd.spec, args)


def _ring_cfg(dtype: str, n: int, has_weight: bool, has_bias: bool, weight_dtype: str, kn: dict):
    from ._norm_fwd import ring_cfg

    return ring_cfg("layer", dtype, n, has_weight, has_bias, False, weight_dtype, kn)


def fwd_grid(m: int, dtype: str, n: int, rcfg, device) -> int:
    """CTAs (per cluster rank) of the ring forward (1, ignored, without one)."""
    from ._norm_fwd import ring_grid

    return ring_grid(m, dtype, n, rcfg, device)


def bwd_search_space(params: dict) -> list[NormBwdConfig]:
    """``quack tune``'s backward candidates (``_norm_bwd.search_space``, shared with
    RMSNorm's backward)."""
    from ._norm_bwd import search_space

    return search_space("layer", params)


@jit_cache(
    "layernorm_bwd",
    params={
        "dtype": Dtype(),
        "n": Int(min=N_MIN, max=N_MAX),
        "has_weight": Bool(),
        "has_bias": Bool(),
        "weight_dtype": WeightDtype(),
        "config": Config(
            NormBwdConfig,
            derive=_tuning.derive(
                "layernorm_bwd",
                NormBwdConfig,
                lambda p: size_class(p["dtype"], p["n"]),
                classes=_tuning.SIZE_CLASSES,
            ),
        ),
    },
    reference=f"{__package__}._verify:verify_layernorm_bwd",
    search_space=bwd_search_space,
    bench=f"{__package__}._verify:bench_layernorm_bwd",
)
def compile_layernorm_bwd(
    dtype: str,
    n: int,
    has_weight: bool = True,
    has_bias: bool = True,
    weight_dtype: str = "same",
    config: NormBwdConfig | None = None,
):
    """Compile LayerNorm backward (persistent, like RMSNorm's; ``quack_kernels._norm_bwd``).
    Runtime signature: fn(x, w|None, dy, mean, rstd, dx, dw_partial|None, db_partial|None,
    num_blocks), partials (num_blocks * rows_per_cta, n) fp32 summed by the caller."""
    from ._norm_bwd import compile_norm_bwd

    return compile_norm_bwd("layer", dtype, n, has_weight, has_bias, weight_dtype, config.knobs())  # type: ignore[union-attr]


def layernorm_fwd(x, weight=None, bias=None, eps: float = 1e-5):
    """LayerNorm over the last dim. Returns ``(y, mean, rstd)`` (mean, rstd float32,
    shape x.shape[:-1]). weight / bias may have another float dtype than x."""
    import torch

    from . import _torch as kt

    x2 = kt.rows(x, "x")
    m, n = x2.shape
    w, b, wdt = kt.affine(weight, bias, n, x)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    y = torch.empty_like(x2)
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m > 0:
        dt = kt.dtype_name(x2, "x")
        args = (dt, n, w is not None, b is not None, wdt)
        cfg = fwd_config(*args)
        fn = compile_layernorm_fwd(*args, cfg)
        grid = fwd_grid(m, dt, n, fwd_ring_cfg(*args, cfg), x.device)
        fn(x2, w, b, y, mean, rstd, float(eps), grid)
    return y.view(x.shape), mean.view(x.shape[:-1]), rstd.view(x.shape[:-1])


def layernorm_bwd(x, weight, dy, mean, rstd, bias=None):
    """Gradients of y = LayerNorm(x) * weight + bias, given mean / rstd of the forward.
    Returns ``(dx, dweight, dbias)``: dweight None without weight, dbias None without
    ``bias`` (only its dtype is used); dweight / dbias in the weight's / bias's dtype,
    summed in fp32."""
    from ._norm_bwd import run_norm_bwd

    def compile_fn(dt, n, has_w, has_b, wdt):
        cfg = _tuning.derived_config(compile_layernorm_bwd.spec, (dt, n, has_w, has_b, wdt))
        return compile_layernorm_bwd(dt, n, has_w, has_b, wdt, cfg), cfg.knobs()

    return run_norm_bwd(
        "layer", compile_fn, x, weight, dy, mean, rstd, bias.dtype if bias is not None else None
    )
