"""GPU tier: the norm forwards of 16-bit rows with an fp32 weight / bias against float32
torch. Every candidate of ``layernorm.search_space`` for LayerNorm rows of 3072 / 4096 (the
one-CTA plan with four rows a CTA and w / b loaded ahead, and the heuristic's kernel),
through the cache (README command 2's manifests build them) and called directly, over M = 1,
7 and several waves of CTAs (odd: the last CTA of a multi-row kernel has rows past M); then
the public forwards at the measured shapes, through the tuning table's configurations.
Outputs are poisoned with NaN first (``poison_allocations``), so an unwritten element fails."""

import pytest
from _cases import cuda_rand
from _fixtures import oom_pressure, poison_allocations  # noqa: F401  (fixtures, used by name)

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("poison_allocations", "oom_pressure"),
]


SMALL_NS = (3072, 4096)  # the class's two row lengths (4096 measured)


def small_row_candidates(n):
    """``layernorm.search_space`` of the bf16 rows of ``n`` with an fp32 weight and bias."""
    from quack_kernels import layernorm

    p = dict(dtype="bfloat16", n=n, has_weight=True, has_bias=True, weight_dtype="float32")
    return layernorm.search_space(layernorm.compile_layernorm_fwd.spec.bind((), p, arch="sm_90a"))


def _ms(n):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    big = 3 * sms * max(1, 16384 // n) + 5  # several waves of CTAs, odd
    return (1, 7, min(big, (1 << 30) // (4 * n) | 1))


def _check(kind, x, w, b, y, rstd, mean):
    """Against quack_kernels._reference (the RMSNorm kernels here take no bias)."""
    from quack_kernels import _reference as R

    if kind == "layer":
        R.check_layernorm_fwd(x, w, b, 1e-5, y=y, mean=mean, rstd=rstd)
    else:
        R.check_rmsnorm_fwd(x, w, None, None, 1e-6, y=y, rstd=rstd)


@pytest.mark.parametrize("n", SMALL_NS)
@pytest.mark.parametrize("cand", (0, 1))
def test_small_row_candidates_match_torch(n, cand):
    from quack_kernels import layernorm

    cands = small_row_candidates(n)
    assert len(cands) == 2, cands  # the heuristic and the rows kernel: both parametrized here
    fn = layernorm.compile_layernorm_fwd("bfloat16", n, True, True, "float32", config=cands[cand])
    for m in _ms(n):
        x = cuda_rand((m, n), torch.bfloat16, 0, shift=3.0)  # a mean far from 0
        w = cuda_rand((n,), torch.float32, 1)
        b = cuda_rand((n,), torch.float32, 2)
        y = torch.full_like(x, float("nan"))
        mean = torch.full((m,), float("nan"), device="cuda")
        rstd = torch.full((m,), float("nan"), device="cuda")
        fn(x, w, b, y, mean, rstd, 1e-5, 1)
        torch.cuda.synchronize()
        _check("layer", x, w, b, y, rstd, mean)


@pytest.mark.parametrize("xdt", ("bfloat16", "float16"))
@pytest.mark.parametrize(
    ("kind", "n"), (("layer", 3072), ("layer", 4096), ("layer", 16384), ("layer", 262144), ("rms", 262144))
)
def test_public_forwards_with_fp32_weights(xdt, kind, n):
    from quack_kernels.layernorm import layernorm_fwd
    from quack_kernels.rmsnorm import rmsnorm_fwd

    dt = getattr(torch, xdt)
    for m in _ms(n):
        x = cuda_rand((m, n), dt, 0, shift=3.0)
        w = cuda_rand((n,), torch.float32, 1)
        b = cuda_rand((n,), torch.float32, 2)
        if kind == "layer":
            y, mean, rstd = layernorm_fwd(x, w, b, 1e-5)
        else:
            y, rstd, _ = rmsnorm_fwd(x, w, None, None, 1e-6)
            mean = None
        _check(kind, x, w, b, y, rstd, mean)
