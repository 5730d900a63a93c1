"""The kernels' reference hooks (``reference=`` of their ``@jit_cache`` registrations; what
``quack verify --run`` calls with a configuration's params): each runs the torch-facing op on
generated inputs (37 rows, every variant its params name) and asserts with the family's
``_reference.check_*``, the same function the GPU tests use.

Not among the kernels' sources: the kernel modules name this module only in strings, so an
edit here leaves the kernels' cache keys alone. torch is imported inside functions.
"""

M = 37  # rows: not a multiple of any row tile, so the last tile is partial


def _dtypes(params):
    import torch

    dt = getattr(torch, params["dtype"])
    name = params.get("weight_dtype", "same")
    return dt, (dt if name in (None, "same") else getattr(torch, name))


def _randn(shape, dt, g, shift=0.0, scale=1.0):
    import torch

    return (torch.randn(shape, generator=g, device=g.device) * scale + shift).to(dt)


def _gen(device, seed=0):
    """A seeded generator on ``device``: the inputs are drawn where they are used. Drawn on
    the CPU and copied over, they took 12.6 s of `quack verify --run`'s 33.5 s over the
    shipped manifests on the H200 (cProfile: torch.randn, 2,698 calls)."""
    import torch

    return torch.Generator(device=device).manual_seed(seed)


def verify_rmsnorm_fwd(params: dict, device) -> None:
    from . import _reference as R
    from .rmsnorm import rmsnorm_fwd

    dt, wdt = _dtypes(params)
    n, g = params["n"], _gen(device)
    x = _randn((M, n), dt, g)
    w = _randn(n, wdt, g) if params.get("has_weight", True) else None
    b = _randn(n, wdt, g) if params.get("has_bias") else None
    r = _randn((M, n), dt, g) if params.get("has_residual") else None
    y, rstd, ro = rmsnorm_fwd(x, w, b, r, 1e-6)
    R.check_rmsnorm_fwd(x, w, b, r, 1e-6, y=y, rstd=rstd, residual_out=ro)


def verify_rmsnorm_bwd(params: dict, device) -> None:
    import torch

    from . import _reference as R
    from .rmsnorm import rmsnorm_bwd

    dt, wdt = _dtypes(params)
    n, g = params["n"], _gen(device)
    x, dy = _randn((M, n), dt, g), _randn((M, n), dt, g)
    w = _randn(n, wdt, g) if params.get("has_weight", True) else None
    b = torch.zeros(n, device=device, dtype=wdt) if params.get("has_bias") else None
    rstd = R.rmsnorm_fwd_ref(x, None, None, None, 1e-6)["rstd"]
    dx, dw, *db = rmsnorm_bwd(x, w, dy, rstd, b)
    got = dict(dx=dx, dw=dw) | (dict(db=db[0]) if b is not None else {})
    R.check_rmsnorm_bwd(x, w, dy, 1e-6, b.dtype if b is not None else None, **got)


def verify_layernorm_fwd(params: dict, device) -> None:
    from . import _reference as R
    from .layernorm import layernorm_fwd

    dt, wdt = _dtypes(params)
    n, g = params["n"], _gen(device)
    x = _randn((M, n), dt, g, shift=0.5)
    w = _randn(n, wdt, g) if params.get("has_weight", True) else None
    b = _randn(n, wdt, g) if params.get("has_bias", True) else None
    y, mean, rstd = layernorm_fwd(x, w, b, 1e-5)
    R.check_layernorm_fwd(x, w, b, 1e-5, y=y, mean=mean, rstd=rstd)


def verify_layernorm_bwd(params: dict, device) -> None:
    from . import _reference as R
    from .layernorm import layernorm_bwd

    dt, wdt = _dtypes(params)
    n, g = params["n"], _gen(device)
    x = _randn((M, n), dt, g, shift=0.5)
    dy = _randn((M, n), dt, g)
    w = _randn(n, wdt, g) if params.get("has_weight", True) else None
    b = _randn(n, wdt, g) if params.get("has_bias", True) else None
    fwd = R.layernorm_fwd_ref(x, None, None, 1e-5)
    dx, dw, db = layernorm_bwd(x, w, dy, fwd["mean"], fwd["rstd"], b)
    R.check_layernorm_bwd(x, w, b, dy, 1e-5, dx=dx, dw=dw, db=db)


def verify_softmax_fwd(params: dict, device) -> None:
    from . import _reference as R
    from .softmax import softmax_fwd

    dt, _ = _dtypes(params)
    x = _randn((M, params["n"]), dt, _gen(device), scale=3.0)
    R.check_softmax_fwd(x, y=softmax_fwd(x))


def verify_softmax_bwd(params: dict, device) -> None:
    import torch

    from . import _reference as R
    from .softmax import softmax_bwd

    dt, _ = _dtypes(params)
    n, g = params["n"], _gen(device)
    y = torch.softmax(_randn((M, n), torch.float32, g), -1).to(dt)
    dy = _randn((M, n), dt, g)
    R.check_softmax_bwd(dy, y, dx=softmax_bwd(dy, y))


def _ce_inputs(params, device):
    """logits (scale 2), targets with every 5th row ignored, and the weight / label_smoothing
    of the configuration's smoothing variant."""
    import torch

    dt, _ = _dtypes(params)
    n, g = params["n"], _gen(device)
    x = _randn((M, n), dt, g, scale=2.0)
    t = torch.randint(0, n, (M,), generator=g, device=g.device)
    t[::5] = -100
    v = params.get("smoothing", "none")
    kw: dict = {}
    if v != "none":
        w = torch.rand(n, generator=_gen(device, 1), device=device) + 0.1 if v == "weighted" else None
        kw = dict(weight=w, label_smoothing=0.1)
    return x, t, kw


def verify_cross_entropy_fwd(params: dict, device) -> None:
    from . import _reference as R
    from .cross_entropy import cross_entropy_fwd

    x, t, kw = _ce_inputs(params, device)
    loss, lse = cross_entropy_fwd(x, t, -100, **kw)
    R.check_cross_entropy_fwd(x, t, -100, **kw, loss=loss, lse=lse)


def verify_cross_entropy_bwd(params: dict, device) -> None:
    import torch

    from . import _reference as R
    from .cross_entropy import cross_entropy_bwd

    x, t, kw = _ce_inputs(params, device)
    dloss = torch.rand(M, generator=_gen(device, 2), device=device)
    lse = R.cross_entropy_fwd_ref(x, t, -100)["lse"]
    dx = cross_entropy_bwd(x, t, dloss, lse, -100, **kw)
    R.check_cross_entropy_bwd(x, t, dloss, -100, **kw, dx=dx)


# --------------------------------------------------------------------------- benchmarks
# ``bench=`` of the registrations (``quack tune``): the torch-facing op on inputs of m rows
# made once on the device, returned as a zero-argument call to time. The configuration the
# call runs is the caller's (``quack.tuning.use_config``), through the cache like any call.


def _dev_randn(shape, dt, device, seed, shift=0.0, scale=1.0):
    return _randn(shape, dt, _gen(device, seed), shift=shift, scale=scale)


def _norm_inputs(params, m, device, shift=0.0):
    dt, wdt = _dtypes(params)
    n = params["n"]
    x = _dev_randn((m, n), dt, device, 0, shift=shift)
    w = _dev_randn(n, wdt, device, 1) if params.get("has_weight", True) else None
    return dt, wdt, n, x, w


def bench_rmsnorm_fwd(params: dict, m: int, device):
    from .rmsnorm import rmsnorm_fwd

    dt, wdt, n, x, w = _norm_inputs(params, m, device)
    b = _dev_randn(n, wdt, device, 2) if params.get("has_bias") else None
    r = _dev_randn((m, n), dt, device, 3) if params.get("has_residual") else None
    return lambda: rmsnorm_fwd(x, w, b, r, 1e-6)


def bench_rmsnorm_bwd(params: dict, m: int, device):
    import torch

    from .rmsnorm import rmsnorm_bwd

    dt, wdt, n, x, w = _norm_inputs(params, m, device)
    dy = _dev_randn((m, n), dt, device, 4)
    b = torch.zeros(n, device=device, dtype=wdt) if params.get("has_bias") else None
    rstd = torch.rand(m, device=device) + 0.5
    return lambda: rmsnorm_bwd(x, w, dy, rstd, b)


def bench_layernorm_fwd(params: dict, m: int, device):
    from .layernorm import layernorm_fwd

    dt, wdt, n, x, w = _norm_inputs(params, m, device, shift=0.5)
    b = _dev_randn(n, wdt, device, 2) if params.get("has_bias", True) else None
    return lambda: layernorm_fwd(x, w, b, 1e-5)


def bench_layernorm_bwd(params: dict, m: int, device):
    import torch

    from .layernorm import layernorm_bwd

    dt, wdt, n, x, w = _norm_inputs(params, m, device, shift=0.5)
    dy = _dev_randn((m, n), dt, device, 4)
    b = _dev_randn(n, wdt, device, 2) if params.get("has_bias", True) else None
    mean, rstd = torch.zeros(m, device=device), torch.rand(m, device=device) + 0.5
    return lambda: layernorm_bwd(x, w, dy, mean, rstd, b)


def bench_softmax_fwd(params: dict, m: int, device):
    from .softmax import softmax_fwd

    dt, _ = _dtypes(params)
    x = _dev_randn((m, params["n"]), dt, device, 0, scale=3.0)
    return lambda: softmax_fwd(x)


def bench_softmax_bwd(params: dict, m: int, device):
    import torch

    from .softmax import softmax_bwd

    dt, _ = _dtypes(params)
    y = torch.softmax(_dev_randn((m, params["n"]), torch.float32, device, 0), -1).to(dt)
    dy = _dev_randn((m, params["n"]), dt, device, 1)
    return lambda: softmax_bwd(dy, y)


def _ce_bench_inputs(params, m, device):
    import torch

    dt, _ = _dtypes(params)
    n = params["n"]
    x = _dev_randn((m, n), dt, device, 0, scale=2.0)
    t = torch.randint(0, n, (m,), device=device)
    v = params.get("smoothing", "none")
    kw: dict = {}
    if v != "none":
        w = torch.rand(n, device=device) + 0.1 if v == "weighted" else None
        kw = dict(weight=w, label_smoothing=0.1)
    return x, t, kw


def bench_cross_entropy_fwd(params: dict, m: int, device):
    from .cross_entropy import cross_entropy_fwd

    x, t, kw = _ce_bench_inputs(params, m, device)
    return lambda: cross_entropy_fwd(x, t, -100, **kw)


def bench_cross_entropy_bwd(params: dict, m: int, device):
    import torch

    from .cross_entropy import cross_entropy_bwd

    x, t, kw = _ce_bench_inputs(params, m, device)
    dloss = torch.rand(m, device=device)
    lse = torch.logsumexp(x.float(), -1)
    return lambda: cross_entropy_bwd(x, t, dloss, lse, -100, **kw)
