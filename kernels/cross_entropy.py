"""Cross-entropy over the last dim (logits (M, N), integer targets), in CuTe DSL.

forward:  lse = logsumexp(x);  nll = lse - x[target]   (0 where target == ignore_index)
backward: dlogits = (softmax(x) - onehot(target)) * dloss  (0 rows where ignored)

Class weights w and label smoothing eps (torch's semantics, C = N classes):
  loss = (1 - eps) * w[t] * nll + eps / C * sum_c w_c * (lse - x_c)
  dlogits = a * softmax(x) - b * onehot(t) - c * w      per row, with
  a = dloss * ((1 - eps) * w[t] + eps * sum(w) / C),  b = dloss * (1 - eps) * w[t],
  c = dloss * eps / C  (w = 1 without weights).
The kernels compute the row reductions (lse, x[t], and with smoothing sum_c w_c x_c);
the per-row scalars (w[t], a, b, c) are formed by the torch wrapper (O(M) work).

Top level imports only quack: torch and cutlass are imported inside functions.
"""

import math

from quack import jit_cache
from quack.params import Choice, Dtype, Int

from ._plan import N_MAX, N_MIN, size_class

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)

# Tuning knobs read at compile time (benchmark experiments call ``.raw`` after setting them).
# Forward streaming variant (``stream_cfg``): stream=True switches to it; tpr (32 = one warp
# per row, or the CTA size = one row per CTA / cluster), threads, cluster, k (vectors per
# thread per stage), stages, ctas_per_sm, min_n.
_TUNE: dict = {}


def _default_tune(n: int) -> dict:
    """The streaming shapes measured best on the H200 (bf16, L2 flushed,
    `benchmarks/tune_variants.py cross_entropy_fwd`; the register path was 80 / 277 /
    1170 / 698 us at N = 4096 / 16384 / 65536 / 262144):
    one warp per row, 3 stages, 8 CTAs/SM: 78 / 262 / 1010 us at 4096 / 16384 / 65536;
    one row per 256-thread CTA: 977 us at 65536; clusters of 2 such CTAs: 497 us at 262144."""
    if n >= 131072:
        return dict(stream=True, tpr=256, cluster=2)
    if n >= 65536:
        return dict(stream=True, tpr=256)
    return dict(stream=True, stages=3, ctas_per_sm=8)


# Round-3 defaults by row-length class (16-bit dtypes; ``size_class``): knob sets decided on
# the H200 by benchmarks/tune_k3b.py, which rewrites this line. A forward class's set
# replaces ``_default_tune``'s whole; an explicit ``_TUNE`` replaces both.
DEFAULTS: dict = {"bwd_mid": {"bwd_budget": 128, "bwd_smem": True}}


def fwd_knobs(dtype: str, n: int) -> dict:
    return _TUNE or DEFAULTS.get("fwd_" + (size_class(dtype, n) or ""), {}) or _default_tune(n)


def bwd_knobs(dtype: str, n: int) -> dict:
    return _TUNE or DEFAULTS.get("bwd_" + (size_class(dtype, n) or ""), {})


# label_smoothing compile variants: "none"; "uniform" (the forward also sums x over the
# row, the backward subtracts a per-row constant); "weighted" (sum_c w_c x_c; w_c per column)
SMOOTHING = ("none", "uniform", "weighted")


def stream_cfg(dtype: str, n: int, smoothing: str = "none"):
    """Launch shape of the streaming forward, or None for the register path (the default).

    A row group (one warp when ``tpr`` = 32, else one CTA / cluster) walks its rows
    (group g, g + G, ...) chunk by chunk: each thread cp.asyncs ``k`` 16-byte vectors of a
    chunk into its own slots of a ``stages``-deep shared-memory ring, ``stages - 1``
    chunks ahead across row boundaries, and folds each chunk into an online (max, sum exp).
    Nothing is stored after the row's reduction, so the loads never stop."""
    tune = fwd_knobs(dtype, n)  # _TUNE: an explicit variant (tune_variants.py, tune_k3b.py)
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


@jit_cache(
    "cross_entropy_fwd",
    params={"dtype": Dtype(), "n": Int(min=N_MIN, max=N_MAX), "smoothing": Choice(SMOOTHING)},
    reference=f"{__name__}:_verify_cross_entropy_fwd",
)
def compile_cross_entropy_fwd(dtype: str, n: int, smoothing: str = "none"):
    """Runtime signature: fn(logits, target(int64, M), loss(fp32, M), lse(fp32, M), ignore_index)
    (+ num_blocks for the streaming variant, ``stream_cfg``); with smoothing "uniform" /
    "weighted": fn(logits, target, loss, lse, ignore_index, weight(fp32, N)|None, sx(fp32, M))
    where sx = sum_c x_c (* w_c)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64, const_expr

    from . import _rowreduce as rr
    from ._plan import io_width, plan_rows

    dt = rr.cutlass_dtype(dtype)
    cfg = stream_cfg(dtype, n, smoothing)
    if cfg is not None:
        return _compile_ce_fwd_stream(dtype, n, cfg)
    smooth = smoothing != "none"
    weighted = smoothing == "weighted"
    plan = plan_rows(n, io_width(dtype, "float32" if weighted else None), budget=64)
    k = fwd_knobs(dtype, n)
    min_blocks = k.get("min_blocks", 0) if plan.cluster_n > 1 else 0
    # Round-3 variant (benchmarks/tune_k3b.py, with stream=False): the logits tile
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


def _compile_ce_fwd_stream(dtype: str, n: int, cfg: dict):
    """The streaming forward (see ``stream_cfg``). Runtime signature:
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


@jit_cache(
    "cross_entropy_bwd",
    params={"dtype": Dtype(), "n": Int(min=N_MIN, max=N_MAX), "smoothing": Choice(SMOOTHING)},
    reference=f"{__name__}:_verify_cross_entropy_bwd",
)
def compile_cross_entropy_bwd(dtype: str, n: int, smoothing: str = "none"):
    """Runtime signature: fn(logits, target(int64, M), a(fp32, M), lse(fp32, M), dlogits,
    ignore_index, b(fp32, M)|None, c(fp32, M)|None, weight(fp32, N)|None):
    dlogits = a * softmax(x) - b * onehot(target) - c * w  (0 rows where ignored). With
    smoothing "none", b and c are None and b = a (a = dloss * w[target])."""
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
    # the H200 (bf16, `tune_variants.py cross_entropy_bwd`, us for budget 64 / 32 / 16):
    # 4096: 145 / 134 / 141; 16384: 654 / 538 / 548; 65536: 2134 / 2174 / 2356;
    # 262144: 1100 / 1100 / 1101.
    k = bwd_knobs(dtype, n)
    width = io_width(dtype, "float32" if weighted else None)
    budget = 32 if n <= 32768 else 64
    plan = plan_rows(n, width, budget=k.get("bwd_budget", budget))

    # Round-3 variant (benchmarks/tune_k3b.py): the CTA's logits tile cp.async'ed into shared
    # memory, the per-row scalars read while it is in flight, then read into registers (the
    # reference library's copy path); even 16-byte tilings only.
    smem_x = k.get("bwd_smem", False) and plan.even and plan.vec * dt.width == 128
    if k.get("bwd_smem", False) and not smem_x and not _TUNE:
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


# --------------------------------------------------------------------------- torch-facing


def _targets(target, m, x):
    import torch

    from . import _torch as kt  # noqa: F401

    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.device != x.device:
        raise ValueError(f"target is on {target.device} but logits is on {x.device}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target has dtype {target.dtype}, expected torch.int64 (or int32)")
    if target.numel() != m or tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"target has shape {tuple(target.shape)}, expected {tuple(x.shape[:-1])}")
    return target.reshape(m).to(torch.int64).contiguous()


def _class_weight(weight, n, x):
    """Validate class weights: a float (N,) tensor on the logits' device; fp32 copy."""
    if weight is None:
        return None
    from . import _torch as kt

    kt._tensor(weight, "weight")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but logits is on {x.device}")
    kt.dtype_name(weight, "weight")
    if weight.dim() != 1 or weight.shape[0] != n:
        raise ValueError(f"weight must have shape ({n},) (one per class), got {tuple(weight.shape)}")
    return weight.float().contiguous()


def _smoothing(label_smoothing) -> float:
    if (
        isinstance(label_smoothing, bool)
        or not isinstance(label_smoothing, (int, float))
        or not 0.0 <= label_smoothing <= 1.0
    ):
        raise ValueError(f"label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    return float(label_smoothing)


def _variant(weight, eps: float) -> str:
    if eps == 0.0:
        return "none"
    return "weighted" if weight is not None else "uniform"


def _row_weights(t, w, n, ignore_index):
    """(valid, w[t]) per row: valid = target != ignore_index; w[t] is 1 without class
    weights and 0 on ignored rows (fp32)."""
    valid = t != ignore_index
    if w is None:
        return valid, valid.float()
    return valid, w[t.clamp(0, n - 1)] * valid


def cross_entropy_fwd(logits, target, ignore_index: int = -100, weight=None, label_smoothing: float = 0.0):
    """Per-row cross-entropy (torch's ``reduction="none"``, with class ``weight`` and
    ``label_smoothing``). Returns ``(loss, lse)``, float32 of shape logits.shape[:-1];
    rows whose target is ``ignore_index`` get loss 0."""
    import torch

    from . import _torch as kt

    x2 = kt.rows(logits, "logits")
    m, n = x2.shape
    t = _targets(target, m, logits)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    w = _class_weight(weight, n, logits)
    eps = _smoothing(label_smoothing)
    variant = _variant(w, eps)
    loss = torch.empty(m, dtype=torch.float32, device=x2.device)
    lse = torch.empty(m, dtype=torch.float32, device=x2.device)
    shape = logits.shape[:-1]
    if m == 0:
        return loss.view(shape), lse.view(shape)
    dtn = kt.dtype_name(x2, "logits")
    fn = compile_cross_entropy_fwd(dtn, n, variant)
    if variant != "none":
        sx = torch.empty(m, dtype=torch.float32, device=x2.device)
        fn(x2, t, loss, lse, ignore_index, w, sx)
        valid, wt = _row_weights(t, w, n, ignore_index)
        wsum = w.sum() if w is not None else float(n)
        # loss holds nll = lse - x[t] (0 on ignored rows)
        loss = (1.0 - eps) * wt * loss + (eps / n) * torch.where(valid, wsum * lse - sx, 0.0)
        return loss.view(shape), lse.view(shape)
    cfg = stream_cfg(dtn, n)
    if cfg is not None:
        fn(x2, t, loss, lse, ignore_index, stream_grid(cfg, m, x2.device))
    else:
        fn(x2, t, loss, lse, ignore_index)
    if w is not None:
        loss = loss * _row_weights(t, w, n, ignore_index)[1]
    return loss.view(shape), lse.view(shape)


def cross_entropy_bwd(
    logits, target, dloss, lse, ignore_index: int = -100, weight=None, label_smoothing: float = 0.0
):
    """d(loss)/d(logits) of ``cross_entropy_fwd`` times ``dloss`` (per row):
    (softmax(logits) - onehot(target)) * dloss[:, None] without weight / smoothing;
    0 for ignored rows."""
    import torch

    from . import _torch as kt

    x2 = kt.rows(logits, "logits")
    m, n = x2.shape
    t = _targets(target, m, logits)
    dl = kt.per_row(dloss, "dloss", m, x2)
    ls = kt.per_row(lse, "lse", m, x2)
    w = _class_weight(weight, n, logits)
    eps = _smoothing(label_smoothing)
    variant = _variant(w, eps)
    dx = torch.empty_like(x2)
    if m > 0:
        fn = compile_cross_entropy_bwd(kt.dtype_name(x2, "logits"), n, variant)
        if variant == "none":
            if w is not None:
                dl = dl * _row_weights(t, w, n, ignore_index)[1]
            fn(x2, t, dl, ls, dx, ignore_index)
        else:
            _, wt = _row_weights(t, w, n, ignore_index)
            wsum = w.sum() if w is not None else float(n)
            b = (dl * (1.0 - eps) * wt).contiguous()
            a = (b + dl * (eps * wsum / n)).contiguous()
            c = (dl * (eps / n)).contiguous()
            fn(x2, t, a, ls, dx, ignore_index, b, c, w)
    return dx.view(logits.shape)


def cross_entropy(
    logits,
    target,
    ignore_index: int = -100,
    reduction: str = "mean",
    weight=None,
    label_smoothing: float = 0.0,
):
    """Differentiable cross-entropy with torch's semantics (the
    ``quack_kernels::cross_entropy_fwd`` custom op with its registered autograd; works
    under ``torch.compile(fullgraph=True)``). reduction 'none', 'sum' or 'mean' (divided
    by the summed class weights of the non-ignored targets: their count without weights)."""
    from . import _ops

    return _ops.cross_entropy(logits, target, ignore_index, reduction, weight, label_smoothing)


# --------------------------------------------------------------------------- verify


def _inputs(params, device):
    import torch

    dt = getattr(torch, params["dtype"])
    n = params["n"]
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(37, n, generator=g) * 2).to(device=device, dtype=dt)
    t = torch.randint(0, n, (37,), generator=g)
    t[::5] = -100
    return x, t.to(device)


def _ce_kwargs(params, n, device):
    """weight / label_smoothing for a smoothing variant's reference check."""
    import torch

    v = params.get("smoothing", "none")
    if v == "none":
        return {}
    g = torch.Generator(device="cpu").manual_seed(1)
    w = torch.rand(n, generator=g).to(device) if v == "weighted" else None
    return dict(weight=w, label_smoothing=0.1)


def _verify_cross_entropy_fwd(params: dict, device) -> None:
    import torch

    x, t = _inputs(params, device)
    kw = _ce_kwargs(params, x.shape[1], device)
    loss, lse = cross_entropy_fwd(x, t, -100, **kw)
    ref = torch.nn.functional.cross_entropy(x.float(), t, reduction="none", ignore_index=-100, **kw)
    torch.testing.assert_close(loss, ref, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(lse, torch.logsumexp(x.float(), -1), atol=1e-3, rtol=1e-3)


def _verify_cross_entropy_bwd(params: dict, device) -> None:
    import torch

    x, t = _inputs(params, device)
    kw = _ce_kwargs(params, x.shape[1], device)
    xr = x.float().requires_grad_()
    torch.nn.functional.cross_entropy(xr, t, reduction="sum", ignore_index=-100, **kw).backward()
    lse = torch.logsumexp(x.float(), -1)
    dx = cross_entropy_bwd(x, t, torch.ones(x.shape[0], device=device), lse, -100, **kw)
    tol = 1e-5 if x.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(dx.float(), xr.grad, atol=tol, rtol=tol * 4)
