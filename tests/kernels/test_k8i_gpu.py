"""GPU tier: round 8's LayerNorm forward class (issue 14 part 6; benchmarks/tune_k8i.py): 16-bit
rows of one 256-thread CTA with an even tiling (N = 10240 / 12288 / 14336 / 16384) and an fp32
weight + bias, whose kernel ``_ln_row.ROW_CTA["wide"]`` names (rows a CTA through shared memory:
the last CTA has rows past M when M is not a multiple of them), through the public forward
against float32 torch over M = 1, 7 and several waves of CTAs (odd). Outputs are poisoned with
NaN first (``poison_allocations``), so an unwritten element fails."""

import pytest
from _cases import cuda_rand
from _fixtures import oom_pressure, poison_allocations  # noqa: F401  (fixtures, used by name)

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("poison_allocations", "oom_pressure"),
]


@pytest.mark.parametrize("xdt", ("bfloat16", "float16"))
@pytest.mark.parametrize("n", (10240, 12288, 14336, 16384))
def test_layernorm_fwd_fp32_wb_row_cta_class(xdt, n):
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
