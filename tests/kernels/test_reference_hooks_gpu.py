"""The kernels' reference hooks on a GPU (what `quack verify --run` calls): each runs its
kernel on generated inputs and asserts against torch; and `quack verify --run` over every
shipped manifest. The CPU side is in test_reference_hooks.py."""

import importlib
import os
import subprocess
import sys

import pytest
from _cases import COMPILE_FNS
from _fixtures import kernel_cache  # noqa: F401  (a fixture, used by name)
from test_reference_hooks import ROOT, _gpu, _spec


@pytest.mark.skipif(not _gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", sorted(COMPILE_FNS))
def test_reference_hook_passes_on_gpu(kernel, dtype):
    spec = _spec(kernel)
    mod, _, fn = spec.reference.partition(":")
    getattr(importlib.import_module(mod), fn)(spec.bind((), {"dtype": dtype, "n": 4096}), "cuda")


@pytest.mark.skipif(not _gpu(), reason="needs a CUDA GPU")
@pytest.mark.timeout(3600)
def test_verify_run_passes_over_every_shipped_manifest(request):
    """`quack verify --run` over every shipped manifest (manifests/*.toml), built first into
    the session's cache (a no-op for what README command 2 or the GPU run built): every
    configuration's reference hook passes, with the references and tolerances the GPU tests
    use (issue 24: the two had drifted into 43 false "wrong result" reports).

    The verify run is in line, in the GPU unit: started beside the other tests instead (a
    background job from the end of collection, or a unit of its own under xdist) the warm
    tier got slower on the H200, not faster (one process: not done in 150 s against 93 s in
    line; -n auto: 103 s), the GPU time-slicing between the processes' contexts. The build
    before it is CPU work only: in a one-process run it starts in the background as
    collection ends (tests/kernels/_fixtures.py), so on a cold cache it overlaps the tests."""
    from _fixtures import finish_shipped_build, shipped_manifests

    cache = str(request.getfixturevalue("kernel_cache"))
    # the build: started as collection ended when this run is one process (_fixtures.py)
    rc, out = finish_shipped_build(cache, 2400)
    assert rc == 0, f"quack build failed:\n{out[-6000:]}"
    r = subprocess.run(
        # verify --run's own default loaders (three: the fastest measured on one GPU, quack_build/cli/verify.py)
        [sys.executable, "-m", "quack_build", "verify", "--run", *shipped_manifests()],
        cwd=ROOT,
        env=dict(os.environ, QUACK_CACHE_DIR=cache),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"quack verify failed:\n{out[-6000:]}"
    assert "all good" in out and "reference run" in out, out[-3000:]
