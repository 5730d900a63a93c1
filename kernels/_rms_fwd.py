"""The RMSNorm forward's row-tile kernels (CuTe DSL; the math: ``rmsnorm``'s docstring):
one row tile a CTA with x in registers, or x through shared memory (``x_smem_ok``; several
rows a CTA: ``_xs_rows``), and the launch that picks between them and the persistent ring
forward (``_norm_fwd``) by the configuration's knobs. ``rmsnorm.compile_rmsnorm_fwd`` calls
``compile_rms_fwd`` with them. Plain Python at the top level; cutlass is imported inside
``compile_rms_fwd``.
"""

from ._plan import plan_rows, resolve_weight_dtype

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


def compile_rms_fwd(
    dtype: str, n: int, has_weight: bool, has_bias: bool, has_residual: bool, weight_dtype: str, kn: dict
):
    """``rmsnorm.compile_rmsnorm_fwd`` under the forward's knobs ``kn``."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, const_expr

    from . import _rowreduce as rr
    from ._norm_fwd import ring_cfg
    from ._plan import smem_bcast_ok
    from ._xs_rows import xs_rows_kernel, xs_rows_launch_kwargs

    dt = rr.cutlass_dtype(dtype)
    wdt = rr.cutlass_dtype(resolve_weight_dtype(dtype, weight_dtype))
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
    rcfg = ring_cfg("rms", dtype, n, has_weight, has_bias, has_residual, weight_dtype, kn)
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
