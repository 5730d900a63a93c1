"""The persistent, cp.async-pipelined forward of RMSNorm and LayerNorm for the largest
rows (a row split over a cluster of 4+ CTAs: ``ring_cfg``, ``RING_MIN_CLUSTER``).

The one-row-per-CTA forward re-reads the weight (and bias) slice from L2 for every row:
2 more bytes per element beside x's 2 read and y's 2 written with 16-bit weights, 4 (8
with a bias) with fp32 weights, and that L2 -> SM traffic, not HBM, sets the speed (H200,
bf16 rows, TB/s: RMSNorm 4.19 / fp32 w 3.48, LayerNorm 3.43 / fp32 w 2.69 at
32768x65536); at N = 262144 every row also pays a 16-CTA cluster launch. Here each CTA
stages its weight / bias slice in shared memory ONCE and loops over rows (grid =
co-resident clusters, one CTA / SM); x tiles stream through a cp.async shared-memory ring
``stages`` deep, so the loads of the next rows stay in flight across the current row's
cluster reduction. Each thread copies and reads back only its own vectors: no CTA barrier.

Imported only from inside compile functions and torch wrappers (the kernel builder
imports cutlass inside).
"""

import dataclasses
import functools

from ._plan import WIDTHS, plan_rows, resolve_weight_dtype

SMEM_MAX = 227 * 1024  # sm_90's largest dynamic shared memory a CTA may opt in to

# Defaults of the knobs (the configuration overrides each; measured on the H200): the
# smallest cluster the ring is
# used for, by kind and weight ("_wide": wider than the rows, fp32 beside 16-bit x); the
# shared-memory budget (KiB) the ring's depth is sized by; by kind, the conflict-free layout
# of a wide weight in shared memory (``RowTiles.alloc_smem_bcast(spread=True)``; LayerNorm
# fp32 w + b, TB/s: 65536 3.33 -> 3.85, 262144 2.67 -> 3.16; RMSNorm fp32 w 262144 3.99 ->
# 3.87, so not there).
RING_MIN_CLUSTER = {"rms_wide": 4, "layer": 4, "layer_wide": 4}
RING_SMEM_KB = 220
WIDE_PERM = {"rms": False, "layer": True}
# The ring also for rows of ONE 256-thread CTA (N in (8192, 16384] for 16-bit x:
# the weight / bias slice staged once instead of re-read from L2 for every row), by key.
# The ring's shape is a knob ("ctas_per_sm": C CTAs per SM, C > 1 splitting the SM's shared
# memory, so a 1-stage ring; "ring_budget": elements a thread, 128 halving the cluster;
# "wide_perm": the spread layout of a wide weight); default 1 CTA, 64 elements. Measured
# (bf16 x, TB/s): RMSNorm fp32 w 32768x65536 "1x64" 3.76, "2x64" 3.84, "2x64p" 3.87,
# "1x128" 3.91, "1x128p" 3.92 (a candidate of rmsnorm.search_space; the x-through-
# shared-memory forward wins there); LayerNorm 32768x16384 clusterless ring 3.80-3.84
# vs row tile 4.04 (kept off), fp32 w + b 3.83 vs 3.69 (on).
RING_CLUSTERLESS = {"rms_wide": False, "layer": False, "layer_wide": True}
SM_SMEM = 228 * 1024  # sm_90's shared memory per SM (each resident CTA reserves 1 KiB of it)


def reducer_bytes(plan, stages: int = 4) -> int:
    """Shared memory ahead of the ring's x tiles: the reduction buffers (``Reducer`` with
    ``stages`` stages, fp32) and their mbarriers, padded to the tiles' 128-byte alignment."""
    buf = stages * 4 * plan.rows_per_cta * plan.warps_per_row * plan.cluster_n
    mbar = 8 * stages if plan.cluster_n > 1 else 0
    return -(-(buf + mbar) // 128) * 128


def ring_cfg(
    kind: str,
    dtype: str,
    n: int,
    has_weight: bool,
    has_bias: bool,
    has_residual: bool,
    weight_dtype: str,
    tune: dict,
):
    """The ring forward's configuration, or None (see ``_ring_cfg``). Called by every eager
    forward to pick its launch grid: memoized per arguments and knob values (a fresh dict
    each time, so a caller's edit can't reach the memo)."""
    try:
        items = tuple(sorted(tune.items()))
        cfg = _ring_cfg(kind, dtype, n, has_weight, has_bias, has_residual, weight_dtype, items)
    except TypeError:  # an unhashable knob value (a benchmark's experiment): no memo
        cfg = _ring_cfg.__wrapped__(
            kind, dtype, n, has_weight, has_bias, has_residual, weight_dtype, tune.items()
        )
    return None if cfg is None else dict(cfg)


@functools.lru_cache(maxsize=1024)
def _ring_cfg(
    kind: str,
    dtype: str,
    n: int,
    has_weight: bool,
    has_bias: bool,
    has_residual: bool,
    weight_dtype: str,
    tune_items,
):
    """The ring forward's configuration, or None for the one-row-per-CTA kernel: plans
    of ``min_cluster`` CTAs a row or more with an even tiling (no column predicate),
    16-byte row vectors, a weight or a bias, no residual, and at least 2 stages of x
    beside the weight / bias slices in shared memory. RMSNorm only with a weight wider
    than the rows. Measured on the H200 (bf16 rows, TB/s, one row tile a CTA vs ring):
    4096x262144 RMSNorm 4.05 / 3.85, fp32 w 2.89 / 3.99, LayerNorm 2.78 / 3.25, fp32 w
    2.25 / 2.67 (a 16-CTA cluster launch per row costs more than one persistent loop).
    ``tune``: "ring" (False: off), "ring_min_cluster", "ring_same" (RMSNorm with
    same-width weights too), "stages" (max depth, 4), "smem_kb", "wide_perm",
    "ring_clusters" (a fixed grid instead of the occupancy calculator's);
    "ring_pipe" (two rows in flight a CTA: ``_ring_pipe``, clusters only, 3+ stages) and
    "ring_wregs" (with "ring_pipe": "w" / "b" / "wb", the weight / bias slice kept in
    registers instead of shared memory, which then holds more x stages) and "ring_threads"
    (512: the row over half the CTAs of 512 threads each, ``_ring_rows``)."""
    tune = dict(tune_items)
    if not tune.get("ring", True) or has_residual or not (has_weight or has_bias):
        return None
    width = WIDTHS[dtype]
    wbits = WIDTHS[resolve_weight_dtype(dtype, weight_dtype)]
    if not tune.get("ring_same", kind == "layer") and wbits <= width:
        return None
    base = plan_rows(n, width, budget=64)
    key = kind + ("_wide" if wbits > width else "")
    if base.cluster_n == 1:
        # one 256-thread CTA a row: a clusterless ring (block-level reductions)
        if not tune.get("ring_clusterless", RING_CLUSTERLESS.get(key, False)) or base.num_threads != 256:
            return None
    elif base.cluster_n < max(2, tune.get("ring_min_cluster", RING_MIN_CLUSTER.get(key, 16))):
        return None
    ctas = int(tune.get("ctas_per_sm", 1))
    elems = int(tune.get("ring_budget", 64))
    threads = int(tune.get("ring_threads", 256))
    plan = _ring_rows(n, width, elems, threads)
    if plan.rows_per_cta != 1 or not plan.even or plan.vec * width != 128 or plan.num_threads != threads:
        return None
    pipe = bool(tune.get("ring_pipe", False)) and plan.cluster_n > 1
    wregs = tune.get("ring_wregs", "")
    wregs = "wb" if wregs is True else "" if wregs is False else wregs
    if wregs not in ("", "w", "b", "wb") or (wregs and not pipe):
        raise ValueError(f"ring_wregs={wregs!r}: '', 'w', 'b' or 'wb', and only with ring_pipe on a cluster")
    in_smem = int(has_weight and "w" not in wregs) + int(has_bias and "b" not in wregs)
    wb_bytes = in_smem * plan.tile_n * wbits // 8
    stage_bytes = plan.tile_n * width // 8
    # the pipelined ring keeps 4 reductions in flight (8 buffers for LayerNorm's pairs)
    red_stages = 8 if pipe and kind == "layer" else 4
    fixed = reducer_bytes(plan, red_stages) + wb_bytes
    budget = min(SMEM_MAX, tune.get("smem_kb", RING_SMEM_KB) * 1024, SM_SMEM // ctas - 1024)
    stages = min(tune.get("stages", 4), (budget - fixed) // stage_bytes)
    # one stage (read, then refill with the next row) where the shared memory is shared
    # by 2+ CTAs or holds a larger slice; 2+ otherwise (the plain ring); 3+ for the
    # pipelined ring (rows it and it+1 resident while row it+2 comes in)
    if stages < (3 if pipe else 1 if ctas > 1 or elems > 64 or threads > 256 else 2):
        return None
    return dict(
        stages=stages,
        cp_async_wb=32 <= plan.vec * wbits <= 128,
        wide_perm=bool(tune.get("wide_perm", WIDE_PERM[kind])),
        smem_bytes=fixed + stages * stage_bytes,
        clusters=tune.get("ring_clusters"),
        ctas_per_sm=ctas,
        budget=elems,
        pipe=pipe,
        wregs=wregs,
        red_stages=red_stages,
        threads=threads,
    )


def ring_plan(n: int, dtype: str, cfg):
    """The row plan of a ring configuration (its elements a thread: ``cfg["budget"]``)."""
    return _ring_rows(n, WIDTHS[dtype], cfg.get("budget", 64), cfg.get("threads", 256))


# Memoized like ``plan_rows``: every eager forward with a ring plans its grid through it.
@functools.lru_cache(maxsize=1024)
def _ring_rows(n: int, width: int, elems: int, threads: int):
    """``plan_rows``'s plan, or with ``threads`` = 512 the same row over HALF the CTAs of
    twice the threads (knob "ring_threads": 512 threads a CTA, the elements a thread kept)."""
    plan = plan_rows(n, width, budget=elems)
    if threads == 512 and plan.num_threads == 256 and plan.threads_per_row == 256 and plan.cluster_n >= 4:
        plan = dataclasses.replace(plan, threads_per_row=512, num_threads=512, cluster_n=plan.cluster_n // 2)
    return plan


def ring_grid(m: int, dtype: str, n: int, cfg, device) -> int:
    """CTAs (per cluster rank) of the ring forward: the clusters co-resident at one CTA per
    SM, from the driver's occupancy calculator (``quack_kernels._occupancy``: GPCs differ
    in SM count, so SMs / cluster size can be one wave too many), cached per device and
    shape; without an answer, one cluster less than SMs / cluster size for clusters of
    4+. 1 (ignored) without a ring configuration."""
    from . import _occupancy
    from . import _torch as kt

    if cfg is None:
        return 1
    plan = ring_plan(n, dtype, cfg)
    ctas = cfg.get("ctas_per_sm", 1)
    if cfg.get("clusters"):
        clusters = cfg["clusters"]
    elif plan.cluster_n == 1:
        # no cluster, no GPC packing: the CTAs per SM the shared memory was sized for (and
        # the launch bounds ask ptxas for)
        clusters = kt.sm_count(device) * ctas
    else:
        guess = kt.sm_count(device) * ctas // plan.cluster_n - (1 if plan.cluster_n >= 4 else 0)
        # the probe kernel asks for the CTA's whole share of the SM's shared memory, not just
        # what the ring uses: the ring is sized for ``ctas`` CTAs an SM, and a lighter one
        # (a pipelined ring with w / b in registers, 100-210 of them, 100-170 KiB)
        # would otherwise be counted at CTAs an SM that its registers cannot hold -- a
        # persistent grid run as two waves (measured: 14 clusters of 16 where 7 fit)
        share = max(cfg["smem_bytes"], SM_SMEM // ctas - 1024)
        clusters = _occupancy.max_active_clusters(
            kt.device_index(device), plan.cluster_n, plan.num_threads, share, max(1, guess)
        )
    return max(1, min(m, clusters))


def ring_launch_kwargs(plan, m, stream, num_blocks, cfg):
    """The ring kernel's launch: grid (num_blocks, cluster_n); with 2+ CTAs per SM, launch
    bounds that hold ptxas to that many (the shared memory is sized for them)."""
    from . import _rowreduce as rr

    ctas = cfg.get("ctas_per_sm", 1)
    kw = rr.launch_kwargs(plan, m, stream, min_blocks=ctas if ctas > 1 else 0)
    kw["grid"] = [num_blocks, plan.cluster_n, 1]
    return kw


def ring_kernel(kind: str, plan, dt, wdt, cfg):
    """The ring forward kernel of ``kind`` ("rms" or "layer"), traced by the caller's
    ``cute.compile``: kernel(mX, mW, mB, mY, mMean|None, mRstd, eps), grid
    (num_blocks, cluster_n) (``ring_launch_kwargs``), ``cfg["ctas_per_sm"]`` CTAs / SM;
    ``plan`` is ``ring_plan``'s."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, const_expr

    from . import _rowreduce as rr
    from ._ring_wb import stage_ring_wb

    if cfg.get("pipe", False):
        from ._ring_pipe import ring_pipe_kernel

        return ring_pipe_kernel(kind, plan, dt, wdt, cfg)
    layer = kind == "layer"
    stages = cfg["stages"]
    inv_n = 1.0 / plan.n
    e = plan.elems_per_thread

    @cute.kernel
    def kernel(mX: cute.Tensor, mW, mB, mY: cute.Tensor, mMean, mRstd: cute.Tensor, eps: Float32):
        tidx, bidx, cluster_y, m, smem, red, (sX,), t0 = rr.start_ring(plan, dt, mX, stages, 1)
        # weight / bias slice of this CTA: once (cp.async group first, so the ring's
        # wait_group below also covers it; fp32 beside 16-bit rows: element-wise)
        sW, sB = stage_ring_wb(t0, smem, wdt, mW, mB, cfg)
        tc = rr.cp_async_tiled_copy(dt, plan)
        thr = tc.get_slice(tidx)
        grid_m = cute.arch.grid_dim()[0]
        # prologue: row tiles 0 .. stages-2 of this CTA (with one stage: tile 0)
        for s in cutlass.range_constexpr(max(stages - 1, 1)):
            ts = bidx + s * grid_m
            if ts < m:
                rr.copy_row_tile(tc, thr, plan, mX, ts, cluster_y, sX[None, None, s])
            cute.arch.cp_async_commit_group()
        red.wait_cluster()
        rbuf, rmbar = red.buf, red.mbar
        for tile in cutlass.range(bidx, m, grid_m, unroll=1):
            it = (tile - bidx) // grid_m
            t = rr.RowTiles(plan, dt, m, tidx, tile, cluster_y)
            if const_expr(stages > 1):
                # refill the stage read by the previous iteration with tile it + stages - 1
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
                cute.arch.cp_async_wait_group(stages - 1)
            else:
                cute.arch.cp_async_wait_group(0)
            x = t.thr.partition_S(sX[None, None, it % stages]).load().to(Float32)
            j = it % 2
            ph = (it // 2) % 2
            if const_expr(layer):
                # per-thread (mean, M2) merged with Chan's formula in one round trip
                mt = x.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0) * (1.0 / e)
                d = x - mt
                m2t = (d * d).reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
            else:
                sst = (x * x).reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
            if const_expr(stages == 1):
                # one stage: refill it with this CTA's next row now that this thread holds
                # its vectors in registers (each thread copies and reads only its own
                # vectors, and its reads above precede this copy in program order), so the
                # next row's loads are in flight across this row's reduction and store
                tn = tile + grid_m
                if tn < m:
                    rr.copy_row_tile(tc, thr, plan, mX, tn, cluster_y, sX[None, None, 0])
                cute.arch.cp_async_commit_group()
            if const_expr(layer):
                mb = (rmbar + j) if const_expr(plan.cluster_n > 1) else None
                mean, m2 = rr.row_allreduce_pair(
                    Float32(mt),
                    Float32(m2t),
                    "welford",
                    plan.threads_per_row,
                    plan.cluster_n,
                    e,
                    rbuf[None, None, 2 * j],
                    rbuf[None, None, 2 * j + 1],
                    mb,
                    ph,
                )
                rstd = cute.math.rsqrt(m2 * inv_n + eps, fastmath=True)
                y = (x - mean) * rstd
                t.write_row_scalar(mMean, mean)
            else:
                ss = rr.reduce_stage(sst, "sum", plan, rbuf, rmbar, j, ph)
                rstd = cute.math.rsqrt(ss * inv_n + eps, fastmath=True)
                y = x * rstd
            t.store_affine_smem(y, t.part(mY), sW, sB, mW, mB, wait=False)
            t.write_row_scalar(mRstd, rstd)
        cute.arch.cp_async_wait_group(0)

    return kernel
