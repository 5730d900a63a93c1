"""The LayerNorm forward of 16-bit rows of one 256-thread CTA (N in (8192, 16384]): its
defaults by weight kind, the knobs, and the kernel pieces they pick.

The plain row tile there keeps 64 elements a thread in fp32 registers and loads w / b after
the reduction: 127 registers (ptxas), 2 CTAs / SM, 64 KiB of x in flight per SM. Measured
on the H200 (bf16 x, 32768x16384, TB/s, same process): that row tile 4.05, torch.compile
4.21; x cp.async'ed into shared memory (``xs_kernel``) over 512 threads, 3 CTAs / SM (40
registers) 4.20. With fp32 w + b: the clusterless ring 3.86, ``xs_kernel`` at 256 threads
and 5 CTAs / SM (48 registers) 3.99, torch.compile 4.09.

Imported only from inside compile functions and torch wrappers (pure Python at top level).
"""

# At the top, not in fwd_knobs: every eager forward calls it (an import statement there
# costs each call); _plan is pure Python and already imported by the kernel modules.
from ._plan import WIDTHS, plan_rows, resolve_weight_dtype

X_MIN_BLOCKS = 4  # "x_min_blocks" when absent

# The measured knob sets (docs/kernels.md) are rows of kernels/tuned/sm_90a.toml, by
# ``fwd_class``: one-CTA rows ("same/cta256": x through shared memory over 512
# threads, 3 CTAs / SM; "wide/cta256": two rows a CTA, w / b 2 vectors ahead, and at N =
# 16384 four rows a 512-thread CTA), rows over 16-CTA clusters ("same/cluster16": x through
# shared memory; at 262144 the pipelined ring with 4 stages; "wide/cluster16": the
# pipelined ring, the bias in registers, 3 stages) and small rows ("wide/rows": the
# 32-elements-a-thread plan, four rows a CTA). ``search_space`` lists them as candidates.


def fwd_class(params: dict) -> str | None:
    """The LayerNorm forward's tuning-table class: for 16-bit rows, the weight kind
    ("same" / "wide": fp32 beside 16-bit x) and the default plan's shape: "cta256" (one
    256-thread CTA a row, even tiling), "cluster<C>" (a row over C CTAs), "rows" (several
    rows a CTA); None elsewhere (fp32 rows, uneven one-CTA rows: the heuristic)."""
    dtype, n = params["dtype"], params["n"]
    width = WIDTHS[dtype]
    if width != 16:
        return None
    kind = "wide" if WIDTHS[resolve_weight_dtype(dtype, params["weight_dtype"])] > width else "same"
    p = plan_rows(n, width, budget=64)
    if p.threads_per_row == p.num_threads == 256 and p.cluster_n == 1 and p.even:
        return f"{kind}/cta256"
    if p.cluster_n > 1:
        return f"{kind}/cluster{p.cluster_n}"
    if p.cluster_n == 1 and p.rows_per_cta > 1:
        return f"{kind}/rows"
    return None


def fits(n: int, width: int, kn: dict) -> bool:
    """A knob set with its own "row_budget" applies only where that plan is one row a CTA
    with an even tiling of 16-byte vectors (the x-rows kernel's needs)."""
    if "row_budget" not in kn:
        return True
    q = plan_rows(n, width, budget=int(kn["row_budget"]))
    return q.rows_per_cta == 1 and q.even and q.vec * width == 128


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

    # the kernel's name is part of the generated code: kept as measured and tested
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
        # PTX is the measured one)
        red.wait_cluster()
        mean, m2 = red.reduce_pair(mt, m2t, "welford", count=plan.elems_per_thread)
        rstd = cute.math.rsqrt(m2 * (1.0 / plan.n) + eps, fastmath=True)
        t.write_row_scalar(mMean, mean)
        t.write_row_scalar(mRstd, rstd)
        affine_vec(tX, mean, rstd, t, mW, mB, mY)

    return kernel_xs
