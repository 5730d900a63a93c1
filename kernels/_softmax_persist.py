"""The persistent softmax backward (``softmax.bwd_persist_cfg``): dx = y * (dy - sum(dy * y)).

The one-row-group-per-CTA backward issues its dy / y loads only at CTA start, so each
resident slot idles from its row's last load until the next CTA's first bytes arrive
(the reduction's barrier, the stores, the CTA's retirement and launch). Here a grid of
co-resident CTAs walks row groups g, g + G, ... with two register buffers: the loads of
the next group are issued before the current one is reduced and stored, so they stay in
flight across the reduction (an LDG's registers are waited for only at their first use).

Imported only from inside ``softmax.compile_softmax_bwd`` (imports cutlass).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from . import _rowreduce as rr


def compile_bwd_persist(dt, plan, cfg: dict):
    """Runtime signature: fn(dy, y, dx, num_blocks) (``softmax.bwd_persist_grid``)."""
    n = plan.n
    R = plan.rows_per_cta
    vec = plan.vec
    assert plan.cluster_n == 1 and plan.even and R == 1  # bwd_persist_cfg's conditions
    # False: no prefetch (each group loaded where it is used): the persistent grid alone
    pipe = cfg.get("pipe", True)

    def group_view(mT, g):
        """Row group ``g`` of mT as an (R, n) tensor; offset in 64 bits (M * n may exceed
        2^31 elements)."""
        off = cute.assume(Int64(g) * (R * n), divby=vec)
        return cute.make_tensor(mT.iterator + off, cute.make_layout((R, n), stride=(n, 1)))

    # One vector at a time, converted from the 16-bit buffers where it is used: the fp32
    # row (64 registers at N = 4096) is never live beside the four buffers (whole-fragment
    # conversions: 128 registers and spills at 4 CTAs / SM).
    def dot_part(rDY, rY):
        acc = Float32(0.0)
        for k in range(plan.nvec):  # plain Python: unrolled at trace time
            acc = acc + (rDY[None, 0, k].load().to(Float32) * rY[None, 0, k].load().to(Float32)).reduce(
                cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0
            )
        return acc

    def dx_rows(rDY, rY, out, dot):
        for k in range(plan.nvec):  # plain Python: unrolled at trace time
            yk = rY[None, 0, k].load().to(Float32)
            out[None, 0, k].store((yk * (rDY[None, 0, k].load().to(Float32) - dot)).to(dt))

    @cute.kernel
    def kernel(mdY: cute.Tensor, mY: cute.Tensor, mdX: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim = cute.arch.grid_dim()[0]
        m = cute.size(mY, mode=[0])
        smem = cutlass.utils.SmemAllocator()
        # two stages, alternating per buffer: a stage is written again only after the
        # other stage's barrier, which every reader of it has passed
        red = rr.Reducer(plan, stages=2)
        red.allocate(smem)
        buf = red.buf
        tc = rr.make_tiled_copy(dt, plan)
        thr = tc.get_slice(tidx)
        ngroups = (m + (R - 1)) // R
        cnt = Int32(0)
        if bidx < ngroups:
            cnt = (ngroups - 1 - bidx) // gdim + 1
        proto = thr.partition_S(group_view(mY, bidx))
        aDY = cute.make_rmem_tensor_like(proto)
        aY = cute.make_rmem_tensor_like(proto)
        bDY = cute.make_rmem_tensor_like(proto)
        bY = cute.make_rmem_tensor_like(proto)
        out = cute.make_rmem_tensor_like(proto)
        # Every load is unconditional (no branch around the prefetch): past the CTA's last
        # group it re-reads a group it has just loaded (an L2 hit) and stores nothing.
        if const_expr(pipe):
            if cnt > 0:
                cute.copy(tc, thr.partition_S(group_view(mdY, bidx)), aDY)
                cute.copy(tc, thr.partition_S(group_view(mY, bidx)), aY)
        for it in cutlass.range(0, cnt, 2, unroll=1):
            g0 = bidx + it * gdim
            g1 = g0 + gdim
            g1c = g1
            if it + 1 >= cnt:
                g1c = g0
            if const_expr(pipe):
                cute.copy(tc, thr.partition_S(group_view(mdY, g1c)), bDY)
                cute.copy(tc, thr.partition_S(group_view(mY, g1c)), bY)
            else:
                cute.copy(tc, thr.partition_S(group_view(mdY, g0)), aDY)
                cute.copy(tc, thr.partition_S(group_view(mY, g0)), aY)
            # group g0 from buffer a
            dx_rows(aDY, aY, out, rr.reduce_stage(dot_part(aDY, aY), "sum", plan, buf, None, 0))
            cute.copy(tc, out, thr.partition_S(group_view(mdX, g0)))
            if const_expr(pipe):
                g2 = g1 + gdim
                if it + 2 >= cnt:
                    g2 = g1c
                cute.copy(tc, thr.partition_S(group_view(mdY, g2)), aDY)
                cute.copy(tc, thr.partition_S(group_view(mY, g2)), aY)
            # group g1 from buffer b
            if it + 1 < cnt:
                if const_expr(not pipe):
                    cute.copy(tc, thr.partition_S(group_view(mdY, g1)), bDY)
                    cute.copy(tc, thr.partition_S(group_view(mY, g1)), bY)
                dx_rows(bDY, bY, out, rr.reduce_stage(dot_part(bDY, bY), "sum", plan, buf, None, 1))
                cute.copy(tc, out, thr.partition_S(group_view(mdX, g1)))

    @cute.jit
    def launch(mdY: cute.Tensor, mY: cute.Tensor, mdX: cute.Tensor, num_blocks: Int32, stream):
        kernel(mdY, mY, mdX).launch(
            grid=[num_blocks, 1, 1],
            block=[plan.num_threads, 1, 1],
            min_blocks_per_mp=cfg["ctas_per_sm"],
            preferred_smem_carveout=100,
            stream=stream,
        )

    dy, m = rr.fake_rows(dt, n, vec)
    y, _ = rr.fake_rows(dt, n, vec, m)
    dx, _ = rr.fake_rows(dt, n, vec, m)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(launch, dy, y, dx, Int32(1), stream, options="--enable-tvm-ffi")
