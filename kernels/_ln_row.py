"""The LayerNorm forward of 16-bit rows of one 256-thread CTA (N in (8192, 16384]; issue 14
part 6, round 4): its defaults by weight kind, the knobs, and the kernel pieces they pick.

Round 3's row tile there keeps 64 elements a thread in fp32 registers and loads w / b after
the reduction: 127 registers (ptxas), 2 CTAs / SM, 64 KiB of x in flight per SM. Measured
on the H200 (benchmarks/tune_k4c.py, bf16 x, 32768x16384, TB/s, same process): that row
tile 4.05, torch.compile 4.21; x cp.async'ed into shared memory (``xs_kernel``) over 512
threads, 3 CTAs / SM (40 registers) 4.20. With fp32 w + b: round 3's clusterless ring 3.86,
``xs_kernel`` at 256 threads and 5 CTAs / SM (48 registers) 3.99, torch.compile 4.09.

Imported only from inside compile functions and torch wrappers (pure Python at top level).
"""

# At the top, not in fwd_knobs: every eager forward calls it (an import statement there
# costs each call); _plan is pure Python and already imported by the kernel modules.
from ._plan import WIDTHS, plan_rows, resolve_weight_dtype

# The knob sets measured (benchmarks/tune_k4c.py times each against round 3's kernel), by
# label. Knobs: "threads" (512: the one-CTA row over 512 threads, 32 elements a thread;
# ``row_plan``), "rt_min_blocks" (CTAs / SM asked of ptxas, register path), "wb_vec" (w / b
# loaded and y stored one vector at a time on the register path, ``affine_vec``), "x_smem"
# (x through shared memory, ``xs_kernel``) with "x_ca" (cp.async .ca instead of .cg) and
# "x_min_blocks" (CTAs / SM); "ring" (False: the ring forward off, ``_norm_fwd.ring_cfg``);
# "row_cta" (False: ``ROW_CTA`` not applied: round 3's kernels, the sweep's baselines).
ROW_CTA_VARIANTS: dict = {
    "rowtile": {},
    "rt vec": {"wb_vec": True},
    "t512 vec mb2": {"threads": 512, "wb_vec": True, "rt_min_blocks": 2},
    "xs mb3": {"x_smem": True, "x_min_blocks": 3},
    "xs mb4": {"x_smem": True, "x_min_blocks": 4},
    "xs mb5": {"x_smem": True, "x_min_blocks": 5},
    "xs mb6": {"x_smem": True, "x_min_blocks": 6},
    "xs ca mb4": {"x_smem": True, "x_min_blocks": 4, "x_ca": True},
    "xs512 mb3": {"x_smem": True, "threads": 512, "x_min_blocks": 3},
    "xs512 mb4": {"x_smem": True, "threads": 512, "x_min_blocks": 4},
}
# The label used by weight kind ("same" dtype as x; "wide": fp32 beside 16-bit x; "": round
# 3's kernel, for "wide" the clusterless ring). benchmarks/tune_k4c.py rewrites the line.
ROW_CTA: dict = {"same": "xs512 mb3", "wide": "xs2 mb3 wba2"}
X_MIN_BLOCKS = 4  # "x_min_blocks" when absent

# Round 5: the knob sets adopted for rows of one CTA with a wide weight ("xs2 mb3": two rows
# a CTA, w / b read once for both, ``_xs_rows.xs_rows_kernel``) and for rows over a
# cluster ("x_smem_cluster": ``xs_kernel`` there too, in place of the ring forward), and
# the defaults by "kind@cluster" of the default plan (kind "same" / "wide"; absent: round
# 4's kernels). "row_cta": False also leaves ROW_CLUSTER out. The variants that lost
# (carveouts, 512 threads with two rows, three rows, other CTAs / SM) and their sweep
# (benchmarks/tune_k5f.py) are at commit 6e935f3; round 6's cache-hinted ones and the
# ring with x's cp.async hinted (benchmarks/tune_k6g.py) at 66f11e8; removed since.
ROW_CTA_VARIANTS["xs2 mb3"] = {"x_smem": True, "x_rows": 2, "x_min_blocks": 3}
# Round 8 (issue 14 part 6; docs/kernels.md "Round 8"): "xs2 mb3" with the w / b vectors 0-1
# loaded right after x's cp.async and each vector k + 2 before vector k's y stores
# (``_xs_rows.xs_rows_kernel`` "wb_ahead"; 80 registers, no spills). Measured (bf16 x, M =
# 32768, fp32 w + b, same process, benchmarks/tune_k8i.py): 16384 541 / 531 us (the old
# default's two states over processes) -> 528-530 in every process, 14336 482 -> 461, 12288
# 403 -> 395, 10240 331 -> 327. The candidates that lost (three / four rows a CTA, 512 threads,
# 1-2 CTAs / SM, more vectors ahead) and the sweep are at commit bfa2a86.
ROW_CTA_VARIANTS["xs2 mb3 wba2"] = ROW_CTA_VARIANTS["xs2 mb3"] | {"wb_ahead": 2}
# By (weight kind, N), over ``ROW_CTA``: N = 16384 with an fp32 w / b, FOUR rows a 512-thread
# CTA (each w / b vector read once for the four, 4 vectors a thread: all loaded ahead of the
# reductions), 1 CTA / SM. Round 8 measured it the fastest at 16384 (bf16 x, M = 32768, same
# process: 519.0 us in each of 3 processes vs "xs2 mb3 wba2" 528-530, same-dtype 513.8:
# 0.990) and 3-17 % slower at the class's other lengths (10240 / 12288 / 14336: fewer,
# uneven vectors a thread), hence a key of its own.
ROW_CTA_VARIANTS["xs4 t512 mb1 wba4"] = {
    "x_smem": True,
    "x_rows": 4,
    "x_min_blocks": 1,
    "wb_ahead": 4,
    "threads": 512,
}
ROW_CTA_BY_N: dict = {("wide", 16384): "xs4 t512 mb1 wba4"}
_XS_CLUSTER = {"ring": False, "stage_wb": False, "x_smem": True, "x_smem_cluster": True}
ROW_CLUSTER_VARIANTS: dict = {
    "xs mb3": _XS_CLUSTER | {"x_min_blocks": 3},
    "xs2 mb3": _XS_CLUSTER | {"x_rows": 2, "x_min_blocks": 3},
}
# Round 9 (issue 14 part 6; docs/kernels.md "Round 9"): the pipelined ring forward
# (``_ring_pipe``: two rows in flight a CTA, so one row's cluster round trip overlaps the
# other's work) for rows over 16 CTAs. fp32 w + b: the bias slice in registers, the weight in
# shared memory, 3 x stages (142 registers). Where the ring does not apply (no weight and no
# bias, or an uneven tiling) the x-through-shared-memory kernels above stay. Measured (bf16 x,
# fp32 w + b, M = 4096, benchmarks/prof_k9.py, same process): 262144 1301 -> 1088-1098 us,
# 196608 1084 -> 850, 163840 974 -> 750. The same-dtype rows keep "xs mb3" but at 262144
# (``ROW_CLUSTER_BY_N``): 1164-1179 -> 1069-1089 us with the pipelined ring (w + b in shared
# memory, 4 stages), which is 3 % slower than "xs mb3" at 196608 (917 vs 891) and no faster
# at 163840. The variants that lost (the ring with w / b in registers without the pipeline,
# x kept in registers across the pipeline, cp.async.bulk x tiles, more or fewer stages) and
# the sweeps are at commit 499a617.
_PIPE = {"ring": True, "ring_pipe": True}
ROW_CLUSTER_VARIANTS["pipe wregs=b s3"] = (
    ROW_CLUSTER_VARIANTS["xs2 mb3"] | _PIPE | {"ring_wregs": "b", "stages": 3}
)
ROW_CLUSTER_VARIANTS["pipe s4"] = ROW_CLUSTER_VARIANTS["xs mb3"] | _PIPE | {"stages": 4}
ROW_CLUSTER: dict = {"wide@16": "pipe wregs=b s3", "same@16": "xs mb3"}
ROW_CLUSTER_BY_N: dict = {("same", 262144): "pipe s4"}

# Round 7 (issue 14 part 6; docs/kernels.md "Round 7"): for 16-bit rows whose default plan
# holds 2+ rows a CTA (``plan_rows`` with 64 elements a thread: N <= 4096), the knob set by
# weight kind ("same" / "wide"; absent: the register row tile) — "xs4 b32 mb3 wba4": the
# one-CTA plan of 32 elements a thread ("row_budget": N = 4096 over one 128-thread CTA
# instead of two rows of 64 threads), x of FOUR rows a CTA through shared memory, each w / b
# vector read once for the four (``_xs_rows.xs_rows_kernel``), all of the thread's w / b
# vectors loaded before the reductions ("wb_ahead"), 3 CTAs / SM asked of ptxas (126
# registers). Measured (benchmarks/tune_k7h.py, bf16 x, 32768x4096, fp32 w + b, same
# process): the register row tile 141.3 us, this 134.4 (same-dtype default 136-137). The
# variants that lost (w / b loaded ahead or in 16-byte fp32 order elsewhere, two rows on the
# 4096 plan) and the sweep are at commit e3992f2.
ROW_SMALL_VARIANTS: dict = {
    "xs4 b32 mb3 wba4": {
        "ring": False,
        "stage_wb": False,
        "row_budget": 32,
        "x_smem": True,
        "x_rows": 4,
        "x_min_blocks": 3,
        "wb_ahead": 4,
    },
}
ROW_SMALL: dict = {"wide": "xs4 b32 mb3 wba4"}


def fwd_knobs(dtype: str, n: int, weight_dtype: str, tune: dict) -> dict:
    """The LayerNorm forward's knobs: ``ROW_CTA``'s set for 16-bit rows of one 256-thread
    CTA with an even tiling (``plan_rows`` with 64 elements a thread), ``tune`` (the
    module's benchmark knobs) over it; a fresh dict."""
    kn: dict = {}
    width = WIDTHS[dtype]
    p = plan_rows(n, width, budget=64)
    on = tune.get("row_cta", True)
    wide = WIDTHS[resolve_weight_dtype(dtype, weight_dtype)] > width
    if on and width == 16 and p.threads_per_row == p.num_threads == 256 and p.cluster_n == 1 and p.even:
        kind = "wide" if wide else "same"
        label = ROW_CTA_BY_N.get((kind, n)) or ROW_CTA.get(kind)
        if label:
            kn.update(ROW_CTA_VARIANTS[label])
            if wide:
                kn["ring"] = False  # any choice there replaces round 3's ring
    elif on and width == 16 and p.cluster_n > 1:
        kind = "wide" if wide else "same"
        label = ROW_CLUSTER_BY_N.get((kind, n)) or ROW_CLUSTER.get(f"{kind}@{p.cluster_n}")
        if label:
            kn.update(ROW_CLUSTER_VARIANTS[label])
    elif on and width == 16 and p.cluster_n == 1 and p.rows_per_cta > 1:
        label = ROW_SMALL.get("wide" if wide else "same")
        if label:
            kv = ROW_SMALL_VARIANTS[label]
            q = plan_rows(n, width, budget=int(kv.get("row_budget", 64)))
            # only where that plan is one row a CTA with an even tiling (the kernel's needs)
            if q.rows_per_cta == 1 and q.even and q.vec * width == 128:
                kn.update(kv)
    kn.update(tune)
    return kn


def row_plan(n: int, width: int, kn: dict):
    """The row-tile forward's plan: ``plan_rows`` with 64 elements a thread ("row_budget":
    another budget, e.g. 32: rows of 4096 16-bit elements over one 128-thread CTA instead
    of two rows of 64 threads), or with the "threads" knob (512) the same one-CTA row over
    more threads (even rows whose vectors split evenly over them: N = 12288 / 16384 for
    16-bit rows; otherwise unchanged)."""
    from ._plan import RowPlan

    plan = plan_rows(n, width, budget=int(kn.get("row_budget", 64)))
    threads = int(kn.get("threads", 0))
    nvecs = n // plan.vec
    if (
        threads > plan.threads_per_row
        and plan.threads_per_row == plan.num_threads == 256
        and plan.cluster_n == 1
        and plan.even
        and nvecs % threads == 0
    ):
        plan = RowPlan(
            n=n,
            vec=plan.vec,
            threads_per_row=threads,
            num_threads=threads,
            cluster_n=1,
            nvec=nvecs // threads,
        )
    return plan


def x_smem_ok(plan, width: int, kn: dict) -> bool:
    """x through shared memory ("x_smem" knob): 16-bit rows of one CTA a row (no cluster
    unless "x_smem_cluster"; one row a CTA: ``affine_vec`` stores without predicates), even
    tiling, 16-byte vectors, <= 64 KiB of x a CTA."""
    return bool(kn.get("x_smem", False)) and (
        width == 16
        and (plan.cluster_n == 1 or bool(kn.get("x_smem_cluster", False)))
        and plan.rows_per_cta == 1
        and plan.even
        and plan.vec * width == 128
        and plan.tile_n * width // 8 <= 64 * 1024
    )


def thread_welford(src):
    """(mean, M2) of this thread's fragment ``src`` one vector at a time: each vector's own
    (mean, M2) exactly, merged into the running pair with Chan's formula (counts known at
    trace time), so that one vector of x is live instead of the thread's whole share (the
    exact two-pass over the share kept 64 fp32 values live: 88 bytes of spills at 4 CTAs /
    SM). Traced inline from a kernel body."""
    import cutlass.cute as cute
    from cutlass import Float32

    vec = cute.size(src, mode=[0])
    mean = Float32(0.0)
    m2 = Float32(0.0)
    # a plain loop: this helper is not a ``cute.jit`` function
    for k in range(cute.size(src, mode=[2])):
        v = src[None, 0, k].load().to(Float32)
        mk = v.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0) * (1.0 / vec)
        d = v - mk
        m2k = (d * d).reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
        if k == 0:
            mean, m2 = mk, m2k
        else:
            # n_a = k * vec so far, n_b = vec: mean += delta * n_b / (n_a + n_b),
            # M2 += M2_b + delta^2 * n_a * n_b / (n_a + n_b)
            delta = mk - mean
            mean = mean + delta * (1.0 / (k + 1))
            m2 = m2 + m2k + delta * delta * (float(k * vec) / (k + 1))
    return mean, m2


def affine_vec(src, mean, rstd, t, mW, mB, mY):
    """Store y = (x - mean) * rstd * w + b one vector at a time (``src``: this thread's x
    fragment, registers or shared memory; w / b read and y written per vector with
    ``autovec_copy``: 16-byte accesses), so that one vector of w / b / y is live at once
    (ptxas hoists every load of a whole fragment: w / b beside x spilled at 3+ CTAs / SM).
    One row a CTA with an even tiling only: the grid has one CTA per row, so no row or
    column predicate. Traced inline from a kernel body."""
    import cutlass.cute as cute
    from cutlass import Float32

    assert t.plan.rows_per_cta == 1 and t.plan.even
    gY = t.part(mY)
    gW = t.part_bcast(mW) if mW is not None else None
    gB = t.part_bcast(mB) if mB is not None else None

    def load_v(g):
        r = cute.make_rmem_tensor_like(g)
        cute.autovec_copy(g, r)
        return r

    for k in range(cute.size(gY, mode=[2])):
        yk = (src[None, 0, k].load().to(Float32) - mean) * rstd
        if gW is not None:
            yk = yk * load_v(gW[None, 0, k]).load().to(Float32)
        if gB is not None:
            yk = yk + load_v(gB[None, 0, k]).load().to(Float32)
        ry = cute.make_rmem_tensor_like(gY[None, 0, k])
        ry.store(yk.to(gY.element_type))
        cute.autovec_copy(ry, gY[None, 0, k])


def xs_kernel(plan, dt, ca: bool):
    """The row-tile forward with x through shared memory (``x_smem_ok`` plans), traced by
    the caller's ``cute.compile``: kernel(mX, mW, mB, mY, mMean, mRstd, eps), launched as
    the row tile (``_rowreduce.launch_kwargs``, "x_min_blocks" CTAs / SM). x is cp.async'ed
    (.cg, or .ca with ``ca``) into shared memory, read one vector at a time for the thread's
    (mean, M2) and again for y: each thread reads back only the vectors it copied (no CTA
    barrier), and the row is not live in registers across the reduction."""
    import cutlass.cute as cute
    from cutlass import Float32

    from . import _rowreduce as rr

    # named as round 4's sweep compiled it (the PTX is the one measured and tested)
    @cute.kernel
    def kernel_xs(
        mX: cute.Tensor, mW, mB, mY: cute.Tensor, mMean: cute.Tensor, mRstd: cute.Tensor, eps: Float32
    ):
        tidx, bidx, cluster_y, m, smem, red, t = rr.start_rows(plan, dt, mX, stages=2)
        sX = smem.allocate_tensor(
            dt, cute.make_ordered_layout(rr.tiler(plan), order=(1, 0)), byte_alignment=128
        )
        tc = rr.cp_async_tiled_copy(dt, plan, bypass_l1=not ca)
        thr = tc.get_slice(tidx)
        if t.row < m:
            cute.copy(tc, thr.partition_S(cute.local_tile(mX, rr.tiler(plan), t.coord)), thr.partition_D(sX))
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        tX = t.thr.partition_S(sX)
        mt, m2t = thread_welford(tX)
        # the cluster's mbarriers are initialized (no-op without a cluster: the one-CTA rows'
        # PTX is round 4's)
        red.wait_cluster()
        mean, m2 = red.reduce_pair(mt, m2t, "welford", count=plan.elems_per_thread)
        rstd = cute.math.rsqrt(m2 * (1.0 / plan.n) + eps, fastmath=True)
        t.write_row_scalar(mMean, mean)
        t.write_row_scalar(mRstd, rstd)
        affine_vec(tX, mean, rstd, t, mW, mB, mY)

    return kernel_xs
