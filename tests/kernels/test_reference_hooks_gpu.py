"""The kernels' reference hooks on a GPU (what `quack verify --run` calls): each runs its
kernel on generated inputs and asserts against torch; and `quack verify --run` over every
shipped manifest. The CPU side is in test_reference_hooks.py."""

import importlib

import pytest
import verify_all
from _cases import COMPILE_FNS
from _fixtures import kernel_cache  # noqa: F401  (a fixture, used by name)
from test_reference_hooks import _gpu, _spec


@pytest.mark.skipif(not _gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", sorted(COMPILE_FNS))
def test_reference_hook_passes_on_gpu(kernel, dtype):
    spec = _spec(kernel)
    mod, _, fn = spec.reference.partition(":")
    getattr(importlib.import_module(mod), fn)(spec.bind((), {"dtype": dtype, "n": 4096}), "cuda")


@pytest.mark.skipif(not _gpu(), reason="needs a CUDA GPU")
@pytest.mark.timeout(3700)
def test_verify_run_passes_over_every_shipped_manifest(request):
    """`quack verify --run` over every shipped manifest (manifests/*.toml), built first into
    the session's cache (a no-op for what README command 2 or the GPU run built): every
    configuration's reference hook passes, with the references and tolerances the GPU tests
    use (issue 24: the two had drifted into 43 false "wrong result" reports). The job
    started when collection ended, beside the other tests (tests/verify_all.py)."""
    plugin = request.config.pluginmanager.get_plugin(verify_all.PLUGIN)
    job = plugin.take(str(request.getfixturevalue("kernel_cache")))
    failed, out = job.outcome(timeout=sum(limit for _, limit in verify_all.steps()))
    assert not failed, f"quack {failed}:\n{out[-6000:]}"
    assert "all good" in out and "reference run" in out, out[-3000:]
