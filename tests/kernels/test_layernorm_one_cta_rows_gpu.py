"""GPU tier: the LayerNorm forward of 16-bit rows of one 256-thread CTA (the tuning table's
"same/cta256" and "wide/cta256" rows, kernels/tuned/sm_90a.toml) against float32 torch:
the rows they reach (N = 10240 / 12288 / 14336 / 16384) with a 16-bit / fp32 / no weight and
bias, M = 1, 7 and several waves of CTAs (odd: rows a CTA through shared memory leave the
last CTA rows past M). Outputs are poisoned with NaN first (``poison_allocations``), so an
unwritten element fails."""

import pytest
from _cases import cuda_rand
from _fixtures import oom_pressure, poison_allocations  # noqa: F401  (fixtures, used by name)

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("poison_allocations", "oom_pressure"),
]


@pytest.mark.parametrize("xdt", ("bfloat16", "float16"))
@pytest.mark.parametrize("affine", ("same", "float32", "weight", "none"))
@pytest.mark.parametrize("n", (10240, 16384))
def test_layernorm_fwd_row_cta(xdt, affine, n):
    from quack_kernels import _reference as R
    from quack_kernels.layernorm import layernorm_fwd

    dt = getattr(torch, xdt)
    big = 4 * torch.cuda.get_device_properties(0).multi_processor_count * 6 + 5
    for m in (1, 7, big):
        x = cuda_rand((m, n), dt, 0, shift=3.0)  # a mean far from 0: the variance's cancellation
        wdt = torch.float32 if affine == "float32" else dt
        w = cuda_rand((n,), wdt, 1) if affine != "none" else None
        b = cuda_rand((n,), wdt, 2) if affine in ("same", "float32") else None
        y, mean, rstd = layernorm_fwd(x, w, b, 1e-5)
        R.check_layernorm_fwd(x, w, b, 1e-5, y=y, mean=mean, rstd=rstd)


@pytest.mark.parametrize("xdt", ("bfloat16", "float16"))
@pytest.mark.parametrize("n", (10240, 12288, 14336, 16384))
def test_layernorm_fwd_fp32_wb_one_cta_rows(xdt, n):
    from quack_kernels import _reference as R
    from quack_kernels.layernorm import layernorm_fwd

    dt = getattr(torch, xdt)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in (1, 7, 3 * sms + 5):  # 3 * 132 + 5 = 401: not a multiple of 2, 3 or 4
        x = cuda_rand((m, n), dt, 0, shift=3.0)  # a mean far from 0
        w = cuda_rand((n,), torch.float32, 1)
        b = cuda_rand((n,), torch.float32, 2)
        y, mean, rstd = layernorm_fwd(x, w, b, 1e-5)
        R.check_layernorm_fwd(x, w, b, 1e-5, y=y, mean=mean, rstd=rstd)
