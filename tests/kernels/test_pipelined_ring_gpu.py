"""GPU tier: the pipelined ring forward (kernels/_ring_pipe.py), the tuning table's
LayerNorm forward for 16-bit rows over 16 CTAs with an fp32 weight / bias (N =
163840 / 196608 / 262144) and for same-dtype rows at N = 262144, through the public forward
against float32 torch. M = 1 (one CTA cluster, no second row in flight), 7 (one row a
cluster of the 7-cluster grid) and 401 (57 or 58 rows a cluster: the pipeline's steady
state, and clusters whose last row has no successor at different iterations). Outputs are
poisoned with NaN first (``poison_allocations``), so an unwritten element fails."""

import pytest
from _cases import cuda_rand
from _fixtures import oom_pressure, poison_allocations  # noqa: F401  (fixtures, used by name)

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("poison_allocations", "oom_pressure"),
]

MS = (1, 7, 401)


def _check(x, w, b):
    from quack_kernels import _reference as R
    from quack_kernels.layernorm import layernorm_fwd

    y, mean, rstd = layernorm_fwd(x, w, b, 1e-5)
    R.check_layernorm_fwd(x, w, b, 1e-5, y=y, mean=mean, rstd=rstd)


@pytest.mark.parametrize("xdt", ("bfloat16", "float16"))
@pytest.mark.parametrize("n", (163840, 196608, 262144))
def test_layernorm_fwd_fp32_wb_pipelined_ring(xdt, n):
    dt = getattr(torch, xdt)
    for m in MS:
        x = cuda_rand((m, n), dt, 0, shift=3.0)  # a mean far from 0
        _check(x, cuda_rand((n,), torch.float32, 1), cuda_rand((n,), torch.float32, 2))


@pytest.mark.parametrize(("has_w", "has_b"), ((True, False), (False, True)))
def test_layernorm_fwd_fp32_weight_or_bias_alone(has_w, has_b):
    """The bias-in-registers kernel without a bias (the weight alone in shared memory) and
    without a weight (nothing in shared memory but x)."""
    n = 262144
    for m in MS:
        x = cuda_rand((m, n), torch.bfloat16, 0, shift=3.0)
        w = cuda_rand((n,), torch.float32, 1) if has_w else None
        b = cuda_rand((n,), torch.float32, 2) if has_b else None
        _check(x, w, b)


@pytest.mark.parametrize("xdt", ("bfloat16", "float16"))
def test_layernorm_fwd_same_dtype_pipelined_ring(xdt):
    """Same-dtype w + b at 262144 (w and b in shared memory, 4 x stages); 196608 keeps the
    x-in-shared-memory kernel, checked beside it."""
    dt = getattr(torch, xdt)
    for n in (262144, 196608):
        for m in MS:
            x = cuda_rand((m, n), dt, 0, shift=3.0)
            _check(x, cuda_rand((n,), dt, 1), cuda_rand((n,), dt, 2))


@pytest.mark.parametrize("xdt", ("bfloat16", "float16"))
@pytest.mark.parametrize("has_b", (False, True))
def test_rmsnorm_fwd_fp32_weight_pipelined_ring_over_clusters_of_8(xdt, has_b):
    """RMSNorm at N = 262144 with an fp32 weight (+ bias): the pipelined ring over 8 CTAs of
    512 threads a row, w / b in registers (the table's "wide/cluster16" row); 15 clusters, so M = 7
    leaves clusters without a row and 401 gives 26 or 27 rows a cluster."""
    from quack_kernels import _reference as R
    from quack_kernels.rmsnorm import rmsnorm_fwd

    dt = getattr(torch, xdt)
    n = 262144
    for m in MS:
        x = cuda_rand((m, n), dt, 0, shift=1.0)
        w = cuda_rand((n,), torch.float32, 1)
        b = cuda_rand((n,), torch.float32, 2) if has_b else None
        y, rstd, _ = rmsnorm_fwd(x, w, b, eps=1e-6)
        R.check_rmsnorm_fwd(x, w, b, None, 1e-6, y=y, rstd=rstd)
