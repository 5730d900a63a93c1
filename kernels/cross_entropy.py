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

Here: the knobs, the registered compile functions (the register-path forward, the backward)
and the torch-facing ops. Elsewhere: the large-N streaming forward (``_ce_stream``), the ops'
argument checks (``_ce_args``), the reference hooks of ``quack verify --run`` (``_verify``).

Top level imports only quack (and ``_ce_stream``, which imports only math): torch and cutlass
are imported inside functions.
"""

import math

from quack import jit_cache
from quack.params import Choice, Config, Dtype, Int

from . import _ce_stream, _tuning
from ._ce_stream import stream_grid
from ._configs import CrossEntropyBwdConfig, CrossEntropyFwdConfig
from ._plan import N_MAX, N_MIN, size_class

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)

# Defaults: the forward's by ``_ce_stream.default_tune`` (the streaming shapes by row
# length: the heuristic), the backward's by row-length class from the tuning table
# (kernels/tuned/sm_90a.toml; "mid": a budget of 128 through shared memory). A
# table row for the forward replaces ``default_tune``'s set whole.


def _size_class(params: dict) -> str | None:
    return size_class(params["dtype"], params["n"])


def fwd_search_space(params: dict) -> list[CrossEntropyFwdConfig]:
    """``quack tune``'s forward candidates: the heuristic's streaming shape, the register
    path, and the other measured streaming shapes (one warp a row, one CTA a row,
    clusters of 2)."""
    C = CrossEntropyFwdConfig
    cands = [C(**_ce_stream.default_tune(params["n"])), C(), C(fwd_smem=True)]
    cands += [C(stream=True, stages=st, ctas_per_sm=c) for st in (3, 4) for c in (4, 8)]
    cands += [C(stream=True, tpr=256), C(stream=True, tpr=256, cluster=2)]
    return list(dict.fromkeys(cands))


def bwd_search_space(params: dict) -> list[CrossEntropyBwdConfig]:
    """``quack tune``'s backward candidates: budgets, the shared-memory tile, CTAs / SM."""
    C = CrossEntropyBwdConfig
    cands = [C()] + [C(bwd_budget=b) for b in (16, 32, 64)]
    cands += [C(bwd_budget=b, bwd_smem=True) for b in (64, 128)] + [C(bwd_min_blocks=2)]
    return cands


# label_smoothing compile variants: "none"; "uniform" (the forward also sums x over the
# row, the backward subtracts a per-row constant); "weighted" (sum_c w_c x_c; w_c per column)
SMOOTHING = ("none", "uniform", "weighted")


def stream_cfg(dtype: str, n: int, smoothing: str, config: CrossEntropyFwdConfig) -> dict | None:
    """Launch shape of the streaming forward (``_ce_stream.launch_shape``) under the
    forward's ``config``, or None for the register path."""
    return _ce_stream.launch_shape(config.knobs(), dtype, n, smoothing)


def fwd_config(dtype: str, n: int, smoothing: str = "none") -> CrossEntropyFwdConfig:
    """The configuration a call with these parameters compiles (the launch grid follows it)."""
    return _tuning.derived_config(compile_cross_entropy_fwd.spec, (dtype, n, smoothing))


@jit_cache(
    "cross_entropy_fwd",
    params={
        "dtype": Dtype(),
        "n": Int(min=N_MIN, max=N_MAX),
        "smoothing": Choice(SMOOTHING),
        "config": Config(
            CrossEntropyFwdConfig,
            derive=_tuning.derive(
                "cross_entropy_fwd",
                CrossEntropyFwdConfig,
                _size_class,
                lambda p: CrossEntropyFwdConfig(**_ce_stream.default_tune(p["n"])),
            ),
        ),
    },
    reference=f"{__package__}._verify:verify_cross_entropy_fwd",
    search_space=fwd_search_space,
    bench=f"{__package__}._verify:bench_cross_entropy_fwd",
)
def compile_cross_entropy_fwd(
    dtype: str, n: int, smoothing: str = "none", config: CrossEntropyFwdConfig | None = None
):
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
    cfg = stream_cfg(dtype, n, smoothing, config)  # type: ignore[arg-type]  # derived by bind
    if cfg is not None:
        return _ce_stream.compile_fwd_stream(dtype, n, cfg)
    smooth = smoothing != "none"
    weighted = smoothing == "weighted"
    plan = plan_rows(n, io_width(dtype, "float32" if weighted else None), budget=64)
    k = config.knobs()  # type: ignore[union-attr]
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


@jit_cache(
    "cross_entropy_bwd",
    params={
        "dtype": Dtype(),
        "n": Int(min=N_MIN, max=N_MAX),
        "smoothing": Choice(SMOOTHING),
        "config": Config(
            CrossEntropyBwdConfig,
            derive=_tuning.derive("cross_entropy_bwd", CrossEntropyBwdConfig, _size_class),
        ),
    },
    reference=f"{__package__}._verify:verify_cross_entropy_bwd",
    search_space=bwd_search_space,
    bench=f"{__package__}._verify:bench_cross_entropy_bwd",
)
def compile_cross_entropy_bwd(
    dtype: str, n: int, smoothing: str = "none", config: CrossEntropyBwdConfig | None = None
):
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
    # the H200 (bf16, us for budget 64 / 32 / 16):
    # 4096: 145 / 134 / 141; 16384: 654 / 538 / 548; 65536: 2134 / 2174 / 2356;
    # 262144: 1100 / 1100 / 1101.
    k = config.knobs()  # type: ignore[union-attr]  # derived by bind (_tuning)
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


# --------------------------------------------------------------------------- torch-facing


def cross_entropy_fwd(logits, target, ignore_index: int = -100, weight=None, label_smoothing: float = 0.0):
    """Per-row cross-entropy (torch's ``reduction="none"``, with class ``weight`` and
    ``label_smoothing``). Returns ``(loss, lse)``, float32 of shape logits.shape[:-1];
    rows whose target is ``ignore_index`` get loss 0."""
    import torch

    from . import _ce_args as ca
    from . import _torch as kt

    x2 = kt.rows(logits, "logits")
    m, n = x2.shape
    t = ca.targets(target, m, logits)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    w = ca.class_weight(weight, n, logits)
    eps = ca.smoothing(label_smoothing)
    variant = ca.variant(w, eps)
    loss = torch.empty(m, dtype=torch.float32, device=x2.device)
    lse = torch.empty(m, dtype=torch.float32, device=x2.device)
    shape = logits.shape[:-1]
    if m == 0:
        return loss.view(shape), lse.view(shape)
    dtn = kt.dtype_name(x2, "logits")
    cfg = fwd_config(dtn, n, variant)
    fn = compile_cross_entropy_fwd(dtn, n, variant, cfg)
    if variant != "none":
        sx = torch.empty(m, dtype=torch.float32, device=x2.device)
        fn(x2, t, loss, lse, ignore_index, w, sx)
        valid, wt = ca.row_weights(t, w, n, ignore_index)
        wsum = w.sum() if w is not None else float(n)
        # loss holds nll = lse - x[t] (0 on ignored rows)
        loss = (1.0 - eps) * wt * loss + (eps / n) * torch.where(valid, wsum * lse - sx, 0.0)
        return loss.view(shape), lse.view(shape)
    scfg = stream_cfg(dtn, n, "none", cfg)
    if scfg is not None:
        fn(x2, t, loss, lse, ignore_index, stream_grid(scfg, m, x2.device))
    else:
        fn(x2, t, loss, lse, ignore_index)
    if w is not None:
        loss = loss * ca.row_weights(t, w, n, ignore_index)[1]
    return loss.view(shape), lse.view(shape)


def cross_entropy_bwd(
    logits, target, dloss, lse, ignore_index: int = -100, weight=None, label_smoothing: float = 0.0
):
    """d(loss)/d(logits) of ``cross_entropy_fwd`` times ``dloss`` (per row):
    (softmax(logits) - onehot(target)) * dloss[:, None] without weight / smoothing;
    0 for ignored rows."""
    import torch

    from . import _ce_args as ca
    from . import _torch as kt

    x2 = kt.rows(logits, "logits")
    m, n = x2.shape
    t = ca.targets(target, m, logits)
    dl = kt.per_row(dloss, "dloss", m, x2)
    ls = kt.per_row(lse, "lse", m, x2)
    w = ca.class_weight(weight, n, logits)
    eps = ca.smoothing(label_smoothing)
    variant = ca.variant(w, eps)
    dx = torch.empty_like(x2)
    if m > 0:
        fn = compile_cross_entropy_bwd(kt.dtype_name(x2, "logits"), n, variant)
        if variant == "none":
            if w is not None:
                dl = dl * ca.row_weights(t, w, n, ignore_index)[1]
            fn(x2, t, dl, ls, dx, ignore_index)
        else:
            _, wt = ca.row_weights(t, w, n, ignore_index)
            wsum = w.sum() if w is not None else float(n)
            b = (dl * (1.0 - eps) * wt).contiguous()
            a = (b + dl * (eps * wsum / n)).contiguous()
            c = (dl * (eps / n)).contiguous()
            fn(x2, t, a, ls, dx, ignore_index, b, c, w)
    return dx.view(logits.shape)
