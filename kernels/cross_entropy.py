"""Cross-entropy over the last dim (logits (M, N), integer targets), in CuTe DSL.

forward:  lse = logsumexp(x);  loss = lse - x[target]   (0 where target == ignore_index)
backward: dlogits = (softmax(x) - onehot(target)) * dloss  (0 rows where ignored)

Top level imports only quack: torch and cutlass are imported inside functions.
"""
import math

from quack import jit_cache
from quack.params import Dtype, Int

from kernels._plan import N_MAX, N_MIN

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)

# Tuning knobs read at compile time (benchmark experiments call ``.raw`` after setting them).
_TUNE: dict = {}


@jit_cache(
    "cross_entropy_fwd",
    params={"dtype": Dtype(), "n": Int(min=N_MIN, max=N_MAX)},
    reference="kernels.cross_entropy:_verify_cross_entropy_fwd",
)
def compile_cross_entropy_fwd(dtype: str, n: int):
    """Runtime signature: fn(logits, target(int64, M), loss(fp32, M), lse(fp32, M), ignore_index)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64, const_expr

    from kernels import _rowreduce as rr
    from kernels._plan import plan_rows

    dt = rr.cutlass_dtype(dtype)
    plan = plan_rows(n, dt.width, budget=64)
    min_blocks = _TUNE.get("min_blocks", 0) if plan.cluster_n > 1 else 0

    @cute.kernel
    def kernel(mX: cute.Tensor, mT: cute.Tensor, mLoss: cute.Tensor, mLse: cute.Tensor,
               ignore_index: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, cy, _ = cute.arch.block_idx()
        cluster_y = cy if const_expr(plan.cluster_n > 1) else 0
        m = cute.size(mX, mode=[0])
        smem = cutlass.utils.SmemAllocator()
        red = rr.Reducer(plan, stages=2)
        red.allocate(smem)
        red.init_cluster(tidx)
        t = rr.RowTiles(plan, dt, m, tidx, bidx, cluster_y)
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
        red.wait_cluster()
        # Online softmax: each thread's (max, sum exp(x - max)), merged over the row in
        # one all-reduce round trip.
        mloc = x.reduce(cute.ReductionOp.MAX, init_val=-Float32.inf, reduction_profile=0)
        msafe = mloc
        if mloc == -Float32.inf:
            msafe = Float32(0.0)
        sloc = cute.math.exp2(x * LOG2_E - msafe * LOG2_E, fastmath=True).reduce(
            cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
        mx, s = red.reduce_pair(mloc, sloc, "lse")
        lse = mx + cute.math.log2(s, fastmath=True) * LN_2
        if t.row < m:
            if lead:
                mLse[t.row] = lse
                loss = Float32(0.0)
                if tgt != Int64(ignore_index):
                    loss = lse - xt
                mLoss[t.row] = loss

    @cute.jit
    def launch(mX: cute.Tensor, mT: cute.Tensor, mLoss: cute.Tensor, mLse: cute.Tensor,
               ignore_index: Int32, stream):
        kernel(mX, mT, mLoss, mLse, ignore_index).launch(
            **rr.launch_kwargs(plan, cute.size(mX, mode=[0]), stream, min_blocks=min_blocks))

    x, m = rr.fake_rows(dt, n, plan.vec)
    tg = rr.fake_vec(Int64, m, align=8)
    loss = rr.fake_vec(Float32, m, align=4)
    lse = rr.fake_vec(Float32, m, align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(launch, x, tg, loss, lse, Int32(-100), stream, options="--enable-tvm-ffi")


@jit_cache(
    "cross_entropy_bwd",
    params={"dtype": Dtype(), "n": Int(min=N_MIN, max=N_MAX)},
    reference="kernels.cross_entropy:_verify_cross_entropy_bwd",
)
def compile_cross_entropy_bwd(dtype: str, n: int):
    """Runtime signature: fn(logits, target(int64, M), dloss(fp32, M), lse(fp32, M), dlogits,
    ignore_index)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64, const_expr

    from kernels import _rowreduce as rr
    from kernels._plan import plan_rows

    dt = rr.cutlass_dtype(dtype)
    plan = plan_rows(n, dt.width, budget=64)

    @cute.kernel
    def kernel(mX: cute.Tensor, mT: cute.Tensor, mdLoss: cute.Tensor, mLse: cute.Tensor,
               mdX: cute.Tensor, ignore_index: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, cy, _ = cute.arch.block_idx()
        cluster_y = cy if const_expr(plan.cluster_n > 1) else 0
        m = cute.size(mX, mode=[0])
        t = rr.RowTiles(plan, dt, m, tidx, bidx, cluster_y)
        x = t.load(t.part(mX)).load().to(Float32)
        tgt = Int32(-1)
        g = Float32(0.0)
        lse = Float32(0.0)
        if t.row < m:
            t64 = Int64(mT[t.row])
            if t64 != Int64(ignore_index):
                g = Float32(mdLoss[t.row])
                lse = Float32(mLse[t.row])
                tgt = Int32(t64)
        p = cute.math.exp2(x * LOG2_E - lse * LOG2_E, fastmath=True) * g
        r = cute.make_rmem_tensor(p.shape, Float32)
        r.store(p)
        for i in cutlass.range_constexpr(cute.size(r)):
            if t.tXcX[i][1] == tgt:
                r[i] = r[i] - g
        t.store(r.load(), t.part(mdX))

    @cute.jit
    def launch(mX: cute.Tensor, mT: cute.Tensor, mdLoss: cute.Tensor, mLse: cute.Tensor,
               mdX: cute.Tensor, ignore_index: Int32, stream):
        m = cute.size(mX, mode=[0])
        kw = rr.launch_kwargs(plan, m, stream)
        kernel(mX, mT, mdLoss, mLse, mdX, ignore_index).launch(**kw)

    x, m = rr.fake_rows(dt, n, plan.vec)
    dx, _ = rr.fake_rows(dt, n, plan.vec, m)
    tg = rr.fake_vec(Int64, m, align=8)
    dloss = rr.fake_vec(Float32, m, align=4)
    lse = rr.fake_vec(Float32, m, align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(launch, x, tg, dloss, lse, dx, Int32(-100), stream,
                        options="--enable-tvm-ffi")


# --------------------------------------------------------------------------- torch-facing

def _targets(target, m, x):
    from kernels import _torch as kt  # noqa: F401
    import torch

    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.device != x.device:
        raise ValueError(f"target is on {target.device} but logits is on {x.device}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target has dtype {target.dtype}, expected torch.int64 (or int32)")
    if target.numel() != m or tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"target has shape {tuple(target.shape)}, expected {tuple(x.shape[:-1])}")
    return target.reshape(m).to(torch.int64).contiguous()


def cross_entropy_fwd(logits, target, ignore_index: int = -100):
    """Per-row cross-entropy. Returns ``(loss, lse)``, float32 of shape logits.shape[:-1];
    rows whose target is ``ignore_index`` get loss 0."""
    from kernels import _torch as kt
    import torch

    x2 = kt.rows(logits, "logits")
    m, n = x2.shape
    t = _targets(target, m, logits)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    loss = torch.empty(m, dtype=torch.float32, device=x2.device)
    lse = torch.empty(m, dtype=torch.float32, device=x2.device)
    if m > 0:
        compile_cross_entropy_fwd(kt.dtype_name(x2, "logits"), n)(x2, t, loss, lse, ignore_index)
    shape = logits.shape[:-1]
    return loss.view(shape), lse.view(shape)


def cross_entropy_bwd(logits, target, dloss, lse, ignore_index: int = -100):
    """dlogits = (softmax(logits) - onehot(target)) * dloss[:, None], 0 for ignored rows."""
    from kernels import _torch as kt
    import torch

    x2 = kt.rows(logits, "logits")
    m, n = x2.shape
    t = _targets(target, m, logits)
    dl = kt.per_row(dloss, "dloss", m, x2)
    ls = kt.per_row(lse, "lse", m, x2)
    dx = torch.empty_like(x2)
    if m > 0:
        compile_cross_entropy_bwd(kt.dtype_name(x2, "logits"), n)(x2, t, dl, ls, dx, ignore_index)
    return dx.view(logits.shape)


_FN = {}


def cross_entropy(logits, target, ignore_index: int = -100, reduction: str = "mean"):
    """Differentiable cross-entropy (``torch.autograd.Function``); reduction 'none',
    'sum' or 'mean' (over non-ignored rows, like torch)."""
    import torch

    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
    if "fn" not in _FN:
        class CrossEntropyFunction(torch.autograd.Function):
            @staticmethod
            def forward(ctx, logits, target, ignore_index):
                loss, lse = cross_entropy_fwd(logits, target, ignore_index)
                ctx.save_for_backward(logits, target, lse)
                ctx.ignore_index = ignore_index
                return loss

            @staticmethod
            def backward(ctx, dloss):
                logits, target, lse = ctx.saved_tensors
                dx = cross_entropy_bwd(logits, target, dloss.float().contiguous(), lse,
                                       ctx.ignore_index)
                return dx, None, None

        _FN["fn"] = CrossEntropyFunction
    loss = _FN["fn"].apply(logits, target, ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum().clamp(min=1)


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


def _verify_cross_entropy_fwd(params: dict, device) -> None:
    import torch

    x, t = _inputs(params, device)
    loss, lse = cross_entropy_fwd(x, t)
    ref = torch.nn.functional.cross_entropy(x.float(), t, reduction="none", ignore_index=-100)
    torch.testing.assert_close(loss, ref, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(lse, torch.logsumexp(x.float(), -1), atol=1e-3, rtol=1e-3)


def _verify_cross_entropy_bwd(params: dict, device) -> None:
    import torch

    x, t = _inputs(params, device)
    xr = x.float().requires_grad_()
    torch.nn.functional.cross_entropy(xr, t, reduction="sum", ignore_index=-100).backward()
    lse = torch.logsumexp(x.float(), -1)
    dx = cross_entropy_bwd(x, t, torch.ones(x.shape[0], device=device), lse)
    tol = 1e-5 if x.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(dx.float(), xr.grad, atol=tol, rtol=tol * 4)
