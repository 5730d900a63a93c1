"""The cross-entropy kernels' reference hooks (``reference=`` of their ``@jit_cache``
registration; what ``quack verify --run`` calls): each runs the torch-facing op on generated
inputs (every variant of ``smoothing``) and asserts against torch.nn.functional.cross_entropy.

Not among the kernels' sources: cross_entropy.py names this module only in a string, so an
edit here leaves the kernels' cache keys alone. Top level imports only quack_kernels'
cross_entropy (which imports only quack): torch is imported inside functions.
"""

from .cross_entropy import cross_entropy_bwd, cross_entropy_fwd


def _inputs(params, device):
    import torch

    dt = getattr(torch, params["dtype"])
    n = params["n"]
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(37, n, generator=g) * 2).to(device=device, dtype=dt)
    t = torch.randint(0, n, (37,), generator=g)
    t[::5] = -100
    return x, t.to(device)


def _ce_kwargs(params, n, device):
    """weight / label_smoothing for a smoothing variant's reference check."""
    import torch

    v = params.get("smoothing", "none")
    if v == "none":
        return {}
    g = torch.Generator(device="cpu").manual_seed(1)
    w = torch.rand(n, generator=g).to(device) if v == "weighted" else None
    return dict(weight=w, label_smoothing=0.1)


def verify_cross_entropy_fwd(params: dict, device) -> None:
    import torch

    x, t = _inputs(params, device)
    kw = _ce_kwargs(params, x.shape[1], device)
    loss, lse = cross_entropy_fwd(x, t, -100, **kw)
    ref = torch.nn.functional.cross_entropy(x.float(), t, reduction="none", ignore_index=-100, **kw)
    torch.testing.assert_close(loss, ref, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(lse, torch.logsumexp(x.float(), -1), atol=1e-3, rtol=1e-3)


def verify_cross_entropy_bwd(params: dict, device) -> None:
    import torch

    x, t = _inputs(params, device)
    kw = _ce_kwargs(params, x.shape[1], device)
    xr = x.float().requires_grad_()
    torch.nn.functional.cross_entropy(xr, t, reduction="sum", ignore_index=-100, **kw).backward()
    lse = torch.logsumexp(x.float(), -1)
    dx = cross_entropy_bwd(x, t, torch.ones(x.shape[0], device=device), lse, -100, **kw)
    tol = 1e-5 if x.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(dx.float(), xr.grad, atol=tol, rtol=tol * 4)
