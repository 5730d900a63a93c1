"""Softmax along the last dim, forward and backward, in CuTe DSL.

forward:  y = exp(x - max(x)) / sum(exp(x - max(x)))     (fp32 math)
backward: dx = y * (dy - sum(dy * y))

Top level imports only quack: torch and cutlass are imported inside functions.
"""

import math

from quack import jit_cache
from quack.params import Config, Dtype, Int

from . import _tuning
from ._configs import SoftmaxBwdConfig, SoftmaxFwdConfig, hint_spec
from ._plan import N_MAX, N_MIN, size_class

LOG2_E = math.log2(math.e)

# The backward plan's budget (row elements a thread keeps, fp32, two rows) for 16-bit
# dtypes by row length: 4096 <= N <= 8192 (one CTA a row), 8192 < N <= 16384; 32 elsewhere
# (the "bwd_budget" knob overrides; measured on the H200).
BWD_BUDGET_SMALL = 32
BWD_BUDGET_MID = 16

# The measured knob sets by row-length class (``size_class``: "mid": 4 CTAs / SM asked of
# ptxas; "small": the backward as torch.compile's kernel: the row over 512 threads, dy / y
# loaded with evict_last hints, re-read after the reduction with evict_first;
# docs/kernels.md) are rows of kernels/tuned/sm_90a.toml.


def _size_class(params: dict) -> str | None:
    return size_class(params["dtype"], params["n"])


def fwd_search_space(params: dict) -> list[SoftmaxFwdConfig]:
    """``quack tune``'s forward candidates: the heuristic, the online pair off / on, x
    through shared memory, CTAs / SM asked of ptxas."""
    C = SoftmaxFwdConfig
    return [C(), C(online=False), C(online=True), C(fwd_smem=True)] + [C(fwd_min_blocks=b) for b in (2, 3, 4)]


def bwd_search_space(params: dict) -> list[SoftmaxBwdConfig]:
    """``quack tune``'s backward candidates: budgets, shared-memory rows, CTAs / SM, the
    512-thread two-pass kernel with its cache hints."""
    C = SoftmaxBwdConfig
    cands = [C()] + [C(bwd_budget=b) for b in (16, 32, 64)] + [C(bwd_smem=True), C(bwd_min_blocks=4)]
    cands.append(C(bwd_ld="last:evict_last", bwd_ld2="first:evict_first", bwd_tpr=512, bwd_twopass=True))
    cands.append(C(bwd_tpr=512, bwd_twopass=True))
    return cands


def bwd_budget(dtype: str, n: int, k: dict) -> int:
    """Row elements a thread of the backward keeps in registers (``plan_rows``' budget)."""
    if "bwd_budget" in k:
        return k["bwd_budget"]
    if dtype != "float32" and 4096 <= n <= 8192:
        return BWD_BUDGET_SMALL
    if dtype != "float32" and 8192 < n <= 16384:
        return BWD_BUDGET_MID
    return 32


@jit_cache(
    "softmax_fwd",
    params={
        "dtype": Dtype(),
        "n": Int(min=N_MIN, max=N_MAX),
        "config": Config(
            SoftmaxFwdConfig,
            derive=_tuning.derive("softmax_fwd", SoftmaxFwdConfig, _size_class, classes=_tuning.SIZE_CLASSES),
        ),
    },
    reference=f"{__package__}._verify:verify_softmax_fwd",
    search_space=fwd_search_space,
    bench=f"{__package__}._verify:bench_softmax_fwd",
)
def compile_softmax_fwd(dtype: str, n: int, config: SoftmaxFwdConfig | None = None):
    """Runtime signature: fn(x, y) with x, y (M, n) of ``dtype``."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, const_expr

    from . import _rowreduce as rr
    from ._plan import plan_rows

    dt = rr.cutlass_dtype(dtype)
    plan = plan_rows(n, dt.width, budget=64)
    # Cluster plans (a row over 2..16 CTAs): one all-reduce round trip of the (max, sum of
    # exp) pairs instead of two (max, then sum): each distributed-shared-memory exchange
    # waits for the slowest CTA of the cluster.
    k = config.knobs()  # type: ignore[union-attr]  # derived by bind (_tuning)
    online = k.get("online", plan.cluster_n > 1)
    # Variants: x cp.async'ed into shared memory, then read
    # into registers (the reference library's copy path: no registers held by the loads in
    # flight); even 16-byte tilings only. ``fwd_min_blocks``: resident CTAs / SM for ptxas.
    smem_x = k.get("fwd_smem", False) and plan.even and plan.vec * dt.width == 128
    min_blocks = k.get("fwd_min_blocks", 0)

    @cute.kernel
    def kernel(mX: cute.Tensor, mY: cute.Tensor):
        tidx, bidx, cluster_y, m, smem, red, t = rr.start_rows(plan, dt, mX, stages=2)
        if const_expr(smem_x):
            (sX,) = t.stage_rows(smem, mX)
            t.wait_rows()
            x = sX.load().to(Float32)
        else:
            x = t.load(t.part(mX), fill=-math.inf).load().to(Float32)
        red.wait_cluster()
        if const_expr(online):
            mloc = x.reduce(cute.ReductionOp.MAX, init_val=-Float32.inf, reduction_profile=0)
            # a thread holding only padding (-inf) columns: exp(x - 0) = 0, never NaN
            msafe = mloc
            if mloc == -Float32.inf:
                msafe = Float32(0.0)
            e = cute.math.exp2(x * LOG2_E - msafe * LOG2_E, fastmath=True)
            sloc = e.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
            mx, s = red.reduce_pair(mloc, sloc, "lse")
            scale = cute.math.exp2(msafe * LOG2_E - mx * LOG2_E, fastmath=True) * cute.arch.rcp_approx(s)
            t.store(e * scale, t.part(mY))
        else:
            mx = red.reduce(
                x.reduce(cute.ReductionOp.MAX, init_val=-Float32.inf, reduction_profile=0), "max", 0
            )
            e = cute.math.exp2(x * LOG2_E - mx * LOG2_E, fastmath=True)
            s = red.reduce(e.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0), "sum", 1)
            t.store(e * cute.arch.rcp_approx(s), t.part(mY))

    @cute.jit
    def launch(mX: cute.Tensor, mY: cute.Tensor, stream):
        kernel(mX, mY).launch(
            **rr.launch_kwargs(plan, cute.size(mX, mode=[0]), stream, min_blocks=min_blocks)
        )

    x, m = rr.fake_rows(dt, n, plan.vec)
    y, _ = rr.fake_rows(dt, n, plan.vec, m)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(launch, x, y, stream, options="--enable-tvm-ffi")


def _bwd_plan(dtype: str, n: int, width: int, k: dict):
    """The backward's row plan: ``plan_rows`` with the budget, or with the knob
    ``bwd_tpr`` = 512 a row of one CTA spread over 512 threads (even tilings only)."""
    from ._plan import RowPlan, plan_rows

    plan = plan_rows(n, width, budget=bwd_budget(dtype, n, k))
    tpr = k.get("bwd_tpr", 0)
    # (one CTA a row without a cluster, when the row splits evenly within 32 elements a thread)
    if tpr > 256 and n % (plan.vec * tpr) == 0 and n // tpr <= 32:
        plan = RowPlan(
            n=n, vec=plan.vec, threads_per_row=tpr, num_threads=tpr, cluster_n=1, nvec=n // (plan.vec * tpr)
        )
    return plan


@jit_cache(
    "softmax_bwd",
    params={
        "dtype": Dtype(),
        "n": Int(min=N_MIN, max=N_MAX),
        "config": Config(
            SoftmaxBwdConfig,
            derive=_tuning.derive("softmax_bwd", SoftmaxBwdConfig, _size_class, classes=_tuning.SIZE_CLASSES),
        ),
    },
    reference=f"{__package__}._verify:verify_softmax_bwd",
    search_space=bwd_search_space,
    bench=f"{__package__}._verify:bench_softmax_bwd",
)
def compile_softmax_bwd(dtype: str, n: int, config: SoftmaxBwdConfig | None = None):
    """Runtime signature: fn(dy, y, dx), all (M, n) of ``dtype``."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, const_expr

    from . import _cachehint as ch
    from . import _rowreduce as rr
    from ._plan import plan_rows

    dt = rr.cutlass_dtype(dtype)
    k = config.knobs()  # type: ignore[union-attr]  # derived by bind (_tuning)
    k.update({h: hint_spec(k[h]) for h in ("bwd_ld", "bwd_ld2") if h in k})
    plan = _bwd_plan(dtype, n, dt.width, k)
    # Cluster plans with an even tiling: dy and y are cp.async'ed into shared memory and
    # read from there twice (the dot product, then dx after the reduction) instead of
    # living in registers as fp32 through the reduction (170 registers at N = 262144:
    # 1 CTA / SM, 2.46 TB/s on the H200; 64 this way, 3 CTAs / SM by shared memory, 3.76
    # TB/s); 2 x 32 KiB of shared memory a CTA at most.
    smem_rows = rr.smem_rows_ok(plan, dt.width, 2)
    if "bwd_smem" in k:
        # the knob applies to even 16-byte tilings only (cp.async leaves no column
        # predicate); a knob set measured with it falls back to the default budget where
        # it cannot apply (a budget of 64 in registers spills: two rows of fp32)
        smem_rows = k["bwd_smem"] and plan.even and plan.vec * dt.width == 128
        if k["bwd_smem"] and not smem_rows:
            plan = plan_rows(n, dt.width, budget=32)
    min_blocks = k.get("bwd_min_blocks", 0)
    # Knobs of the register path (hinted stores and createpolicy'd operands lost, see
    # ``_cachehint``): cache hints
    # on the loads of dy / y (``bwd_ld``; ``bwd_ld2`` for the re-read, see
    # ``_cachehint.io_copy``), and ``bwd_twopass``: dy and y re-read after the reduction (L1 / L2 hits)
    # instead of kept as fp32 through it, as torch.compile's looped reduction does. The small
    # class's default (32768x4096: 190.6 -> 184.9 us on the H200, torch.compile 184.8): 512
    # threads, loads with L1::evict_last + L2 evict_last, re-reads with evict_first. Without
    # the L2 policy on the first loads it ran 188.2; with a createpolicy'd policy 207.6.
    ld, ld2 = k.get("bwd_ld"), k.get("bwd_ld2", k.get("bwd_ld"))
    ld_pol, ld2_pol = (ch.l2_policy(s) for s in (ld, ld2))
    twopass = k.get("bwd_twopass", False) and not smem_rows

    @cute.jit
    def load_h(t, tc, gT: cute.Tensor, pol: cutlass.Constexpr):
        r = cute.make_rmem_tensor_like(gT)
        if const_expr(not plan.even):
            r.fill(0.0)
        if t.row < t.m:
            if const_expr(pol is None):
                cute.copy(tc, gT, r, pred=t.pred)
            else:
                cute.copy(tc, gT, r, pred=t.pred, cache_policy=cutlass.Int64(pol))
        else:
            r.fill(0.0)
        return r

    @cute.jit
    def store_h(t, tc, val_ssa, gT: cute.Tensor):
        r = cute.make_rmem_tensor_like(gT)
        r.store(val_ssa.to(gT.element_type))
        if t.row < t.m:
            cute.copy(tc, r, gT, pred=t.pred)

    @cute.kernel
    def kernel(mdY: cute.Tensor, mY: cute.Tensor, mdX: cute.Tensor):
        tidx, bidx, cluster_y, m, smem, red, t = rr.start_rows(plan, dt, mY, stages=1)
        ld_c = ch.io_copy(dt, plan, ld, t.tiled_copy)
        ld2_c = ch.io_copy(dt, plan, ld2, t.tiled_copy)
        if const_expr(smem_rows):
            sdY, sY = t.stage_rows(smem, mdY, mY)
            red.wait_cluster()
            t.wait_rows()
            dot = red.reduce(
                (sdY.load().to(Float32) * sY.load().to(Float32)).reduce(
                    cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0
                ),
                "sum",
                0,
            )
            # re-read after the reduction (its barriers order the shared-memory reads)
            y = sY.load().to(Float32)
            store_h(t, t.tiled_copy, y * (sdY.load().to(Float32) - dot), t.part(mdX))
        elif const_expr(ld is None and not twopass):
            dy = t.load(t.part(mdY)).load().to(Float32)
            y = t.load(t.part(mY)).load().to(Float32)
            red.wait_cluster()
            dot = red.reduce(
                (dy * y).reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0), "sum", 0
            )
            t.store(y * (dy - dot), t.part(mdX))
        else:
            dy = load_h(t, ld_c, t.part(mdY), ld_pol).load().to(Float32)
            y = load_h(t, ld_c, t.part(mY), ld_pol).load().to(Float32)
            red.wait_cluster()
            dot = red.reduce(
                (dy * y).reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0), "sum", 0
            )
            if const_expr(twopass):
                dy = load_h(t, ld2_c, t.part(mdY), ld2_pol).load().to(Float32)
                y = load_h(t, ld2_c, t.part(mY), ld2_pol).load().to(Float32)
            store_h(t, t.tiled_copy, y * (dy - dot), t.part(mdX))

    @cute.jit
    def launch(mdY: cute.Tensor, mY: cute.Tensor, mdX: cute.Tensor, stream):
        kernel(mdY, mY, mdX).launch(
            **rr.launch_kwargs(plan, cute.size(mY, mode=[0]), stream, min_blocks=min_blocks)
        )

    dy, m = rr.fake_rows(dt, n, plan.vec)
    y, _ = rr.fake_rows(dt, n, plan.vec, m)
    dx, _ = rr.fake_rows(dt, n, plan.vec, m)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(launch, dy, y, dx, stream, options="--enable-tvm-ffi")


# --------------------------------------------------------------------------- torch-facing


def softmax_fwd(x):
    """Softmax over the last dim of a CUDA tensor (float32/float16/bfloat16)."""
    import torch

    from . import _torch as kt

    x2 = kt.rows(x, "x")
    m, n = x2.shape
    y = torch.empty_like(x2)
    if m > 0:
        compile_softmax_fwd(kt.dtype_name(x2, "x"), n)(x2, y)
    return y.view(x.shape)


def softmax_bwd(dy, y):
    """Gradient of softmax: dx = y * (dy - sum(dy * y, -1))."""
    import torch

    from . import _torch as kt

    y2 = kt.rows(y, "y")
    m, n = y2.shape
    dy2 = kt.like_rows(dy, "dy", y, "y")
    dx = torch.empty_like(y2)
    if m > 0:
        compile_softmax_bwd(kt.dtype_name(y2, "y"), n)(dy2, y2, dx)
    return dx.view(y.shape)
