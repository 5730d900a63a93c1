"""The Hopper GEMM kernel (CuTe DSL, sm_90a): D = act(A @ B + bias + beta * C).

Persistent and warp-specialized: warpgroup 0 is the producer (one thread issues the TMA
loads of A and B into a ring of ``plan.stages`` shared-memory stages, multicast across the
cluster), warpgroups 1 and 2 consume the ring with WGMMA and run the epilogue. "coop": both
consumer warpgroups work on one tile, each on half its rows. "ping": each consumer
warpgroup owns every other tile of the CTA's sequence, and an ordering barrier makes their
mainloops alternate, so one warpgroup's epilogue overlaps the other's MMAs.

Operands: A (M, K, L) K- or M-major, B (N, K, L) K- or N-major (fp8: both K-major, the
only order fp8 WGMMA reads), D and C (M, N, L) N-major, bias (N,) fp32, fp8's per-tensor
scales (1,) fp32 each. M, N, K, L and the strides are run-time values; tails are read as
zeros and never written by TMA (out-of-bounds boxes). Imported only from inside compile
functions.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
from cutlass import Float32, Int32, const_expr

from ._gemm_epi import GemmEpilogue
from ._gemm_launch import GemmLaunch
from ._gemm_plan import EPI_N, K_BYTES, WG, GemmPlan
from ._gemm_sched import GemmSchedule

PRODUCER_REGS, CONSUMER_REGS = 40, 232


class HopperGemm(GemmLaunch, GemmSchedule, GemmEpilogue):
    """One configuration of the kernel: ``plan`` (tile / cluster / schedule / stages),
    dtypes, operand majors, the fused epilogue and fp8's accumulation (``promote``:
    _gemm_plan.promotes) are compile-time constants."""

    def __init__(
        self, plan: GemmPlan, ab_dtype, d_dtype, a_major: str, b_major: str, epi: dict, promote: bool = False
    ):
        self.p = plan
        self.ab, self.dt = ab_dtype, d_dtype
        # fp8 operands: 128 of them a K slice (WGMMA K = 32), the accumulator scaled by
        # scale_a * scale_b in the epilogue, and (unless fast_accum) promoted once a stage
        self.fp8 = ab_dtype.width == 8
        self.promote = promote
        self.tile_k = K_BYTES // (ab_dtype.width // 8)
        self.a_major, self.b_major = a_major, b_major
        self.epi = epi  # has_c, has_bias, activation
        self.ping = plan.schedule == "ping"
        self.cluster = (plan.cluster_m, plan.cluster_n)
        self.epi_tile = (plan.tile_m, EPI_N)
        self.tile_mnk = (plan.tile_m, plan.tile_n, self.tile_k)
        # consumer warps that release a stage: ping-pong, one warpgroup reads a stage
        self.consumer_wgs = 1 if self.ping else 2
        self.math_threads = 2 * WG

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        gA_mkl: cute.Tensor,
        tma_b: cute.CopyAtom,
        gB_nkl: cute.Tensor,
        tma_d: cute.CopyAtom,
        gD_mnl: cute.Tensor,
        mD: cute.Tensor,
        mC: cute.Tensor,
        mBias: cute.Tensor,
        scales,
        beta: Float32,
        tiled_mma: cute.TiledMma,
        sA_l: cute.ComposedLayout,
        sB_l: cute.ComposedLayout,
        sD_l: cute.ComposedLayout,
        sched: utils.PersistentTileSchedulerParams,
        mWs: cute.Tensor,
        mFlags: cute.Tensor,
        sk_tiles: Int32,
    ):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = cute.arch.make_warp_uniform(tidx // WG)
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_d)

        cta_layout = cute.make_layout((*self.cluster, 1))
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        ccoord = cta_layout.get_flat_coord(rank)
        a_mask = cute.make_layout_image_mask(cta_layout, ccoord, mode=1) if p.cluster_n > 1 else 0
        b_mask = cute.make_layout_image_mask(cta_layout, ccoord, mode=0) if p.cluster_m > 1 else 0

        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(self.storage)
        tx = cute.size_in_bytes(self.ab, cute.slice_(sA_l, (None, None, 0))) + cute.size_in_bytes(
            self.ab, cute.slice_(sB_l, (None, None, 0))
        )
        # a stage is free again once every consumer warp of every CTA that reads it (through
        # the multicast: the cluster's row and column) has released it
        mcast = p.cluster_m + p.cluster_n - 1
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.ab_bar.data_ptr(),
            num_stages=p.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, mcast * self.consumer_wgs * 4),
            tx_count=tx,
            cta_layout_vmnk=cute.make_layout((1, *cta_layout.shape)),
            defer_sync=True,
        )
        order = None
        if const_expr(self.ping):
            order = pipeline.PipelineOrder.create(
                barrier_storage=st.order_bar.data_ptr(),
                depth=1,
                length=2,
                group_id=wg - 1,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, WG),
                defer_sync=True,
            )
        pipeline.pipeline_init_arrive(cluster_shape_mn=self.cluster, is_relaxed=True)

        sA = st.sA.get_tensor(sA_l.outer, swizzle=sA_l.inner)
        sB = st.sB.get_tensor(sB_l.outer, swizzle=sB_l.inner)
        sD = st.sD.get_tensor(sD_l.outer, swizzle=sD_l.inner)
        gA = cute.local_tile(gA_mkl, (p.tile_m, self.tile_k), (None, None, None))
        gB = cute.local_tile(gB_nkl, (p.tile_n, self.tile_k), (None, None, None))
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a,
            ccoord[1],
            cute.make_layout(cute.slice_(cta_layout, (0, None, 0)).shape),
            cute.group_modes(sA, 0, 2),
            cute.group_modes(gA, 0, 2),
        )
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b,
            ccoord[0],
            cute.make_layout(cute.slice_(cta_layout, (None, 0, 0)).shape),
            cute.group_modes(sB, 0, 2),
            cute.group_modes(gB, 0, 2),
        )
        k_tiles = cute.size(gA, mode=[3])
        # the problem's clusters along M and N (tile_at)
        mc = (cute.size(gA, mode=[2]) + p.cluster_m - 1) // p.cluster_m
        nc = (cute.size(gB, mode=[2]) + p.cluster_n - 1) // p.cluster_n
        grid_c = (mc, nc)
        # stream-K (plan.stream_k): this cluster's share of the schedule (_gemm_plan.stream_k_units)
        sk = None
        if const_expr(p.stream_k):
            sk = self.sk_share(gA, grid_c, k_tiles, sk_tiles, mWs, mFlags, st)
        pipeline.pipeline_init_wait(cluster_shape_mn=self.cluster)

        if wg == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                self.produce(
                    ring, sched, k_tiles, grid_c, sk, tma_a, tAgA, tAsA, a_mask, tma_b, tBgB, tBsB, b_mask
                )
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            self.consume(
                ring,
                order,
                sched,
                k_tiles,
                grid_c,
                sk,
                tiled_mma,
                sA,
                sB,
                sD,
                tma_d,
                gD_mnl,
                mD,
                mC,
                mBias,
                scales,
                beta,
                tidx,
                warp,
                wg,
            )

    @cute.jit
    def produce(
        self, ring, sched_p, k_tiles, grid_c, sk, tma_a, tAgA, tAsA, a_mask, tma_b, tBgB, tBsB, b_mask
    ):
        """One thread: the tiles of this CTA in order, every K slice into the next free stage."""
        sched = utils.StaticPersistentTileScheduler.create(
            sched_p, cute.arch.block_idx(), cute.arch.grid_dim()
        )
        work = sched.initial_work_tile_info()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.p.stages)
        q, u = Int32(0), Int32(0)
        valid = work.is_valid_tile
        if const_expr(self.p.stream_k):
            u = sk[4]
            valid = (q < sk[3]) | (u < sk[5])
        while valid:
            k0, k1 = Int32(0), k_tiles  # this unit's K tiles [k0, k1)
            if const_expr(self.p.stream_k):
                jt, k0, k1, q, u = self.sk_unit(q, u, sk, k_tiles)
                t = self.tile_of(jt, grid_c)
            else:
                t = work.tile_idx
                if const_expr(self.p.swizzle > 1):
                    t = self.tile_at(t, grid_c)
            tAg = tAgA[(None, t[0], None, t[2])]
            tBg = tBgB[(None, t[1], None, t[2])]
            for kt in range(k0, k1):
                ring.producer_acquire(state)
                bar = ring.producer_get_barrier(state)
                cute.copy(
                    tma_a, tAg[(None, kt)], tAsA[(None, state.index)], tma_bar_ptr=bar, mcast_mask=a_mask
                )
                cute.copy(
                    tma_b, tBg[(None, kt)], tBsB[(None, state.index)], tma_bar_ptr=bar, mcast_mask=b_mask
                )
                ring.producer_commit(state)
                state.advance()
            if const_expr(self.p.stream_k):
                valid = (q < sk[3]) | (u < sk[5])
            else:
                sched.advance_to_next_work()
                work = sched.get_current_work()
                valid = work.is_valid_tile
        # the CTA must not exit while a peer's multicast may still land in its stages
        ring.producer_tail(state)

    @cute.jit
    def consume(
        self,
        ring,
        order,
        sched_p,
        k_tiles,
        grid_c,
        sk,
        tiled_mma,
        sA,
        sB,
        sD,
        tma_d,
        gD_mnl,
        mD,
        mC,
        mBias,
        scales,
        beta,
        tidx,
        warp,
        wg,
    ):
        p = self.p
        cw = wg - 1  # consumer warpgroup 0 / 1
        # coop: the two warpgroups are the tiled MMA's two M halves; ping: each its own tile
        mma_thr = tidx - WG if const_expr(not self.ping) else tidx - WG * wg
        thr_mma = tiled_mma.get_slice(mma_thr)
        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        gD = cute.local_tile(gD_mnl, (p.tile_m, p.tile_n), (None, None, None))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(gD[(None, None, 0, 0, 0)]).shape, Float32)
        # promoted fp8 (_gemm_plan.promotes): a stage's products go to ``part``, which is
        # added to ``acc`` in fp32 once they are done
        part = cute.make_rmem_tensor(acc.shape, Float32) if const_expr(self.promote) else None
        kblocks = cute.size(tCrA, mode=[2])
        # fp8: the per-tensor scales, read once (they are the same for every tile)
        scale = scales[0][0] * scales[1][0] if const_expr(self.fp8) else None

        epi_bar, es = self.epi_setup(tiled_mma, sD, mma_thr, cw, wg, warp)  # _gemm_epi.GemmEpilogue

        sched = utils.StaticPersistentTileScheduler.create(
            sched_p, cute.arch.block_idx(), cute.arch.grid_dim()
        )
        rd = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, p.stages)
        rel = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, p.stages)
        if const_expr(self.ping):
            # the second warpgroup starts at the CTA's second tile, k_tiles stages later
            sched.advance_to_next_work(advance_count=cw)
            rd.advance(Int32(k_tiles * cw))
            rel.advance(Int32(k_tiles * cw))
        work = sched.get_current_work()
        done = Int32(0)  # epilogue subtiles this warpgroup has stored (buffer rotation)
        # The ordering barrier's position (its phase) is a loop variable of our own, passed
        # to wait / arrive and assigned from arrive. PipelineOrder keeps one in its frozen
        # dataclass, but the DSL does not carry a frozen dataclass's fields through a
        # dynamic while loop: every tile waited at the first tile's phase, the two mainloops
        # overlapped from a CTA's third tile on, a warpgroup ran a ring lap ahead, and the
        # full barriers' parity (ABA) let it read a stage still loading: the "unspecified
        # launch failure" of every ping-pong grid with two tiles or more per CTA.
        turn = order.state.clone() if const_expr(self.ping) else None
        q, u = Int32(0), Int32(0)
        valid = work.is_valid_tile
        if const_expr(p.stream_k):
            u = sk[4]
            valid = (q < sk[3]) | (u < sk[5])
        while valid:
            k0, k1 = Int32(0), k_tiles  # this unit's K tiles [k0, k1)
            head, pieces = Int32(0), Int32(1)  # stream-K: a cut tile's first cluster, its pieces
            if const_expr(p.stream_k):
                u0 = u
                jt, k0, k1, q, u = self.sk_unit(q, u, sk, k_tiles)
                t = self.tile_of(jt, grid_c)
                if (k0 > 0) | (k1 < k_tiles):
                    head, pieces = self.sk_piece(u0, sk, k_tiles)
            else:
                t = work.tile_idx
                if const_expr(p.swizzle > 1):
                    t = self.tile_at(t, grid_c)
            if const_expr(self.ping):
                order.wait(turn)
            acc.fill(0.0)
            if const_expr(self.promote):
                # a stage's WGMMAs start ``part`` afresh (ACCUMULATE off for the first), and
                # their sum is added to ``acc`` once they are done: the adds read ``part``, so
                # no batch stays in flight across stages (the other consumer warpgroup keeps
                # the tensor cores busy meanwhile)
                for _kt in range(k0, k1):
                    ring.consumer_wait(rd)
                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
                    cute.nvgpu.warpgroup.fence()
                    for kb in cutlass.range_constexpr(kblocks):
                        c = (None, None, kb, rd.index)
                        cute.gemm(tiled_mma, part, tCrA[c], tCrB[c], part)
                        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                    cute.nvgpu.warpgroup.commit_group()
                    cute.nvgpu.warpgroup.wait_group(0)
                    ring.consumer_release(rel)
                    rd.advance()
                    rel.advance()
                    acc.store(acc.load() + part.load())
            else:
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                cute.nvgpu.warpgroup.fence()
                # one WGMMA batch in flight: a stage is released once the batch after it is issued
                for kt in range(k0, k1):
                    ring.consumer_wait(rd)
                    for kb in cutlass.range_constexpr(kblocks):
                        c = (None, None, kb, rd.index)
                        cute.gemm(tiled_mma, acc, tCrA[c], tCrB[c], acc)
                    cute.nvgpu.warpgroup.commit_group()
                    rd.advance()
                    if kt > k0:
                        cute.nvgpu.warpgroup.wait_group(1)
                        ring.consumer_release(rel)
                        rel.advance()
                cute.nvgpu.warpgroup.wait_group(0)
                if k1 > k0:
                    ring.consumer_release(rel)
                    rel.advance()
            if const_expr(self.ping):
                turn = order.arrive(turn)  # assigned: the loop carries the advanced phase
                # skip the other warpgroup's tile in the ring
                rd.advance(Int32(k_tiles))
                rel.advance(Int32(k_tiles))

            store_tile = Int32(1)
            if const_expr(p.stream_k):
                # a cut tile: the last of its pieces to arrive adds the others' sums and
                # stores it; the others hand their sums on (no piece waits for one that has
                # not arrived: sk_combine)
                if pieces > 1:
                    if self.sk_arrive(sk, head, mma_thr, epi_bar) < pieces - 1:
                        self.sk_hand_on(
                            acc, sk, self.sk_slot(sk[0], Int32(1) if k0 == 0 else Int32(0)), mma_thr, epi_bar
                        )
                        store_tile = Int32(0)
                    else:
                        self.sk_combine(acc, sk, head, pieces, mma_thr, epi_bar)
            if store_tile == 1:
                self.epi_store(es, epi_bar, acc, thr_mma, t, tma_d, gD, sD, mD, mC, mBias, beta, scale, done)
                done += p.tile_n // EPI_N
            if const_expr(p.stream_k):
                valid = (q < sk[3]) | (u < sk[5])
            else:
                if const_expr(self.ping):
                    sched.advance_to_next_work(advance_count=2)
                else:
                    sched.advance_to_next_work()
                work = sched.get_current_work()
                valid = work.is_valid_tile
        _r2s, _tRS_sD, _sources, _frag, _frag_d, _buf0, store, is_store_warp = es
        if is_store_warp:
            store.producer_tail()
