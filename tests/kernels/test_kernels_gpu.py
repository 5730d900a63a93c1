"""GPU tier: every kernel against its float32 reference (quack_kernels._reference: the one
definition `quack verify --run` uses too) over dtypes x M x N. Outputs are poisoned with NaN before each run so unwritten elements fail."""

import pytest
from _cases import DTYPES, GPU_MS, GPU_NS
from _fixtures import (
    poison_allocations,  # noqa: F401  (a fixture, used by name)
    seeded_randn,
)

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("poison_allocations"),  # NaN-filled outputs: unwritten elements fail
]

MAX_BYTES = 8 * 2**30


def _grid(max_tensors):
    out = []
    for dt in DTYPES:
        for m in GPU_MS:
            for n in GPU_NS:
                size = 4 if dt == "float32" else 2
                if m * n * (size * max_tensors + 8) > MAX_BYTES:  # + fp32 reference
                    continue
                out.append(pytest.param(dt, m, n, id=f"{dt}-{m}x{n}"))
    return out


def _rand(m, n, dt, scale=1.0, seed=0):
    return seeded_randn((m, n), getattr(torch, dt), seed=seed, scale=scale)


@pytest.mark.parametrize("dt,m,n", _grid(3))
@pytest.mark.parametrize("variant", ["w", "b+res"])
def test_rmsnorm_fwd(dt, m, n, variant):
    from quack_kernels import _reference as R
    from quack_kernels.rmsnorm import rmsnorm_fwd

    x = _rand(m, n, dt)
    w = _rand(1, n, dt, seed=1)[0] if variant == "w" else None
    b = _rand(1, n, dt, seed=2)[0] if variant != "w" else None
    r = _rand(m, n, dt, seed=3) if variant != "w" else None
    y, rstd, ro = rmsnorm_fwd(x, w, b, r, 1e-6)
    R.check_rmsnorm_fwd(x, w, b, r, 1e-6, y=y, rstd=rstd, residual_out=ro)


@pytest.mark.parametrize("dt,m,n", _grid(4))
@pytest.mark.parametrize("has_weight", [True, False], ids=["w", "now"])
def test_rmsnorm_bwd(dt, m, n, has_weight):
    from quack_kernels import _reference as R
    from quack_kernels.rmsnorm import rmsnorm_bwd

    x = _rand(m, n, dt)
    dy = _rand(m, n, dt, seed=1)
    w = _rand(1, n, dt, seed=2)[0] if has_weight else None
    rstd = R.rmsnorm_fwd_ref(x, None, None, None, 1e-6)["rstd"]
    dx, dw = rmsnorm_bwd(x, w, dy, rstd)
    if not has_weight:
        assert dw is None
    R.check_rmsnorm_bwd(x, w, dy, 1e-6, dx=dx, dw=dw)


@pytest.mark.parametrize("dt,m,n", _grid(2))
def test_softmax_fwd(dt, m, n):
    from quack_kernels import _reference as R
    from quack_kernels.softmax import softmax_fwd

    x = _rand(m, n, dt, scale=3)
    R.check_softmax_fwd(x, y=softmax_fwd(x))


@pytest.mark.parametrize("dt,m,n", _grid(3))
def test_softmax_bwd(dt, m, n):
    from quack_kernels import _reference as R
    from quack_kernels.softmax import softmax_bwd

    y = torch.softmax(_rand(m, n, "float32", scale=3), -1).to(getattr(torch, dt))
    dy = _rand(m, n, dt, seed=1)
    R.check_softmax_bwd(dy, y, dx=softmax_bwd(dy, y))


@pytest.mark.parametrize("dt,m,n", _grid(2))
def test_layernorm_fwd(dt, m, n):
    from quack_kernels import _reference as R
    from quack_kernels.layernorm import layernorm_fwd

    x = _rand(m, n, dt) + 0.5
    w = _rand(1, n, dt, seed=1)[0]
    b = _rand(1, n, dt, seed=2)[0]
    y, mean, rstd = layernorm_fwd(x, w, b, 1e-5)
    R.check_layernorm_fwd(x, w, b, 1e-5, y=y, mean=mean, rstd=rstd)


def _ce_inputs(dt, m, n):
    x = _rand(m, n, dt, scale=2)
    g = torch.Generator(device="cuda").manual_seed(5)
    t = torch.randint(0, n, (m,), device="cuda", generator=g)
    t[::3] = -100
    return x, t


@pytest.mark.parametrize("dt,m,n", _grid(1))
def test_cross_entropy_fwd(dt, m, n):
    from quack_kernels import _reference as R
    from quack_kernels.cross_entropy import cross_entropy_fwd

    x, t = _ce_inputs(dt, m, n)
    loss, lse = cross_entropy_fwd(x, t, ignore_index=-100)
    R.check_cross_entropy_fwd(x, t, -100, loss=loss, lse=lse)


@pytest.mark.parametrize("dt,m,n", _grid(2))
def test_cross_entropy_bwd(dt, m, n):
    from quack_kernels import _reference as R
    from quack_kernels.cross_entropy import cross_entropy_bwd

    x, t = _ce_inputs(dt, m, n)
    dloss = torch.rand(m, device="cuda")
    lse = R.cross_entropy_fwd_ref(x, t, -100)["lse"]
    dx = cross_entropy_bwd(x, t, dloss, lse, -100)
    R.check_cross_entropy_bwd(x, t, dloss, -100, dx=dx)


# ----------------------------------------------------------------- autograd + validation


def test_autograd_wrappers():
    from quack_kernels import _reference as R
    from quack_kernels.ops import cross_entropy, rmsnorm, softmax

    x = _rand(64, 4096, "bfloat16").requires_grad_()
    w = _rand(1, 4096, "bfloat16", seed=1)[0].requires_grad_()
    y = rmsnorm(x, w)
    y.float().sum().backward()
    assert x.grad is not None and w.grad is not None
    xs = _rand(64, 1000, "float32").requires_grad_()
    ys = softmax(xs)
    (ys * torch.arange(1000, device="cuda")).sum().backward()
    dy = torch.arange(1000, device="cuda", dtype=torch.float32).expand(64, -1)
    R.check_softmax_bwd(dy, torch.softmax(xs.detach(), -1), dx=xs.grad)
    xl = _rand(64, 1000, "float32").requires_grad_()
    t = torch.randint(0, 1000, (64,), device="cuda")
    cross_entropy(xl, t).backward()
    R.check_cross_entropy_bwd(xl.detach(), t, torch.tensor(1.0, device="cuda"), reduction="mean", dx=xl.grad)


def test_eager_calls_skip_the_dispatcher_only_when_nothing_would_differ(monkeypatch):
    """``quack_kernels.ops``' functions call the family's torch wrapper directly in plain
    eager use (the custom op's Python dispatch cost ~70 us of host time a call) with the
    same result, and go through the custom op whenever it would differ: a gradient to
    record, a dispatch mode or a function mode other than a default-device context, the
    profiler (which must see the op by name)."""
    from quack_kernels import ops
    from quack_kernels._dispatch import direct
    from torch.utils.flop_counter import FlopCounterMode

    x, w = _rand(64, 4096, "bfloat16"), _rand(1, 4096, "bfloat16", seed=1)[0]
    xs = _rand(64, 1000, "float32")
    t = torch.randint(0, 1000, (64,), device="cuda")
    g = torch.Generator(device="cuda").manual_seed(2)
    a = torch.randn((1000, 776), generator=g, device="cuda").bfloat16()
    b = torch.randn((776, 1048), generator=g, device="cuda").bfloat16()
    calls = {
        "rmsnorm_fwd": lambda: ops.rmsnorm(x, w),
        "softmax_fwd": lambda: ops.softmax(xs),
        "cross_entropy_fwd": lambda: ops.cross_entropy(xs, t, reduction="none"),
        "gemm_op": lambda: ops.gemm(a, b),
    }
    entered = []
    for name in calls:
        op = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *args, _op=op, _n=name: (entered.append(_n), _op(*args))[1])

    eager = {name: fn() for name, fn in calls.items()}
    assert entered == []
    with FlopCounterMode(display=False):  # a dispatch mode: it must see (and count) the ops
        through = {name: fn() for name, fn in calls.items()}
    assert entered == list(calls)
    for name in calls:  # the same kernels, the same bits
        d, o = eager[name], through[name]
        assert torch.equal(d, o), name
    entered.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ops.gemm(a, b)
    assert entered == ["gemm_op"] and any(e.name == "quack_kernels::gemm" for e in prof.events())
    entered.clear()
    with torch.device("cuda"):  # a default-device context: direct, the wrappers name the device
        assert torch.equal(ops.softmax(xs), eager["softmax_fwd"])
    assert entered == []

    class Passing(torch.overrides.TorchFunctionMode):  # any other function mode sees the op
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passing():
        ops.softmax(xs)
    assert entered == ["softmax_fwd"]
    entered.clear()
    wg = w.clone().requires_grad_()
    ops.rmsnorm(x, wg).float().sum().backward()  # a gradient to record: the custom op
    assert entered == ["rmsnorm_fwd"] and wg.grad is not None
    entered.clear()
    with torch.no_grad():  # nothing to record: direct again
        ops.rmsnorm(x, wg)
    assert entered == []
    weight = torch.nn.Parameter(w.clone())  # a module's weight: a Parameter, needing grad
    assert not direct(x, weight)
    with torch.inference_mode():
        assert direct(x, weight)
        assert torch.equal(ops.rmsnorm(x, weight), eager["rmsnorm_fwd"])
    assert entered == []


def test_bad_inputs():
    from quack_kernels.cross_entropy import cross_entropy_fwd
    from quack_kernels.rmsnorm import rmsnorm_fwd
    from quack_kernels.softmax import softmax_bwd

    x = _rand(8, 1024, "bfloat16")
    with pytest.raises(TypeError, match="weight"):
        rmsnorm_fwd(x, torch.ones(1024, device="cuda", dtype=torch.int32))
    with pytest.raises(TypeError, match="bias"):
        rmsnorm_fwd(x, torch.ones(1024, device="cuda"), torch.ones(1024, device="cuda", dtype=torch.float16))
    with pytest.raises(ValueError, match="weight"):
        rmsnorm_fwd(x, torch.ones(512, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="last dim"):
        rmsnorm_fwd(_rand(1024, 8, "bfloat16").t())
    with pytest.raises(ValueError, match="out of range"):
        rmsnorm_fwd(torch.empty(8, 0, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dy"):
        softmax_bwd(_rand(8, 512, "bfloat16"), x)
    with pytest.raises(TypeError, match="x has dtype"):
        rmsnorm_fwd(x.to(torch.int32))
    with pytest.raises(ValueError, match="target"):
        cross_entropy_fwd(x, torch.zeros(7, dtype=torch.int64, device="cuda"))
