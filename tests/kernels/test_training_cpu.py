"""CPU tier for the training features (issue 14): any N in [1, 262144], weight_dtype,
LayerNorm backward, cross-entropy weights / label smoothing, torch.library custom ops.

No GPU: the new configurations compile for sm_90a through quack's cache; the custom ops
register, their fake implementations give the right shapes and dtypes (on meta tensors,
where torch's opcheck runs without a GPU), and torch.compile(fullgraph=True) traces every
op forward and backward into one graph."""

import importlib
import os

import pytest
from _cases import DTYPES
from _fixtures import kernel_cache  # noqa: F401  (a fixture, used by name)

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

# (kernel, dtype, n, extra params): row lengths off the 16-byte vector, below 256, odd;
# mixed-precision weights; LayerNorm backward; cross-entropy smoothing variants.
TRAINING_CASES = [
    ("rmsnorm_fwd", "bfloat16", 1, dict(weight_dtype="float32")),
    ("rmsnorm_fwd", "float16", 192, dict(weight_dtype="bfloat16")),
    ("rmsnorm_fwd", "float32", 4100, dict(weight_dtype="bfloat16")),
    ("rmsnorm_fwd", "bfloat16", 65536, dict(weight_dtype="float32")),
    ("rmsnorm_bwd", "bfloat16", 4100, dict()),  # cp.async of 8 bytes (was an IR error)
    ("rmsnorm_bwd", "bfloat16", 668, dict(has_bias=True, weight_dtype="float32")),
    ("rmsnorm_bwd", "float16", 65536, dict(weight_dtype="float32")),
    ("layernorm_fwd", "float32", 3, dict(weight_dtype="float16")),
    ("layernorm_fwd", "bfloat16", 16385, dict(weight_dtype="float32")),
    ("layernorm_bwd", "float32", 1, dict()),
    ("layernorm_bwd", "bfloat16", 1000, dict(weight_dtype="float32")),
    ("layernorm_bwd", "float16", 16384, dict()),
    ("layernorm_bwd", "bfloat16", 131074, dict(has_weight=False, has_bias=False)),
    ("layernorm_bwd", "bfloat16", 262144, dict(weight_dtype="float32")),
    ("softmax_fwd", "float16", 255, dict()),
    ("softmax_bwd", "bfloat16", 100, dict()),
    ("cross_entropy_fwd", "bfloat16", 668, dict()),  # was an IR error (cp.async.cg 8 bytes)
    ("cross_entropy_fwd", "float16", 50257, dict()),
    ("cross_entropy_fwd", "bfloat16", 1000, dict(smoothing="weighted")),
    ("cross_entropy_fwd", "float32", 131074, dict(smoothing="uniform")),
    ("cross_entropy_bwd", "bfloat16", 8, dict(smoothing="weighted")),
    ("cross_entropy_bwd", "float16", 32003, dict(smoothing="uniform")),
]

COMPILE = {
    "rmsnorm_fwd": ("quack_kernels.rmsnorm", "compile_rmsnorm_fwd"),
    "rmsnorm_bwd": ("quack_kernels.rmsnorm", "compile_rmsnorm_bwd"),
    "layernorm_fwd": ("quack_kernels.layernorm", "compile_layernorm_fwd"),
    "layernorm_bwd": ("quack_kernels.layernorm", "compile_layernorm_bwd"),
    "softmax_fwd": ("quack_kernels.softmax", "compile_softmax_fwd"),
    "softmax_bwd": ("quack_kernels.softmax", "compile_softmax_bwd"),
    "cross_entropy_fwd": ("quack_kernels.cross_entropy", "compile_cross_entropy_fwd"),
    "cross_entropy_bwd": ("quack_kernels.cross_entropy", "compile_cross_entropy_bwd"),
}


@pytest.mark.usefixtures("kernel_cache")
@pytest.mark.parametrize(
    "kernel,dtype,n,extra",
    TRAINING_CASES,
    ids=[f"{k}-{d}-{n}-{'-'.join(map(str, e.values())) or 'base'}" for k, d, n, e in TRAINING_CASES],
)
def test_training_configs_compile_export_load(kernel, dtype, n, extra):
    mod, name = COMPILE[kernel]
    fn = getattr(importlib.import_module(mod), name)(dtype=dtype, n=n, **extra)
    assert callable(fn)


# ------------------------------------------------------------------- params and plans


def test_every_n_from_1_to_262144_is_accepted_and_planned():
    import quack_kernels.cross_entropy  # noqa: F401  (registers its kernels)
    import quack_kernels.layernorm  # noqa: F401
    import quack_kernels.rmsnorm  # noqa: F401
    import quack_kernels.softmax  # noqa: F401
    from quack_kernels._plan import N_MAX, plan_rows

    from quack import registry

    for name in COMPILE:
        spec = registry.get(name)
        assert spec.bind((), {"dtype": "bfloat16", "n": 1})["n"] == 1
        assert spec.bind((), {"dtype": "bfloat16", "n": N_MAX})["n"] == N_MAX
        for bad in (0, N_MAX + 1):
            with pytest.raises(Exception, match="n"):
                spec.bind((), {"dtype": "bfloat16", "n": bad})
    ns = list(range(1, 600)) + [667, 668, 1001, 4100, 16385, 32003, 50257, 131074, 200000, 262143, 262144]
    for n in ns:
        for w in (16, 32):
            for budget in (32, 64):
                p = plan_rows(n, w, budget=budget)
                assert n % p.vec == 0 and p.vec * w <= 128
                assert p.tile_n * p.cluster_n >= n  # the row is covered
                assert (p.cluster_n - 1) * p.tile_n < n  # no CTA of a cluster is idle
                assert p.num_threads % p.threads_per_row == 0


def test_weight_dtype_param_is_canonical_and_in_the_key():
    import quack_kernels.rmsnorm  # noqa: F401

    from quack import registry

    spec = registry.get("rmsnorm_fwd")
    same = spec.bind((), {"dtype": "bfloat16", "n": 4096})
    assert same["weight_dtype"] == "same"
    assert spec.bind((), {"dtype": "bfloat16", "n": 4096, "weight_dtype": None}) == same
    f32 = spec.bind((), {"dtype": "bfloat16", "n": 4096, "weight_dtype": "fp32"})
    assert f32["weight_dtype"] == "float32"
    assert spec.key(same, "sm_90a") != spec.key(f32, "sm_90a")
    with pytest.raises(Exception, match="weight_dtype"):
        spec.bind((), {"dtype": "bfloat16", "n": 4096, "weight_dtype": "int8"})


def test_cross_entropy_smoothing_param():
    import quack_kernels.cross_entropy  # noqa: F401

    from quack import registry

    spec = registry.get("cross_entropy_bwd")
    assert spec.bind((), {"dtype": "float16", "n": 7})["smoothing"] == "none"
    with pytest.raises(Exception, match="smoothing"):
        spec.bind((), {"dtype": "float16", "n": 7, "smoothing": "label"})


# ------------------------------------------------------------------- custom ops

torch = pytest.importorskip("torch")

OPS = (
    "rmsnorm_fwd",
    "rmsnorm_bwd",
    "layernorm_fwd",
    "layernorm_bwd",
    "softmax_fwd",
    "softmax_bwd",
    "cross_entropy_fwd",
    "cross_entropy_bwd",
)
TORCH_DT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _ops():
    from quack_kernels import ops as _ops

    return _ops


def test_custom_ops_register():
    _ops()
    for name in OPS:
        assert hasattr(torch.ops.quack_kernels, name), name
        assert isinstance(getattr(torch.ops.quack_kernels, name).default, torch._ops.OpOverload)


def _meta(shape, dt, grad=False):
    return torch.empty(shape, device="meta", dtype=dt, requires_grad=grad)


@pytest.mark.parametrize("xdt", DTYPES)
@pytest.mark.parametrize("wdt", DTYPES)
def test_norm_fake_impls_shapes_and_dtypes(xdt, wdt):
    q = torch.ops.quack_kernels
    _ops()
    x, w, b = _meta((3, 5, 668), TORCH_DT[xdt]), _meta((668,), TORCH_DT[wdt]), _meta((668,), TORCH_DT[wdt])
    y, rstd, ro = q.rmsnorm_fwd(x, w, b, x, 1e-6)
    assert (y.shape, y.dtype, rstd.shape, rstd.dtype) == (x.shape, x.dtype, (3, 5), torch.float32)
    assert ro.shape == x.shape and ro.dtype == x.dtype
    assert q.rmsnorm_fwd(x, w, None, None, 1e-6)[2].numel() == 0  # no residual: empty
    dx, dw, db = q.rmsnorm_bwd(x, w, x, rstd, b)
    assert (dx.shape, dx.dtype, dw.shape, dw.dtype, db.dtype) == (x.shape, x.dtype, (668,), w.dtype, b.dtype)
    y, mean, rstd = q.layernorm_fwd(x, w, b, 1e-5)
    assert (y.dtype, mean.shape, mean.dtype, rstd.dtype) == (x.dtype, (3, 5), torch.float32, torch.float32)
    dx, dw, db = q.layernorm_bwd(x, w, x, mean, rstd, None)
    assert (dx.dtype, dw.dtype, dw.shape, db.numel()) == (x.dtype, w.dtype, (668,), 0)


@pytest.mark.parametrize("dt", DTYPES)
def test_softmax_and_cross_entropy_fake_impls(dt):
    q = torch.ops.quack_kernels
    _ops()
    x = _meta((6, 7, 1001), TORCH_DT[dt])
    assert q.softmax_fwd(x).shape == x.shape and q.softmax_bwd(x, x).dtype == x.dtype
    t = torch.empty((6, 7), device="meta", dtype=torch.int64)
    loss, lse = q.cross_entropy_fwd(x, t, _meta((1001,), torch.float32), -100, 0.1)
    assert (loss.shape, loss.dtype, lse.shape, lse.dtype) == ((6, 7), torch.float32, (6, 7), torch.float32)
    dx = q.cross_entropy_bwd(x, t, loss, lse, None, -100, 0.0)
    assert dx.shape == x.shape and dx.dtype == x.dtype


def test_opcheck_on_meta_tensors():
    """torch's opcheck (schema, autograd registration, fake tensor, AOT dispatch) on meta
    inputs: the fake implementations run, no GPU needed."""
    _ops()
    q = torch.ops.quack_kernels
    x = _meta((5, 100), torch.bfloat16, grad=True)
    w = _meta((100,), torch.float32, grad=True)
    t = torch.zeros(5, device="meta", dtype=torch.int64)
    checks = [
        (q.rmsnorm_fwd.default, (x, w, None, None, 1e-6)),
        (q.layernorm_fwd.default, (x, w, w, 1e-5)),
        (q.softmax_fwd.default, (x,)),
        (q.cross_entropy_fwd.default, (x, t, None, -100, 0.0)),
        (q.cross_entropy_fwd.default, (x, t, w.detach(), -100, 0.1)),
    ]
    for op, args in checks:
        res = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in res.values()), (op, res)


def test_torch_compile_fullgraph_forward_and_backward_on_meta():
    """Every op under torch.compile(fullgraph=True): one graph, no break, and the backward
    graph calls the registered backward ops (traced on meta tensors, aot_eager)."""
    from quack_kernels.ops import cross_entropy, layernorm, rmsnorm, softmax
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    x = _meta((4, 7, 100), torch.bfloat16, grad=True)
    r = _meta((4, 7, 100), torch.bfloat16, grad=True)
    w = _meta((100,), torch.float32, grad=True)
    b = _meta((100,), torch.float32, grad=True)
    t = torch.zeros(28, dtype=torch.int64, device="meta")

    def f(x, r, w, b):
        y, h = rmsnorm(x, w, None, r)
        z = softmax(layernorm(y + h, w, b))
        return cross_entropy(z.reshape(28, 100), t, weight=w.detach(), label_smoothing=0.1)

    cnt = CompileCounterWithBackend("aot_eager")
    out = torch.compile(f, fullgraph=True, backend=cnt)(x, r, w, b)
    out.backward()
    assert cnt.frame_count == 1
    assert x.grad.shape == x.shape and x.grad.dtype == x.dtype
    assert w.grad.dtype == torch.float32 and b.grad.shape == (100,) and r.grad.shape == r.shape
    called = {str(n.target) for g in cnt.graphs for n in g.graph.nodes if n.op == "call_function"}
    for op in ("rmsnorm_fwd", "layernorm_fwd", "softmax_fwd", "cross_entropy_fwd"):
        assert any(op in c for c in called), (op, called)


def test_gemm_operands_are_cast_to_the_autocast_dtype_before_the_op_runs():
    """Inside CUDA autocast the GEMM's a and b reach the op's implementation in the autocast
    dtype (bias and c as given: the kernel adds them in fp32), whether the op is called
    through ``ops.gemm`` or by name, and a trace (torch.compile's AOT tracing: make_fx) holds
    the casts before the op; outside autocast nothing is cast. Fake CUDA tensors, so
    no GPU is needed: autocast is switched on directly, since torch.autocast("cuda") turns
    itself off on a machine without CUDA. The GPU test checks the bits and the gradients."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = _ops()
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.quack_kernels.gemm.default:
                seen.append(tuple(t.dtype if isinstance(t, torch.Tensor) else t for t in args[:4]))
            return func(*args, **(kwargs or {}))

    f32 = torch.float32
    was = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    try:
        with FakeTensorMode(), Record():
            a, b = torch.empty(64, 32, device="cuda"), torch.empty(32, 48, device="cuda")
            bias, c = torch.empty(48, device="cuda"), torch.empty(64, 48, device="cuda")
            for dt in (torch.bfloat16, torch.float16):
                torch.set_autocast_enabled("cuda", True)
                torch.set_autocast_dtype("cuda", dt)
                seen.clear()
                assert ops.gemm(a, b, bias=bias, c=c).dtype == dt
                assert (
                    torch.ops.quack_kernels.gemm(a, b.bfloat16(), bias, None, "none", f32, 1.0).dtype == f32
                )
                assert seen == [(dt, dt, f32, f32), (dt, dt, f32, None)]
            torch.set_autocast_enabled("cuda", False)
            seen.clear()
            with pytest.raises(TypeError, match="float32"):  # refused, uncast (the fake checks)
                ops.gemm(a, b)
            assert seen == [(f32, f32, None, None)]
        # what torch.compile's AOT tracing records under autocast: the casts, then the op
        from torch.fx.experimental.proxy_tensor import make_fx

        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", torch.float16)
        gm = make_fx(lambda a, b: ops.gemm(a, b), tracing_mode="fake")(a, b)
        calls = [(str(n.target), n.kwargs.get("dtype")) for n in gm.graph.nodes if n.op == "call_function"]
        cast = ("aten._to_copy.default", torch.float16)
        assert calls == [cast, cast, ("quack_kernels.gemm.default", None)], calls
        # Above the autocast key (a pre-dispatch trace sees what Dynamo's graph holds) the
        # casts must be there too, of the region's dtype: with them only in the op's
        # AutocastCUDA kernel this graph held the op alone, and torch 2.11 reused a graph
        # compiled under bfloat16 autocast under float16 (bfloat16 output, on the H200).
        for dt in (torch.bfloat16, torch.float16):
            torch.set_autocast_dtype("cuda", dt)
            gm = make_fx(lambda a, b: ops.gemm(a, b), tracing_mode="fake", pre_dispatch=True)(a, b)
            calls = [
                (str(n.target), n.args[1] if str(n.target) == "aten.to.dtype" else None)
                for n in gm.graph.nodes
                if n.op == "call_function"
            ]
            cast = ("aten.to.dtype", dt)
            assert calls == [cast, cast, ("quack_kernels.gemm.default", None)], calls
    finally:
        torch.set_autocast_enabled("cuda", was[0])
        torch.set_autocast_dtype("cuda", was[1])


def test_cpu_tensor_error_unchanged_through_the_ops():
    from quack_kernels.ops import cross_entropy, rmsnorm

    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        rmsnorm(torch.randn(4, 100))
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(torch.randn(4, 100), torch.zeros(4, dtype=torch.int64), reduction="avg")


def test_only_default_device_contexts_leave_the_direct_eager_path_open():
    """``_dispatch.direct``'s view of function modes: none, or only default-device contexts
    (a ``torch.device`` block, ``torch.set_default_device``), leave the direct path open;
    any other function mode, alone or beside one, closes it (it must see the op)."""
    from quack_kernels._dispatch import modes_allow_direct

    class Passing(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert modes_allow_direct()
    with torch.device("cpu"):
        assert modes_allow_direct()
        with Passing():
            assert not modes_allow_direct()
    torch.set_default_device("cpu")
    try:
        assert modes_allow_direct()
    finally:
        torch.set_default_device(None)
    with Passing():
        assert not modes_allow_direct()
    assert modes_allow_direct()
