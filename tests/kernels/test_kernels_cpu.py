"""CPU tier: every kernel compiles for sm_90a through quack's cache (compile worker ->
.o export -> load back), with no GPU. Also input validation that needs no GPU."""

import importlib
import os

import pytest
from _cases import COMPILE_FNS, CPU_NS, DTYPES, VARIANTS
from _fixtures import kernel_cache  # noqa: F401  (a fixture, used by name)

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

CASES = [(k, dt, n, v) for k, vs in VARIANTS.items() for dt in DTYPES for n in CPU_NS for v in vs[:1]]


def _fn(kernel):
    mod, name = COMPILE_FNS[kernel]
    return getattr(importlib.import_module(mod), name)


@pytest.mark.usefixtures("kernel_cache")
@pytest.mark.parametrize("kernel,dtype,n,variant", CASES, ids=[f"{k}-{dt}-{n}" for k, dt, n, _ in CASES])
def test_compile_export_load(kernel, dtype, n, variant):
    fn = _fn(kernel)(dtype=dtype, n=n, **variant)
    assert callable(fn)


def test_registry_names():
    from quack import registry

    for mod in {m for m, _ in COMPILE_FNS.values()}:
        importlib.import_module(mod)
    names = set(registry.all_specs())
    assert set(COMPILE_FNS) <= names


def test_kernel_modules_import_without_torch_or_cutlass():
    import subprocess
    import sys

    code = (
        "import sys; import quack_kernels.rmsnorm, quack_kernels.softmax, quack_kernels.layernorm, "
        "quack_kernels.cross_entropy; bad=[m for m in ('torch','cutlass') if m in sys.modules]; "
        "assert not bad, bad"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_plan_strategies():
    from quack_kernels._plan import plan_rows

    assert plan_rows(256, 16).threads_per_row < 32  # sub-warp rows
    assert plan_rows(1000, 16).cluster_n == 1
    assert plan_rows(4096, 16).threads_per_row == 64
    assert plan_rows(16384, 16).threads_per_row == 256  # one block per row
    assert plan_rows(65536, 16).cluster_n == 4  # cluster + DSMEM
    assert plan_rows(262144, 16).cluster_n == 16
    for n in (256, 1000, 4096, 16384, 65536, 262144, 333 * 8, 257 * 4):
        for w in (16, 32):
            p = plan_rows(n, w)
            assert p.tile_n * p.cluster_n >= n
            assert (p.cluster_n - 1) * p.tile_n < n


def test_bad_n_param():
    from quack_kernels.rmsnorm import compile_rmsnorm_fwd

    from quack.errors import ParamError

    with pytest.raises(ParamError):
        compile_rmsnorm_fwd(dtype="bfloat16", n=0)
    with pytest.raises(ParamError):
        compile_rmsnorm_fwd(dtype="bfloat16", n=262145)
    with pytest.raises(ParamError):
        compile_rmsnorm_fwd(dtype="int8", n=1024)


def test_validation_cpu_tensor():
    torch = pytest.importorskip("torch")
    from quack_kernels.rmsnorm import rmsnorm_fwd
    from quack_kernels.softmax import softmax_fwd

    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        rmsnorm_fwd(torch.randn(4, 1024))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        softmax_fwd([1.0, 2.0])
