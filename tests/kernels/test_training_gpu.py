"""GPU tier for the training features (issue 14): every op through its differentiable
wrapper (the torch.library custom ops), forward AND backward, against float32 torch
references, over M in {1, 7, large odd} x N from 1 to 262,144 (many not a multiple of 8)
x every (input, weight) dtype pair; then the same ops under torch.compile(fullgraph=True).

References and tolerances: quack_kernels._reference (the one definition `quack verify --run`
uses too: by the compared tensor's dtype, N and the rows summed into it). Outputs are poisoned with NaN first, so an unwritten element fails."""

import pytest
from _cases import DTYPES
from _fixtures import oom_pressure, poison_allocations, seeded_randn  # noqa: F401  (fixtures, used by name)

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("poison_allocations", "oom_pressure"),
]

from quack_kernels import _reference as R  # noqa: E402  (torch first: skipped without it)

NS = (1, 3, 8, 100, 192, 668, 1000, 4100, 16385, 65536, 131074, 262144)
TD = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PAIRS = [(x, w) for x in DTYPES for w in DTYPES]


def large_m(n: int) -> int:
    """A large odd batch: more row tiles than the persistent backward's grid for small N,
    at most ~32M elements."""
    return min(40001, max(257, (2**25 // n))) | 1


def _ms(n):
    return (1, 7, large_m(n))


def _grid(pairs):
    return [pytest.param(x, w, m, n, id=f"{x}-{w}-{m}x{n}") for x, w in pairs for n in NS for m in _ms(n)]


def _rand(shape, dt, seed, scale=1.0, shift=0.0):
    return seeded_randn(shape, dt, seed=seed, scale=scale, shift=shift)


def close(got, ref, what, m_rows=1, rounded_to=None):
    """got vs the fp32 reference with ``_reference``'s tolerance of got's dtype (rows of
    got's last dimension; ``m_rows``: rows summed into it)."""
    n = got.shape[-1] if got.dim() else 1
    R.assert_close(got, ref, what, n=n, rows=m_rows, rounded_to=rounded_to)


def leaf(t):
    return t.detach().clone().requires_grad_()


# ------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("xdt,wdt,m,n", _grid(PAIRS))
def test_rmsnorm_fwd_bwd_weight_dtypes(xdt, wdt, m, n):
    from quack_kernels.ops import rmsnorm

    x, w = _rand((m, n), TD[xdt], 0), _rand((n,), TD[wdt], 1)
    dy = _rand((m, n), TD[xdt], 2)
    xs, ws = leaf(x), leaf(w)
    y = rmsnorm(xs, ws, eps=1e-6)
    assert y.dtype == x.dtype
    y.backward(dy)
    R.check_rmsnorm_fwd(x, w, None, None, 1e-6, y=y)
    R.check_rmsnorm_bwd(x, w, dy, 1e-6, dx=xs.grad, dw=ws.grad)


@pytest.mark.parametrize("xdt,wdt,m,n", _grid([(d, d) for d in DTYPES]))
def test_rmsnorm_bias_residual_fwd_bwd(xdt, wdt, m, n):
    from quack_kernels.ops import rmsnorm

    x, r, b = _rand((m, n), TD[xdt], 0), _rand((m, n), TD[xdt], 3), _rand((n,), TD[wdt], 4)
    dy, dh = _rand((m, n), TD[xdt], 2), _rand((m, n), TD[xdt], 5)
    xs, rs, bs = leaf(x), leaf(r), leaf(b)
    y, h = rmsnorm(xs, None, bs, rs, 1e-6)
    torch.autograd.backward([y, h], [dy, dh])
    # The kernels normalize and differentiate at the stored residual h (x's dtype), and so
    # does the reference (at N = 1, where y = h / |h|, dx ~ eps / |h|^3 is ill-conditioned
    # in h, so the unrounded sum would differ).
    R.check_rmsnorm_fwd(x, None, b, r, 1e-6, y=y, residual_out=h)
    hq = R.rmsnorm_fwd_ref(x, None, None, r, 1e-6)["residual_out"].to(x.dtype)
    bwd = R.rmsnorm_bwd_ref(hq, None, dy, 1e-6, has_bias=True)
    dh_ref = bwd["dx"] + dh.float()
    close(xs.grad, dh_ref, "dx")
    close(rs.grad, dh_ref, "dresidual")
    R.check_rmsnorm_bwd(hq, None, dy, 1e-6, b.dtype, db=bs.grad)


# ------------------------------------------------------------------------- LayerNorm


@pytest.mark.parametrize("xdt,wdt,m,n", _grid(PAIRS))
def test_layernorm_fwd_bwd_weight_dtypes(xdt, wdt, m, n):
    from quack_kernels.ops import layernorm

    x = _rand((m, n), TD[xdt], 0, shift=0.5)
    w, b = _rand((n,), TD[wdt], 1), _rand((n,), TD[wdt], 2)
    dy = _rand((m, n), TD[xdt], 3)
    xs, ws, bs = leaf(x), leaf(w), leaf(b)
    y = layernorm(xs, ws, bs, 1e-5)
    y.backward(dy)
    R.check_layernorm_fwd(x, w, b, 1e-5, y=y)
    R.check_layernorm_bwd(x, w, b, dy, 1e-5, dx=xs.grad, dw=ws.grad, db=bs.grad)


@pytest.mark.parametrize("kind", ("rms", "layer"))
@pytest.mark.parametrize("wdt", ("bfloat16", "float32"))
@pytest.mark.parametrize("n", (16384, 65536, 131072, 262144))
def test_norm_fwd_every_ring_cluster_size(kind, wdt, n):
    """The forwards at the cluster sizes the persistent ring may take (none / 4 / 8 / 16
    CTAs a row, by ``_norm_fwd.RING_CLUSTERLESS`` / ``RING_MIN_CLUSTER`` and the ring knobs),
    with more rows than the grid holds clusters: every CTA loops over several rows (and the
    row-tile RMSNorm's x-in-shared-memory path, ``_rms_fwd.X_SMEM_MIN_CLUSTER``)."""
    from quack_kernels.layernorm import layernorm_fwd
    from quack_kernels.rmsnorm import rmsnorm_fwd

    m = 4 * torch.cuda.get_device_properties(0).multi_processor_count + 5
    x = _rand((m, n), torch.bfloat16, 0, shift=0.5)
    w, b = _rand((n,), TD[wdt], 1), _rand((n,), TD[wdt], 2)
    if kind == "rms":
        y, rstd, _ = rmsnorm_fwd(x, w, None, None, 1e-6)
        R.check_rmsnorm_fwd(x, w, None, None, 1e-6, y=y, rstd=rstd)
    else:
        y, mean, rstd = layernorm_fwd(x, w, b, 1e-5)
        R.check_layernorm_fwd(x, w, b, 1e-5, y=y, mean=mean, rstd=rstd)


@pytest.mark.parametrize("n, cluster", ((65536, 4), (131072, 8), (262144, 16)))
def test_ring_grid_is_the_drivers_occupancy(n, cluster):
    """The ring forward's grid comes from cuOccupancyMaxActiveClusters on this GPU (not the
    estimate a failed query falls back to): a positive number of clusters, at most SMs /
    cluster size, the same as a direct query."""
    from quack_kernels import _norm_fwd, _occupancy

    cfg = _norm_fwd.ring_cfg("layer", "bfloat16", n, True, True, False, "same", {"ring_min_cluster": 4})
    assert cfg is not None
    direct = _occupancy.query_max_active_clusters(0, cluster, 256, cfg["smem_bytes"])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert 1 <= direct <= sms // cluster
    assert _norm_fwd.ring_grid(10**6, "bfloat16", n, cfg, torch.device("cuda", 0)) == direct


@pytest.mark.parametrize("n", (1, 668, 16385, 262144))
def test_layernorm_bwd_without_affine(n):
    from quack_kernels.layernorm import layernorm_bwd, layernorm_fwd

    m = 33
    x, dy = _rand((m, n), torch.bfloat16, 0), _rand((m, n), torch.bfloat16, 1)
    _, mean, rstd = layernorm_fwd(x)
    dx, dw, db = layernorm_bwd(x, None, dy, mean, rstd)
    R.check_layernorm_bwd(x, None, None, dy, 1e-5, dx=dx, dw=dw, db=db)


# ------------------------------------------------------------------------- softmax


@pytest.mark.parametrize("xdt,_w,m,n", _grid([(d, d) for d in DTYPES]))
def test_softmax_fwd_bwd(xdt, _w, m, n):
    from quack_kernels.ops import softmax

    x, dy = _rand((m, n), TD[xdt], 0, scale=3), _rand((m, n), TD[xdt], 1)
    xs = leaf(x)
    y = softmax(xs)
    y.backward(dy)
    R.check_softmax_fwd(x, y=y)
    # the backward uses the stored (rounded) y: so does the reference
    R.check_softmax_bwd(dy, y.detach(), dx=xs.grad)


# ------------------------------------------------------------------------- cross-entropy

CE_VARIANTS = {
    "plain": dict(reduction="none"),
    "weighted-smooth": dict(reduction="mean", weight=True, label_smoothing=0.1),
    "smooth": dict(reduction="sum", label_smoothing=0.25),
    "weighted": dict(reduction="mean", weight=True),
}


@pytest.mark.parametrize("variant", list(CE_VARIANTS))
@pytest.mark.parametrize("xdt,_w,m,n", _grid([(d, d) for d in DTYPES]))
def test_cross_entropy_fwd_bwd(variant, xdt, _w, m, n):
    from quack_kernels.ops import cross_entropy

    kw = dict(CE_VARIANTS[variant])
    x = _rand((m, n), TD[xdt], 0, scale=2)
    g = torch.Generator(device="cuda").manual_seed(5)
    t = torch.randint(0, n, (m,), device="cuda", generator=g)
    t[1::3] = -100
    if kw.pop("weight", False):
        kw["weight"] = torch.rand(n, device="cuda", generator=g) + 0.1
    xs = leaf(x)
    loss = cross_entropy(xs, t, -100, **kw)
    up = (
        torch.rand(loss.shape, device="cuda", generator=g) if loss.dim() else torch.tensor(0.7, device="cuda")
    )
    loss.backward(up)
    ref = R.cross_entropy_ref(x, t, -100, **kw)
    R.assert_close(loss, ref, "loss", n=n, dtype=torch.float32)
    R.check_cross_entropy_bwd(x, t, up, -100, **kw, dx=xs.grad)


# ------------------------------------------------------------------------- torch.compile

COMPILE_NS = ((1, 1), (7, 668), (257, 4100), (33, 65536))

# What each compiled test exercises, and at what cost. Our side of torch.compile is dynamo
# tracing the custom ops in one graph (fullgraph=True), AOT autograd building the backward
# from the registered fake impls and autograd formulas, and the real kernels running on
# what that graph hands them: backend="aot_eager" does all of it, for every dtype
# combination. Inductor adds its own lowering and Triton code for the glue ops around ours,
# where our ops are extern calls whatever the dtypes: one Inductor test over EVERY op in
# ONE graph covers that. (Six Inductor tests, one per dtype combination and op group,
# were 21 s of the H200 tier, most of it Inductor compiling the same glue six times.)


def _compiled(fn, backend):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, dynamic=True, backend=backend)


def _norms():
    from quack_kernels.ops import layernorm, rmsnorm

    def f(x, r, w, b):
        y, h = rmsnorm(x, w, None, r)
        return layernorm(y, w, b) * 2 + h

    return f


def _norm_args(m, n, xdt, wdt):
    """(x, r, w, b) and the upstream gradient."""
    args = [
        _rand((m, n), TD[xdt], 0),
        _rand((m, n), TD[xdt], 1),
        _rand((n,), TD[wdt], 2),
        _rand((n,), TD[wdt], 3),
    ]
    return args, _rand((m, n), TD[xdt], 4)


def _check_norms(out_c, a1, out_e, a2, m, n):
    # compiled == eager (same kernels; the glue ops may be fused by inductor)
    close(out_c, out_e, f"compiled y {m}x{n}")
    for i, (g1, g2) in enumerate(zip(a1, a2)):
        close(g1.grad, g2.grad, f"compiled grad {i} {m}x{n}", m if i >= 2 else 1)


def _softmax_ce():
    from quack_kernels.ops import cross_entropy, softmax

    def f(x, t, w):
        return (
            (softmax(x) * 3).sum()
            + cross_entropy(x, t, weight=w, label_smoothing=0.1)
            + cross_entropy(x, t, reduction="sum")
        )

    return f


def _softmax_ce_args(m, n, xdt):
    x = _rand((m, n), TD[xdt], 0, scale=2)
    return x, torch.randint(0, n, (m,), device="cuda"), torch.rand(n, device="cuda") + 0.1


def _check_softmax_ce(lc, x1, le, x2, x, t, w, m, n, xdt):
    # fp32 sums of outputs rounded to xdt (softmax's y): xdt's tolerance, 100 rows' atol
    close(lc, le, f"compiled loss {m}x{n}", 100, rounded_to=TD[xdt])
    close(x1.grad, x2.grad, f"compiled dlogits {m}x{n}")
    xr = leaf(x.float())
    ref = (
        (torch.softmax(xr, -1) * 3).sum()
        + torch.nn.functional.cross_entropy(xr, t, weight=w, label_smoothing=0.1)
        + torch.nn.functional.cross_entropy(xr, t, reduction="sum")
    )
    R.assert_close(lc, ref, f"loss {m}x{n}", n=n, rows=m * n, rounded_to=TD[xdt])


@pytest.mark.parametrize(
    "xdt,wdt", [("bfloat16", "float32"), ("float16", "float16"), ("float32", "bfloat16")]
)
def test_compile_fullgraph_norms(xdt, wdt):
    f = _norms()
    cf = _compiled(f, "aot_eager")
    for m, n in COMPILE_NS:
        args, dy = _norm_args(m, n, xdt, wdt)
        a1, a2 = [leaf(a) for a in args], [leaf(a) for a in args]
        out_c = cf(*a1)
        out_c.backward(dy)
        out_e = f(*a2)
        out_e.backward(dy)
        _check_norms(out_c, a1, out_e, a2, m, n)


@pytest.mark.parametrize("xdt", DTYPES)
def test_compile_fullgraph_softmax_cross_entropy(xdt):
    f = _softmax_ce()
    cf = _compiled(f, "aot_eager")
    for m, n in COMPILE_NS:
        x, t, w = _softmax_ce_args(m, n, xdt)
        x1, x2 = leaf(x), leaf(x)
        lc = cf(x1, t, w)
        lc.backward()
        le = f(x2, t, w)
        le.backward()
        _check_softmax_ce(lc, x1, le, x2, x, t, w, m, n, xdt)


def test_compile_fullgraph_inductor_every_op():
    """Every op, forward and backward, in ONE Inductor graph (16-bit input, fp32 weight)."""

    norms, softmax_ce = _norms(), _softmax_ce()

    def f(x, r, w, b, xs, t, cw):
        return norms(x, r, w, b), softmax_ce(xs, t, cw)

    cf = _compiled(f, "inductor")
    for m, n in COMPILE_NS:
        args, dy = _norm_args(m, n, "bfloat16", "float32")
        x, t, w = _softmax_ce_args(m, n, "bfloat16")
        a1, a2 = [leaf(a) for a in args], [leaf(a) for a in args]
        x1, x2 = leaf(x), leaf(x)
        out_c, lc = cf(*a1, x1, t, w)
        torch.autograd.backward([out_c, lc], [dy, None])  # None: the loss is a scalar
        out_e, le = f(*a2, x2, t, w)
        torch.autograd.backward([out_e, le], [dy, None])
        _check_norms(out_c, a1, out_e, a2, m, n)
        _check_softmax_ce(lc, x1, le, x2, x, t, w, m, n, "bfloat16")


def test_opcheck_on_gpu():
    """torch's opcheck with the real CUDA implementations."""
    from quack_kernels import ops as _ops  # noqa: F401

    q = torch.ops.quack_kernels
    x = _rand((7, 668), torch.bfloat16, 0).requires_grad_()
    w = _rand((668,), torch.float32, 1).requires_grad_()
    t = torch.randint(0, 668, (7,), device="cuda")
    for op, args in [
        (q.rmsnorm_fwd.default, (x, w, None, None, 1e-6)),
        (q.layernorm_fwd.default, (x, w, w, 1e-5)),
        (q.softmax_fwd.default, (x,)),
        (q.cross_entropy_fwd.default, (x, t, w.detach(), -100, 0.1)),
    ]:
        res = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in res.values()), (op, res)
