"""The row-tile forward of RMSNorm and LayerNorm with x through shared memory for several rows
a CTA (knob "x_rows"; ``xs_rows_kernel``): the weight / bias read from L2 once for all
of a CTA's rows. Split from ``_norm_fwd`` (the persistent ring forward), which it shares nothing
with but the row plans.

Imported only from inside compile functions and torch wrappers (the kernel builder imports
cutlass inside).
"""


def xs_rows_kernel(kind: str, plan, dt, rows: int, ca: bool = False, wb_ahead: int = 0):
    """The row-tile forward with x through shared memory for ``rows`` rows a CTA (knob
    "x_rows"; 16-bit rows of one CTA or a cluster, even tiling, 16-byte vectors): x
    of each row cp.async'ed (one commit group a row), each row reduced in turn (its own
    reducer stage), then y written one vector at a time with the weight / bias vector read
    from L2 ONCE for all ``rows`` rows (16-byte loads), so that a weight wider than the rows
    (fp32) costs the SMs' L2 traffic of a same-width one. Grid: ceil(M / rows) CTAs (per
    cluster rank); ``rms_launch`` / the caller's launch. kernel(mX, mW, mB, mY, mMean|None,
    mRstd, eps); "layer": per-thread (mean, M2) one vector at a time (``_ln_row``), one
    welford all-reduce a row.

    ``wb_ahead`` (knob "wb_ahead", 0: off): the w / b vectors 0 .. wb_ahead-1 are
    loaded into registers right after x's cp.async is issued, and in the y loop the loads of
    vector k + wb_ahead go out before vector k's y stores. Without it each vector's w / b
    loads follow the previous vector's y stores in program order (stores that may alias
    them: neither LLVM nor ptxas moves a load above them), ``nvec`` dependent L2 round trips
    a CTA. Measured (docs/kernels.md): it loses on rows over 16 CTAs (LayerNorm fp32
    w + b 1307 -> 1352 us with 1 vector ahead, more with more); the 4096 rows' default
    (the table's "wide/rows" row) has it, and so do the one-CTA rows' (N = 10240 .. 16384,
    "wide/cta256": 2 vectors ahead, 14336 482 -> 461 us, 16384 531-541 -> 529)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, const_expr

    from . import _rowreduce as rr
    from ._ln_row import thread_welford

    layer = kind == "layer"
    assert plan.rows_per_cta == 1 and plan.even and plan.vec * dt.width == 128
    inv_n = 1.0 / plan.n

    @cute.kernel
    def kernel(mX: cute.Tensor, mW, mB, mY: cute.Tensor, mMean, mRstd: cute.Tensor, eps: Float32):
        tidx, bidx, cluster_y, m, smem, red, t0 = rr.start_rows(plan, dt, mX, stages=2 * rows)
        tc = rr.cp_async_tiled_copy(dt, plan, bypass_l1=not ca)
        thr = tc.get_slice(tidx)
        sl = cute.make_layout((1, plan.tile_n, rows), stride=(plan.tile_n, 1, plan.tile_n))
        sX = smem.allocate_tensor(dt, sl, byte_alignment=128)
        for r in cutlass.range_constexpr(rows):
            rt = bidx * rows + r
            if rt < m:
                cute.copy(
                    tc,
                    thr.partition_S(cute.local_tile(mX, rr.tiler(plan), (rt, cluster_y))),
                    thr.partition_D(sX[None, None, r]),
                )
            cute.arch.cp_async_commit_group()
        ahead = []  # (w, b) register vectors loaded ahead, by vector index
        if const_expr(wb_ahead > 0):
            gW, gB = _bcast_wb(t0, mW, mB)
            for k in cutlass.range_constexpr(min(wb_ahead, plan.nvec)):
                ahead.append(_load_wb(gW, gB, k))
        red.wait_cluster()
        rbuf, rmbar = red.buf, red.mbar
        tiles = [rr.RowTiles(plan, dt, m, tidx, bidx * rows + r, cluster_y) for r in range(rows)]
        means = []
        rstds = []
        for r in cutlass.range_constexpr(rows):
            t = tiles[r]
            cute.arch.cp_async_wait_group(rows - 1 - r)
            tX = t.thr.partition_S(sX[None, None, r])
            if const_expr(layer):
                mt, m2t = thread_welford(tX)
                mean, m2 = rr.row_allreduce_pair(
                    Float32(mt),
                    Float32(m2t),
                    "welford",
                    plan.threads_per_row,
                    plan.cluster_n,
                    plan.elems_per_thread,
                    rbuf[None, None, 2 * r] if const_expr(rbuf is not None) else None,
                    rbuf[None, None, 2 * r + 1] if const_expr(rbuf is not None) else None,
                    (rmbar + r) if const_expr(plan.cluster_n > 1) else None,
                    0,
                )
                rstd = cute.math.rsqrt(m2 * inv_n + eps, fastmath=True)
                t.write_row_scalar(mMean, mean)
                means.append(mean)
            else:
                h = tX.load().to(Float32)
                sst = (h * h).reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
                ss = rr.reduce_stage(sst, "sum", plan, rbuf, rmbar, r, 0)
                rstd = cute.math.rsqrt(ss * inv_n + eps, fastmath=True)
            t.write_row_scalar(mRstd, rstd)
            rstds.append(rstd)
        if const_expr(wb_ahead == 0):
            gW, gB = _bcast_wb(t0, mW, mB)
        for k in cutlass.range_constexpr(plan.nvec):
            if const_expr(wb_ahead > 0):
                # the loads of vector k + wb_ahead go out before this vector's y stores
                if const_expr(k + wb_ahead < plan.nvec):
                    ahead.append(_load_wb(gW, gB, k + wb_ahead))
                rw, rb = ahead[k]
            else:
                rw, rb = _load_wb(gW, gB, k)
            for r in cutlass.range_constexpr(rows):
                t = tiles[r]
                xk = t.thr.partition_S(sX[None, None, r])[None, 0, k].load().to(Float32)
                if const_expr(layer):
                    yk = (xk - means[r]) * rstds[r]
                else:
                    yk = xk * rstds[r]
                if const_expr(mW is not None):
                    yk = yk * rw.load().to(Float32)
                if const_expr(mB is not None):
                    yk = yk + rb.load().to(Float32)
                gY = t.part(mY)
                ry = cute.make_rmem_tensor_like(gY[None, 0, k])
                ry.store(yk.to(gY.element_type))
                if bidx * rows + r < m:
                    cute.autovec_copy(ry, gY[None, 0, k])

    return kernel


def _bcast_wb(t0, mW, mB):
    """The thread's broadcast partitions of w and b (None where absent). Traced inline."""
    return (t0.part_bcast(mW) if mW is not None else None, t0.part_bcast(mB) if mB is not None else None)


def _load_wb(gW, gB, k):
    """(w, b) of fragment vector ``k`` loaded into registers (16-byte loads; None where
    absent). Traced inline from a kernel body."""
    import cutlass.cute as cute

    out = []
    for g in (gW, gB):
        r = None
        if g is not None:
            r = cute.make_rmem_tensor_like(g[None, 0, k])
            cute.autovec_copy(g[None, 0, k], r)
        out.append(r)
    return tuple(out)


def xs_rows_launch_kwargs(plan, m, stream, rows: int, min_blocks: int):
    """``xs_rows_kernel``'s launch: ceil(M / rows) CTAs (per cluster rank)."""
    import cutlass.cute as cute

    from . import _rowreduce as rr

    kw = rr.launch_kwargs(plan, m, stream, min_blocks=min_blocks)
    kw["grid"] = [cute.ceil_div(m, rows), plan.cluster_n, 1]
    return kw
