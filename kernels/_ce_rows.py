"""The register-path cross-entropy kernels (CuTe DSL; the math: ``cross_entropy``'s
docstring): the forward, one row's logits in registers (or staged through shared memory,
``fwd_smem``), reduced to (lse, loss) and with label smoothing sum_c x_c (* w_c); and the
backward, dlogits = a * softmax(x) - b * onehot(target) - c * w. ``cross_entropy``'s
registered compile functions call these with the configuration's knobs; the large-N
streaming forward is ``_ce_stream``. Imported only from inside compile functions.
"""

import math

from ._ce_stream import LN_2, LOG2_E


def compile_fwd_rows(dtype: str, n: int, smoothing: str, k: dict):
    """The register-path forward of ``compile_cross_entropy_fwd`` under knobs ``k``."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64, const_expr

    from . import _rowreduce as rr
    from ._plan import io_width, plan_rows

    dt = rr.cutlass_dtype(dtype)
    smooth = smoothing != "none"
    weighted = smoothing == "weighted"
    plan = plan_rows(n, io_width(dtype, "float32" if weighted else None), budget=64)
    min_blocks = k.get("min_blocks", 0) if plan.cluster_n > 1 else 0
    # Variant (with stream=False): the logits tile
    # cp.async'ed into shared memory, the target logit read while it is in flight.
    smem_x = k.get("fwd_smem", False) and plan.even and plan.vec * dt.width == 128

    @cute.kernel
    def kernel(
        mX: cute.Tensor, mT: cute.Tensor, mLoss: cute.Tensor, mLse: cute.Tensor, ignore_index: Int32, mW, mSx
    ):
        tidx, bidx, cluster_y, m, smem, red, t = rr.start_rows(plan, dt, mX, stages=3)
        if const_expr(smem_x):
            (sX,) = t.stage_rows(smem, mX)
        else:
            x = t.load(t.part(mX), fill=-math.inf).load().to(Float32)
        # The target logit: one scalar load per row, by the row's first thread of rank 0.
        tgt = Int64(ignore_index)
        xt = Float32(0.0)
        lead = (tidx % plan.threads_per_row) == 0
        if const_expr(plan.cluster_n > 1):
            lead = lead and cluster_y == 0
        if t.row < m:
            if lead:
                tgt = Int64(mT[t.row])
                if tgt != Int64(ignore_index):
                    if tgt >= 0 and tgt < n:
                        xt = Float32(mX[t.row, Int32(tgt)])
        if const_expr(smem_x):
            t.wait_rows()
            x = sX.load().to(Float32)
        red.wait_cluster()
        # Online softmax: each thread's (max, sum exp(x - max)), merged over the row in
        # one all-reduce round trip.
        mloc = x.reduce(cute.ReductionOp.MAX, init_val=-Float32.inf, reduction_profile=0)
        msafe = mloc
        if mloc == -Float32.inf:
            msafe = Float32(0.0)
        sloc = cute.math.exp2(x * LOG2_E - msafe * LOG2_E, fastmath=True).reduce(
            cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0
        )
        mx, s = red.reduce_pair(mloc, sloc, "lse")
        lse = mx + cute.math.log2(s, fastmath=True) * LN_2
        if const_expr(smooth):
            # sum_c x_c (* w_c): columns past N were loaded as -inf, weights past N as 0
            xs = x
            if const_expr(not plan.even):
                xs = t.mask_cols(x)
            if const_expr(weighted):
                xs = xs * t.load_bcast(t.part_bcast(mW)).load()
            sx = red.reduce(xs.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0), "sum", 2)
            t.write_row_scalar(mSx, sx)
        if t.row < m:
            if lead:
                mLse[t.row] = lse
                loss = Float32(0.0)
                if tgt != Int64(ignore_index):
                    loss = lse - xt
                mLoss[t.row] = loss

    x, m = rr.fake_rows(dt, n, plan.vec)
    tg = rr.fake_vec(Int64, m, align=8)
    loss = rr.fake_vec(Float32, m, align=4)
    lse = rr.fake_vec(Float32, m, align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    if smooth:

        @cute.jit
        def launch_smooth(
            mX: cute.Tensor,
            mT: cute.Tensor,
            mLoss: cute.Tensor,
            mLse: cute.Tensor,
            ignore_index: Int32,
            mW,
            mSx: cute.Tensor,
            stream,
        ):
            kernel(mX, mT, mLoss, mLse, ignore_index, mW, mSx).launch(
                **rr.launch_kwargs(plan, cute.size(mX, mode=[0]), stream, min_blocks=min_blocks)
            )

        w = rr.fake_vec(Float32, n) if weighted else None
        sx = rr.fake_vec(Float32, m, align=4)
        return cute.compile(
            launch_smooth, x, tg, loss, lse, Int32(-100), w, sx, stream, options="--enable-tvm-ffi"
        )

    @cute.jit
    def launch(
        mX: cute.Tensor, mT: cute.Tensor, mLoss: cute.Tensor, mLse: cute.Tensor, ignore_index: Int32, stream
    ):
        kernel(mX, mT, mLoss, mLse, ignore_index, None, None).launch(
            **rr.launch_kwargs(plan, cute.size(mX, mode=[0]), stream, min_blocks=min_blocks)
        )

    return cute.compile(launch, x, tg, loss, lse, Int32(-100), stream, options="--enable-tvm-ffi")


def compile_bwd_rows(dtype: str, n: int, smoothing: str, k: dict):
    """``compile_cross_entropy_bwd`` under knobs ``k``."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64, const_expr

    from . import _rowreduce as rr
    from ._plan import io_width, plan_rows

    dt = rr.cutlass_dtype(dtype)
    smooth = smoothing != "none"
    weighted = smoothing == "weighted"
    # No reduction in the backward (lse is given): a row may span several CTAs without a
    # cluster; the element budget per thread sets registers, hence occupancy. Measured on
    # the H200 (bf16, us for budget 64 / 32 / 16):
    # 4096: 145 / 134 / 141; 16384: 654 / 538 / 548; 65536: 2134 / 2174 / 2356;
    # 262144: 1100 / 1100 / 1101.
    width = io_width(dtype, "float32" if weighted else None)
    budget = 32 if n <= 32768 else 64
    plan = plan_rows(n, width, budget=k.get("bwd_budget", budget))

    # Variant: the CTA's logits tile cp.async'ed into shared
    # memory, the per-row scalars read while it is in flight, then read into registers (the
    # reference library's copy path); even 16-byte tilings only.
    smem_x = k.get("bwd_smem", False) and plan.even and plan.vec * dt.width == 128
    if k.get("bwd_smem", False) and not smem_x:
        # a default knob set measured with the shared-memory path, where it cannot apply
        # (an odd tiling, fp32 class weights' 8-byte vectors): the register path's budget
        # (a budget of 128 in registers would spill)
        k = {}
        plan = plan_rows(n, width, budget=budget)
    bwd_min_blocks = k.get("bwd_min_blocks", 0)

    def launch_kwargs(m, stream):
        kw = rr.launch_kwargs(plan, m, stream, min_blocks=bwd_min_blocks)
        kw["cluster"] = None
        return kw

    @cute.kernel
    def kernel(
        mX: cute.Tensor,
        mT: cute.Tensor,
        mdLoss: cute.Tensor,
        mLse: cute.Tensor,
        mdX: cute.Tensor,
        ignore_index: Int32,
        mB,
        mC,
        mW,
    ):
        tidx, bidx, cluster_y = rr.cta_coords(plan)
        m = cute.size(mX, mode=[0])
        t = rr.RowTiles(plan, dt, m, tidx, bidx, cluster_y)
        if const_expr(smem_x):
            (sX,) = t.stage_rows(cutlass.memory.SmemAllocator(), mX)
        else:
            x = t.load(t.part(mX)).load().to(Float32)
        tgt = Int32(-1)
        g = Float32(0.0)
        gb = Float32(0.0)
        gc = Float32(0.0)
        lse = Float32(0.0)
        if t.row < m:
            t64 = Int64(mT[t.row])
            if t64 != Int64(ignore_index):
                g = Float32(mdLoss[t.row])
                gb = g
                if const_expr(smooth):
                    gb = Float32(mB[t.row])
                    gc = Float32(mC[t.row])
                lse = Float32(mLse[t.row])
                tgt = Int32(t64)
        if const_expr(smem_x):
            t.wait_rows()
            x = sX.load().to(Float32)
        p = cute.math.exp2(x * LOG2_E - lse * LOG2_E, fastmath=True) * g
        if const_expr(weighted):
            p = p - t.load_bcast(t.part_bcast(mW)).load() * gc
        elif const_expr(smooth):
            p = p - gc
        r = cute.make_rmem_tensor(p.shape, Float32)
        r.store(p)
        for i in cutlass.range_constexpr(cute.size(r)):
            if t.tXcX[i][1] == tgt:
                r[i] = r[i] - gb
        t.store(r.load(), t.part(mdX))

    x, m = rr.fake_rows(dt, n, plan.vec)
    dx, _ = rr.fake_rows(dt, n, plan.vec, m)
    tg = rr.fake_vec(Int64, m, align=8)
    dloss = rr.fake_vec(Float32, m, align=4)
    lse = rr.fake_vec(Float32, m, align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    if smooth:

        @cute.jit
        def launch_smooth(
            mX: cute.Tensor,
            mT: cute.Tensor,
            mdLoss: cute.Tensor,
            mLse: cute.Tensor,
            mdX: cute.Tensor,
            ignore_index: Int32,
            mB: cute.Tensor,
            mC: cute.Tensor,
            mW,
            stream,
        ):
            kernel(mX, mT, mdLoss, mLse, mdX, ignore_index, mB, mC, mW).launch(
                **launch_kwargs(cute.size(mX, mode=[0]), stream)
            )

        b = rr.fake_vec(Float32, m, align=4)
        c = rr.fake_vec(Float32, m, align=4)
        w = rr.fake_vec(Float32, n) if weighted else None
        return cute.compile(
            launch_smooth, x, tg, dloss, lse, dx, Int32(-100), b, c, w, stream, options="--enable-tvm-ffi"
        )

    @cute.jit
    def launch(
        mX: cute.Tensor,
        mT: cute.Tensor,
        mdLoss: cute.Tensor,
        mLse: cute.Tensor,
        mdX: cute.Tensor,
        ignore_index: Int32,
        stream,
    ):
        kernel(mX, mT, mdLoss, mLse, mdX, ignore_index, None, None, None).launch(
            **launch_kwargs(cute.size(mX, mode=[0]), stream)
        )

    return cute.compile(launch, x, tg, dloss, lse, dx, Int32(-100), stream, options="--enable-tvm-ffi")
