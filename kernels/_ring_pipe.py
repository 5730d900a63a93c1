"""The pipelined ring forward of RMSNorm and LayerNorm (knob "ring_pipe",
``_norm_fwd.ring_cfg``): the persistent cp.async ring of ``_norm_fwd.ring_kernel`` with
TWO rows in flight a CTA. Iteration ``it`` sends row it+1's partials to the cluster, then
waits for row it's (sent one iteration earlier) and writes row it's y: the cluster round
trip of one row overlaps the other row's work instead of idling the CTA (the ring runs one
CTA an SM with 8 warps; a second CTA an SM would be of the same cluster, on the same row).
Measured on the H200 (bf16 x, 4096x262144): LayerNorm, whose
per-row work (two-pass mean / M2, the pair round trip) is the heavier, 1266 -> 1088-1101 us
with fp32 w + b, 1164-1179 -> 1069-1089 with same-dtype ones (the "cluster16" rows of
the tuning table); RMSNorm over clusters of 16 gains nothing (fp32 w 1076 -> 1080-1115), but over
clusters of 8 CTAs of 512 threads with the weight in registers (120 SMs instead of 112) 1079 ->
1061 us: its default at N = 262144 (the table's "wide/cluster16" row).

Rows stay in their x stage until their y is written (3+ stages: rows it and it+1 resident,
the rest in flight); each thread copies and reads back only its own vectors (no CTA
barrier). The reducer has 4 stages a reduction (row r uses stage r % 4, mbarrier phase
(r // 4) % 2): a CTA sends row r+1 only after it has row r-1's partials from every peer, so
a peer is at worst reading row r-2's stage. The weight / bias slice is in shared memory
(as the ring) or in registers (knob "ring_wregs").

Imported only from inside compile functions (the kernel builder imports cutlass inside).
"""


def ring_pipe_kernel(kind: str, plan, dt, wdt, cfg):
    """kernel(mX, mW, mB, mY, mMean|None, mRstd, eps) of ``kind`` ("rms" or "layer"), grid
    (num_blocks, cluster_n) (``_norm_fwd.ring_launch_kwargs``), one row a CTA over a cluster
    of 2+ CTAs, ``cfg["stages"]`` >= 3."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, const_expr

    from . import _rowreduce as rr
    from ._ring_wb import stage_ring_wb

    layer = kind == "layer"
    stages = cfg["stages"]
    wregs = cfg.get("wregs", "")  # "wb" / "w" / "b": which of w / b are in registers
    assert stages >= 3 and plan.cluster_n > 1 and plan.rows_per_cta == 1 and plan.threads_per_row % 32 == 0
    inv_n = 1.0 / plan.n
    e = plan.elems_per_thread
    total = plan.warps_per_row * plan.cluster_n

    def send(x, rbuf, rmbar, r):
        """Row r's thread partial (``x``: its fragment, fp32), sent to the cluster."""
        b = r % 4
        if const_expr(layer):
            mt = x.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0) * (1.0 / e)
            d = x - mt
            m2t = (d * d).reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
            rr.send_welford(
                Float32(mt),
                Float32(m2t),
                plan.threads_per_row,
                plan.cluster_n,
                rbuf[None, None, 2 * b],
                rbuf[None, None, 2 * b + 1],
                rmbar + b,
                e,
            )
        else:
            sst = (x * x).reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
            rr.send_sum(Float32(sst), plan.threads_per_row, plan.cluster_n, rbuf[None, None, b], rmbar + b)

    @cute.kernel
    def kernel(mX: cute.Tensor, mW, mB, mY: cute.Tensor, mMean, mRstd: cute.Tensor, eps: Float32):
        tidx, bidx, cluster_y, m, smem, red, (sX,), t0 = rr.start_ring(
            plan, dt, mX, stages, 1, red_stages=cfg["red_stages"]
        )
        # the weight / bias slices kept in shared memory (those not in registers)
        sW, sB = stage_ring_wb(
            t0,
            smem,
            wdt,
            mW if const_expr("w" not in wregs) else None,
            mB if const_expr("b" not in wregs) else None,
            cfg,
        )
        tc = rr.cp_async_tiled_copy(dt, plan)
        thr = tc.get_slice(tidx)
        grid_m = cute.arch.grid_dim()[0]
        # prologue: this CTA's rows 0 .. stages-2, one commit group each
        for s in cutlass.range_constexpr(stages - 1):
            ts = bidx + s * grid_m
            if ts < m:
                rr.copy_row_tile(tc, thr, plan, mX, ts, cluster_y, sX[None, None, s])
            cute.arch.cp_async_commit_group()
        rW = None
        rB = None
        if const_expr(mW is not None and "w" in wregs):
            rW = t0.load_bcast(t0.part_bcast(mW))
        if const_expr(mB is not None and "b" in wregs):
            rB = t0.load_bcast(t0.part_bcast(mB))
        red.wait_cluster()
        rbuf, rmbar = red.buf, red.mbar
        # row 0's partials (the grid never exceeds M: every CTA has a row 0)
        cute.arch.cp_async_wait_group(stages - 2)
        send(t0.thr.partition_S(sX[None, None, 0]).load().to(Float32), rbuf, rmbar, 0)
        for tile in cutlass.range(bidx, m, grid_m, unroll=1):
            it = (tile - bidx) // grid_m
            t = rr.RowTiles(plan, dt, m, tidx, tile, cluster_y)
            # refill the stage of row it-1 (written last iteration) with row it+stages-1
            tn = tile + (stages - 1) * grid_m
            if tn < m:
                # inline, not ``copy_row_tile``: the stage index after the source tile, the order
                # every object of this kernel was built and GPU-tested with
                cute.copy(
                    tc,
                    thr.partition_S(cute.local_tile(mX, rr.tiler(plan), (tn, cluster_y))),
                    thr.partition_D(sX[None, None, (it + stages - 1) % stages]),
                )
            cute.arch.cp_async_commit_group()
            # row it+1 resident: its partials go out before row it's wait
            cute.arch.cp_async_wait_group(stages - 2)
            # (partitioned outside the ``if``: the DSL cannot carry a RowTiles through it)
            tXn = t.thr.partition_S(sX[None, None, (it + 1) % stages])
            if tile + grid_m < m:
                send(tXn.load().to(Float32), rbuf, rmbar, it + 1)
            b = it % 4
            ph = (it // 4) % 2
            if const_expr(layer):
                mean, m2 = rr.finish_welford(
                    total, e * 32, rbuf[None, None, 2 * b], rbuf[None, None, 2 * b + 1], rmbar + b, ph
                )
                rstd = cute.math.rsqrt(m2 * inv_n + eps, fastmath=True)
                t.write_row_scalar(mMean, mean)
            else:
                ss = rr.finish_sum(total, rbuf[None, None, b], rmbar + b, ph)
                rstd = cute.math.rsqrt(ss * inv_n + eps, fastmath=True)
            # row it's y, one vector at a time: x re-read from its stage, w / b from
            # registers or shared memory (a ``spread`` tile's thread view has a nested
            # vector mode, same order: reshaped)
            tX = t.thr.partition_S(sX[None, None, it % stages])
            gY = t.part(mY)
            ry = cute.make_rmem_tensor_like(gY)
            if const_expr(sW is not None):
                tW = t.thr.partition_S(sW)
            if const_expr(sB is not None):
                tB = t.thr.partition_S(sB)
            for k in cutlass.range_constexpr(plan.nvec):
                yk = tX[None, 0, k].load().to(Float32)
                if const_expr(layer):
                    yk = (yk - mean) * rstd
                else:
                    yk = yk * rstd
                if const_expr(rW is not None):
                    yk = yk * rW[None, 0, k].load().to(Float32)
                if const_expr(sW is not None):
                    yk = yk * tW[None, 0, k].load().reshape(yk.shape).to(Float32)
                if const_expr(rB is not None):
                    yk = yk + rB[None, 0, k].load().to(Float32)
                if const_expr(sB is not None):
                    yk = yk + tB[None, 0, k].load().reshape(yk.shape).to(Float32)
                ry[None, 0, k].store(yk.to(gY.element_type))
            cute.copy(t.tiled_copy, ry, gY)
            t.write_row_scalar(mRstd, rstd)
        cute.arch.cp_async_wait_group(0)

    return kernel
