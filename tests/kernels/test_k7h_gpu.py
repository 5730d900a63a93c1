"""GPU tier: round 7's mixed-precision norm forwards (issue 14 part 6; the sweep,
benchmarks/tune_k7h.py, is at commit e3992f2) against float32 torch. Each knob set of
``_ln_row.ROW_SMALL_VARIANTS`` (LayerNorm rows of 3072 / 4096 on the one-CTA plan, four rows a
CTA, w / b loaded ahead), compiled with ``.raw`` and its knobs and called directly, over M = 1,
7 and several waves of CTAs (odd: the last CTA of a multi-row kernel has rows past M); then the
public forwards with an fp32 weight / bias at the shapes round 7 measured, through whatever the
default tables name. Outputs are poisoned with NaN first (``poison_allocations``),
so an unwritten element fails."""

import pytest
from _cases import cuda_rand
from _fixtures import oom_pressure, poison_allocations  # noqa: F401  (fixtures, used by name)

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("poison_allocations", "oom_pressure"),
]


def _cases():
    from quack_kernels import _ln_row

    # the 4096 rows measured, 3072 the class's other row length
    return [("layer", n, label, kn) for label, kn in _ln_row.ROW_SMALL_VARIANTS.items() for n in (3072, 4096)]


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


def _load(compiled, tmp_path):
    """The compiled kernel exported to an object and loaded as the cache's objects are (the
    path the benchmarks time)."""
    from quack.runtime import loader

    obj = tmp_path / "k.o"
    compiled.export_to_c(object_file_path=str(obj), function_name="func")
    so = obj.with_suffix(".so")
    try:
        loader.link(obj, so, tmp_path)
        return loader.load_so(so)
    except Exception:  # noqa: BLE001 - no C compiler: CuTe DSL's own loader
        return loader.load_object(obj)


@pytest.mark.parametrize("case", _cases(), ids=lambda c: f"{c[0]}-{c[1]}-{c[2].replace(' ', '_')}")
def test_round7_variants_match_torch(case, monkeypatch, tmp_path):
    from quack_kernels import layernorm, rmsnorm

    kind, n, _label, kn = case
    mod = layernorm if kind == "layer" else rmsnorm
    off = {"row_cta": False} if kind == "layer" else {"wide_fwd": False}
    monkeypatch.setattr(mod, "_TUNE", dict(kn) | off)
    if kind == "layer":
        compiled = layernorm.compile_layernorm_fwd.raw("bfloat16", n, True, True, "float32")
    else:
        compiled = rmsnorm.compile_rmsnorm_fwd.raw("bfloat16", n, True, False, False, "float32")
    fn, _module = _load(compiled, tmp_path)
    for m in _ms(n):
        x = cuda_rand((m, n), torch.bfloat16, 0, shift=3.0)  # a mean far from 0
        w = cuda_rand((n,), torch.float32, 1)
        b = cuda_rand((n,), torch.float32, 2)
        y = torch.full_like(x, float("nan"))
        mean = torch.full((m,), float("nan"), device="cuda")
        rstd = torch.full((m,), float("nan"), device="cuda")
        if kind == "layer":
            fn(x, w, b, y, mean, rstd, 1e-5, 1)
        else:
            fn(x, w, None, None, y, None, rstd, 1e-6, 1)
        torch.cuda.synchronize()
        _check(kind, x, w, b, y, rstd, mean)


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
