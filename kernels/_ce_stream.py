"""The large-N streaming forward of cross-entropy (``cross_entropy.stream_cfg`` switches to it):
its default knobs by row length, its launch shape, its persistent grid and its compile.

A row group (one warp, or one CTA / cluster) streams its rows through a shared-memory
cp.async ring and folds each chunk into an online (max, sum exp); ``launch_shape`` says how.
The torch-facing op (``cross_entropy.cross_entropy_fwd``) passes ``stream_grid``'s CTA count
at launch. The register-path forward and the backward are ``_ce_rows``.

Top level imports only the standard library: torch and cutlass are imported inside functions.
"""

import math

# _ce_rows' constants too (it imports them from here)
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def default_tune(n: int) -> dict:
    """The streaming shapes measured best on the H200 (bf16, L2 flushed; the register
    path was 80 / 277 /
    1170 / 698 us at N = 4096 / 16384 / 65536 / 262144):
    one warp per row, 3 stages, 8 CTAs/SM: 78 / 262 / 1010 us at 4096 / 16384 / 65536;
    one row per 256-thread CTA: 977 us at 65536; clusters of 2 such CTAs: 497 us at 262144."""
    if n >= 131072:
        return dict(stream=True, tpr=256, cluster=2)
    if n >= 65536:
        return dict(stream=True, tpr=256)
    return dict(stream=True, stages=3, ctas_per_sm=8)


def launch_shape(tune: dict, dtype: str, n: int, smoothing: str = "none") -> dict | None:
    """Launch shape of the streaming forward under the forward's knobs ``tune``
    (``cross_entropy.fwd_knobs``), or None for the register path (the default).

    A row group (one warp when ``tpr`` = 32, else one CTA / cluster) walks its rows
    (group g, g + G, ...) chunk by chunk: each thread cp.asyncs ``k`` 16-byte vectors of a
    chunk into its own slots of a ``stages``-deep shared-memory ring, ``stages - 1``
    chunks ahead across row boundaries, and folds each chunk into an online (max, sum exp).
    Nothing is stored after the row's reduction, so the loads never stop."""
    if not tune.get("stream", False) or smoothing != "none":
        return None
    width = 32 if dtype == "float32" else 16
    vec = math.gcd(n, 128 // width)
    if vec * width < 32 or n < tune.get("min_n", 0):  # cp.async moves 4, 8 or 16 bytes
        return None
    tpr = tune.get("tpr", 32)
    threads = tune.get("threads", 128 if tpr == 32 else tpr)
    cluster = tune.get("cluster", 1) if tpr > 32 else 1
    k = tune.get("k", 4)
    stages = tune.get("stages", 4)
    assert tpr == 32 or tpr == threads, "tpr is 32 (warp per row) or the CTA size"
    assert stages >= 2 and threads % 32 == 0 and threads <= 1024
    k = max(1, min(k, -(-(n // vec) // (tpr * cluster))))  # no chunk wider than the row slice
    chunk = tpr * vec * k
    nc = -(-n // chunk)  # chunks per row
    while cluster > 1 and (cluster - 1) * -(-nc // cluster) >= nc:
        cluster //= 2  # no rank without a chunk
    nch = -(-nc // cluster)  # chunks per CTA of the cluster
    groups = threads // tpr  # row groups per CTA
    smem = stages * groups * chunk * width // 8
    if tpr > 32:  # reduction buffers + mbarriers
        smem += 4 * (tpr // 32) * cluster * 4 + 32
    by_smem = (227 * 1024) // (smem + 128 + 1024)  # + alignment + the per-CTA reserve
    # default: at most 1024 threads per SM (>= 64 registers per thread)
    ctas = tune.get("ctas_per_sm") or min(1024 // threads, by_smem, 32)
    return dict(
        vec=vec,
        tpr=tpr,
        threads=threads,
        cluster=cluster,
        k=k,
        stages=stages,
        chunk=chunk,
        nch=nch,
        groups=groups,
        even=(n % chunk == 0 and nc == nch * cluster),
        smem=smem,
        ctas_per_sm=max(1, ctas),
    )


def stream_grid(cfg: dict, m: int, device) -> int:
    """CTAs (per cluster rank) of the persistent streaming forward: all co-resident."""
    from . import _torch as kt

    slots = kt.sm_count(device) * cfg["ctas_per_sm"] // cfg["cluster"]
    if cfg["cluster"] >= 4:
        slots -= 1  # GPC granularity (see rmsnorm._bwd_grid)
    slots = max(1, slots)
    # rows are dealt round-robin to the row groups: take the fewest rounds the resident
    # groups allow, then the fewest groups that still need only that many rounds, so
    # every group gets the same number of rows (+-1) and the last round is full.
    rounds = -(-m // (slots * cfg["groups"]))
    groups = -(-m // rounds)
    return max(1, min(slots, -(-groups // cfg["groups"])))


def compile_fwd_stream(dtype: str, n: int, cfg: dict):
    """The streaming forward (see ``launch_shape``). Runtime signature:
    fn(logits, target(int64, M), loss(fp32, M), lse(fp32, M), ignore_index, num_blocks)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64, const_expr

    from . import _rowreduce as rr
    from ._plan import RowPlan

    dt = rr.cutlass_dtype(dtype)
    vec, T, C, K, S = cfg["vec"], cfg["tpr"], cfg["cluster"], cfg["k"], cfg["stages"]
    chunk, nch, W, even = cfg["chunk"], cfg["nch"], cfg["groups"], cfg["even"]
    nthr = cfg["threads"]
    # the row all-reduce across warps / CTAs (T > 32): double-buffered (a, b) pairs
    rplan = RowPlan(n=n, vec=vec, threads_per_row=T, num_threads=nthr, cluster_n=C, nvec=K)
    LOG2E = LOG2_E

    def row_view(mX, row):
        """Row ``row`` of mX as a (1, n) tensor, offset computed in 64 bits (M * n may
        exceed 2^31 elements)."""
        off = cute.assume(Int64(row) * n, divby=vec)
        return cute.make_tensor(mX.iterator + off, cute.make_layout((1, n), stride=(n, 1)))

    @cute.kernel
    def kernel(mX: cute.Tensor, mT: cute.Tensor, mLoss: cute.Tensor, mLse: cute.Tensor, ignore_index: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, cy, _ = cute.arch.block_idx()
        gdim = cute.arch.grid_dim()[0]
        rank = cy if const_expr(C > 1) else 0
        m = cute.size(mX, mode=[0])
        smem = cutlass.memory.SmemAllocator()
        red = rr.Reducer(rplan, stages=4)
        red.allocate(smem)
        sX = smem.allocate_tensor(
            dt, cute.make_layout((1, chunk, S * W), stride=(chunk, 1, chunk)), byte_alignment=128
        )
        red.init_cluster(tidx)
        if const_expr(T == 32):
            warp = tidx // 32
            ltid = tidx % 32
            g = bidx * W + warp
            G = gdim * W
            sbase = warp * S
        else:
            ltid = tidx
            g = bidx
            G = gdim
            sbase = 0
        atom = rr.cp_async_atom(dt, vec * dt.width)
        thr_layout = cute.make_ordered_layout((1, T), order=(1, 0))
        tc = cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, vec)))
        thr = tc.get_slice(ltid)
        ratom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dt, num_bits_per_copy=vec * dt.width)
        rtc = cute.make_tiled_copy_tv(ratom, thr_layout, cute.make_layout((1, vec)))
        rthr = rtc.get_slice(ltid)
        ident = cute.make_identity_tensor((m, n))
        rx = cute.make_rmem_tensor_like(rthr.partition_S(sX[None, None, 0]))

        nrows = Int32(0)
        if g < m:
            nrows = (m - 1 - g) // G + 1
        total = nrows * nch
        # prologue: chunks 0 .. S-2 of this group
        for p in cutlass.range_constexpr(S - 1):
            if p < total:
                it = p // nch
                cg = rank * nch + (p - it * nch)
                gx = cute.local_tile(row_view(mX, g + it * G), (1, chunk), (0, cg))
                if const_expr(even):
                    cute.copy(tc, thr.partition_S(gx), thr.partition_D(sX[None, None, sbase + p]))
                else:
                    pr = rr.column_predicate(
                        thr.partition_S(cute.local_tile(ident, (1, chunk), (g + it * G, cg))), n
                    )
                    cute.copy(tc, thr.partition_S(gx), thr.partition_D(sX[None, None, sbase + p]), pred=pr)
            cute.arch.cp_async_commit_group()

        # target logits: the current row's (tgt, x[tgt]) and the next row's target, loaded
        # one row ahead by the thread that writes the loss
        lead = ltid == 0
        if const_expr(C > 1):
            lead = lead and rank == 0
        tgt = Int64(ignore_index)
        tgt_next = Int64(ignore_index)
        xt = Float32(0.0)
        if lead:
            if g < m:
                tgt = Int64(mT[g])
                if tgt != Int64(ignore_index):
                    if tgt >= 0 and tgt < n:
                        xt = Float32(row_view(mX, g)[0, Int32(tgt)])
            if g + G < m:
                tgt_next = Int64(mT[g + G])
        red.wait_cluster()
        rbuf, rmbar = red.buf, red.mbar
        mrun = -Float32.inf
        srun = Float32(0.0)
        r = Int32(0)
        for s in cutlass.range(0, total, 1, unroll=1):
            pf = s + (S - 1)
            if pf < total:
                it = pf // nch
                cg = rank * nch + (pf - it * nch)
                gx = cute.local_tile(row_view(mX, g + it * G), (1, chunk), (0, cg))
                dst = sX[None, None, sbase + pf % S]
                if const_expr(even):
                    cute.copy(tc, thr.partition_S(gx), thr.partition_D(dst))
                else:
                    pr = rr.column_predicate(
                        thr.partition_S(cute.local_tile(ident, (1, chunk), (g + it * G, cg))), n
                    )
                    cute.copy(tc, thr.partition_S(gx), thr.partition_D(dst), pred=pr)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(S - 1)
            c = s - r * nch
            src = rthr.partition_S(sX[None, None, sbase + s % S])
            if const_expr(even):
                cute.copy(rtc, src, rx)
            else:
                rx.fill(-math.inf)
                pc = rr.column_predicate(
                    rthr.partition_S(cute.local_tile(ident, (1, chunk), (g + r * G, rank * nch + c))), n
                )
                cute.copy(rtc, src, rx, pred=pc)
            x = rx.load().to(Float32)
            mnew = cute.arch.fmax(
                mrun, x.reduce(cute.ReductionOp.MAX, init_val=-Float32.inf, reduction_profile=0)
            )
            msafe = mnew
            if mnew == -Float32.inf:
                msafe = Float32(0.0)
            ms2 = msafe * LOG2E
            srun = srun * cute.math.exp2(mrun * LOG2E - ms2, fastmath=True) + cute.math.exp2(
                x * LOG2E - ms2, fastmath=True
            ).reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
            mrun = mnew
            if c == nch - 1:
                # end of the row: all-reduce (max, sum) over the row group, one round trip
                if const_expr(T == 32):
                    mx, ssum = rr.row_allreduce_pair(mrun, srun, "lse", 32, 1, 1, None, None, None, 0)
                else:
                    j = r % 2
                    mb = (rmbar + j) if const_expr(C > 1) else None
                    mx, ssum = rr.row_allreduce_pair(
                        mrun,
                        srun,
                        "lse",
                        T,
                        C,
                        1,
                        rbuf[None, None, 2 * j],
                        rbuf[None, None, 2 * j + 1],
                        mb,
                        (r // 2) % 2,
                    )
                row = g + r * G
                if lead:
                    lse = mx + cute.math.log2(ssum, fastmath=True) * LN_2
                    mLse[row] = lse
                    loss = Float32(0.0)
                    if tgt != Int64(ignore_index):
                        loss = lse - xt
                    mLoss[row] = loss
                    # rotate the target prefetch: next row's x[tgt], the row after's target
                    tgt = tgt_next
                    xt = Float32(0.0)
                    if row + G < m:
                        if tgt != Int64(ignore_index):
                            if tgt >= 0 and tgt < n:
                                xt = Float32(row_view(mX, row + G)[0, Int32(tgt)])
                    if row + 2 * G < m:
                        tgt_next = Int64(mT[row + 2 * G])
                mrun = -Float32.inf
                srun = Float32(0.0)
                r = r + 1
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def launch(
        mX: cute.Tensor,
        mT: cute.Tensor,
        mLoss: cute.Tensor,
        mLse: cute.Tensor,
        ignore_index: Int32,
        num_blocks: Int32,
        stream,
    ):
        kernel(mX, mT, mLoss, mLse, ignore_index).launch(
            grid=[num_blocks, C, 1],
            block=[nthr, 1, 1],
            cluster=[1, C, 1] if const_expr(C > 1) else None,
            min_blocks_per_mp=cfg["ctas_per_sm"],
            preferred_smem_carveout=100,
            stream=stream,
        )

    x, m = rr.fake_rows(dt, n, vec)
    tg = rr.fake_vec(Int64, m, align=8)
    loss = rr.fake_vec(Float32, m, align=4)
    lse = rr.fake_vec(Float32, m, align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(launch, x, tg, loss, lse, Int32(-100), Int32(1), stream, options="--enable-tvm-ffi")
