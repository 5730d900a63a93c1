"""GPU tier: every kernel against a float32 torch reference over dtypes x M x N.
Outputs are poisoned with NaN before each run so unwritten elements fail."""

import pytest
from _cases import DTYPES, GPU_MS, GPU_NS, tol
from _fixtures import poison_allocations  # noqa: F401  (a fixture, used by name)

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
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(m, n, device="cuda", generator=g) * scale).to(getattr(torch, dt))


def _poison(t):
    t.fill_(float("nan"))
    return t


def _empty_like_poisoned(x):
    return _poison(torch.empty_like(x))


def _close(got, ref, dt, scale=1.0):
    atol, rtol = tol(dt)
    assert not torch.isnan(got).any(), "NaN in output (unwritten element?)"
    torch.testing.assert_close(got.float(), ref, atol=atol * scale, rtol=rtol)


@pytest.mark.parametrize("dt,m,n", _grid(3))
@pytest.mark.parametrize("variant", ["w", "b+res"])
def test_rmsnorm_fwd(dt, m, n, variant):
    from quack_kernels.rmsnorm import rmsnorm_fwd

    x = _rand(m, n, dt)
    w = _rand(1, n, dt, seed=1)[0] if variant == "w" else None
    b = _rand(1, n, dt, seed=2)[0] if variant != "w" else None
    r = _rand(m, n, dt, seed=3) if variant != "w" else None
    y, rstd, ro = rmsnorm_fwd(x, w, b, r, 1e-6)
    h = x.float() + (r.float() if r is not None else 0)
    if r is not None:
        _close(ro, h, dt)
        h = ro.float()  # the kernel normalizes the stored residual's fp32 value
    ref_rstd = torch.rsqrt(h.pow(2).mean(-1) + 1e-6)
    torch.testing.assert_close(rstd, ref_rstd, atol=1e-3, rtol=1e-3)
    ref = h * ref_rstd[:, None] * (w.float() if w is not None else 1) + (b.float() if b is not None else 0)
    _close(y, ref, dt, scale=4)


@pytest.mark.parametrize("dt,m,n", _grid(4))
@pytest.mark.parametrize("has_weight", [True, False], ids=["w", "now"])
def test_rmsnorm_bwd(dt, m, n, has_weight):
    from quack_kernels.rmsnorm import rmsnorm_bwd

    x = _rand(m, n, dt)
    dy = _rand(m, n, dt, seed=1)
    w = _rand(1, n, dt, seed=2)[0] if has_weight else None
    xr = x.float().requires_grad_()
    wr = w.float().requires_grad_() if w is not None else None
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
    y = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * (wr if wr is not None else 1)
    y.backward(dy.float())
    dx, dw = rmsnorm_bwd(x, w, dy, rstd)
    _close(dx, xr.grad, dt, scale=4)
    if has_weight:
        scale = wr.grad.abs().max().item() + 1
        torch.testing.assert_close(
            dw.float() / scale, wr.grad / scale, atol=2e-2 if dt != "float32" else 1e-4, rtol=0
        )
    else:
        assert dw is None


@pytest.mark.parametrize("dt,m,n", _grid(2))
def test_softmax_fwd(dt, m, n):
    from quack_kernels.softmax import softmax_fwd

    x = _rand(m, n, dt, scale=3)
    y = softmax_fwd(x)
    ref = torch.softmax(x.float(), -1)
    _close(y, ref, dt, scale=0.1)


@pytest.mark.parametrize("dt,m,n", _grid(3))
def test_softmax_bwd(dt, m, n):
    from quack_kernels.softmax import softmax_bwd

    y = torch.softmax(_rand(m, n, "float32", scale=3), -1).to(getattr(torch, dt))
    dy = _rand(m, n, dt, seed=1)
    yf, dyf = y.float(), dy.float()
    ref = yf * (dyf - (yf * dyf).sum(-1, keepdim=True))
    _close(softmax_bwd(dy, y), ref, dt, scale=0.1)


@pytest.mark.parametrize("dt,m,n", _grid(2))
def test_layernorm_fwd(dt, m, n):
    from quack_kernels.layernorm import layernorm_fwd

    x = _rand(m, n, dt) + 0.5
    w = _rand(1, n, dt, seed=1)[0]
    b = _rand(1, n, dt, seed=2)[0]
    y, mean, rstd = layernorm_fwd(x, w, b, 1e-5)
    xf = x.float()
    torch.testing.assert_close(mean, xf.mean(-1), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(rstd, torch.rsqrt(xf.var(-1, unbiased=False) + 1e-5), atol=1e-3, rtol=1e-3)
    ref = torch.nn.functional.layer_norm(xf, (n,), w.float(), b.float(), 1e-5)
    _close(y, ref, dt, scale=4)


def _ce_inputs(dt, m, n):
    x = _rand(m, n, dt, scale=2)
    g = torch.Generator(device="cuda").manual_seed(5)
    t = torch.randint(0, n, (m,), device="cuda", generator=g)
    t[::3] = -100
    return x, t


@pytest.mark.parametrize("dt,m,n", _grid(1))
def test_cross_entropy_fwd(dt, m, n):
    from quack_kernels.cross_entropy import cross_entropy_fwd

    x, t = _ce_inputs(dt, m, n)
    loss, lse = cross_entropy_fwd(x, t, ignore_index=-100)
    ref = torch.nn.functional.cross_entropy(x.float(), t, reduction="none", ignore_index=-100)
    torch.testing.assert_close(loss, ref, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(lse, torch.logsumexp(x.float(), -1), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("dt,m,n", _grid(2))
def test_cross_entropy_bwd(dt, m, n):
    from quack_kernels.cross_entropy import cross_entropy_bwd

    x, t = _ce_inputs(dt, m, n)
    xr = x.float().requires_grad_()
    dloss = torch.rand(m, device="cuda")
    loss = torch.nn.functional.cross_entropy(xr, t, reduction="none", ignore_index=-100)
    loss.backward(dloss)
    lse = torch.logsumexp(x.float(), -1)
    dx = cross_entropy_bwd(x, t, dloss, lse, -100)
    _close(dx, xr.grad, dt, scale=0.1)


# ----------------------------------------------------------------- autograd + validation


def test_autograd_wrappers():
    from quack_kernels.cross_entropy import cross_entropy
    from quack_kernels.rmsnorm import rmsnorm
    from quack_kernels.softmax import softmax

    x = _rand(64, 4096, "bfloat16").requires_grad_()
    w = _rand(1, 4096, "bfloat16", seed=1)[0].requires_grad_()
    y = rmsnorm(x, w)
    y.float().sum().backward()
    assert x.grad is not None and w.grad is not None
    xs = _rand(64, 1000, "float32").requires_grad_()
    ys = softmax(xs)
    (ys * torch.arange(1000, device="cuda")).sum().backward()
    xr = xs.detach().clone().requires_grad_()
    (torch.softmax(xr, -1) * torch.arange(1000, device="cuda")).sum().backward()
    torch.testing.assert_close(xs.grad, xr.grad, atol=1e-4, rtol=1e-3)
    xl = _rand(64, 1000, "float32").requires_grad_()
    t = torch.randint(0, 1000, (64,), device="cuda")
    cross_entropy(xl, t).backward()
    xl2 = xl.detach().clone().requires_grad_()
    torch.nn.functional.cross_entropy(xl2, t).backward()
    torch.testing.assert_close(xl.grad, xl2.grad, atol=1e-5, rtol=1e-4)


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
