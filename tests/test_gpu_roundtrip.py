"""On a GPU: a kernel compiled by a worker, loaded from the cache in a fresh
process, runs and matches torch. Skipped without a GPU."""

import json
import os
import subprocess
import sys

import pytest
import toykernels
from conftest import requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]


def _check(fn, dtype):
    import torch

    x = torch.randn(1_000_003, device="cuda", dtype=dtype)
    y = torch.full_like(x, float("nan"))
    fn(x, y, 2.5)
    torch.cuda.synchronize()
    from quack_kernels import _reference as R

    # y = x * 2.5 + 1 in fp32, rounded once to dtype: the kernels' shared tolerance of dtype
    R.assert_close(y, x.float() * 2.5 + 1.0, "y", n=1, dtype=dtype)


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
def test_worker_compiled_kernel_runs(quack_settings, dtype_name):
    import torch

    fn = toykernels.toy_scale(dtype_name, 256, True)
    _check(fn, getattr(torch, dtype_name))


_FRESH = """
import json, sys, torch
import toykernels
fn = toykernels.toy_scale("bfloat16", 256, True)
x = torch.randn(4097, device="cuda", dtype=torch.bfloat16)
y = torch.full_like(x, float("nan"))
fn(x, y, 2.5)
torch.cuda.synchronize()
err = ((x.float() * 2.5 + 1.0) - y.float()).abs().max().item()
print(json.dumps({"err": err, "compiles": len(toykernels.COMPILES),
                  "how": toykernels.toy_scale.usage()[0]["how"], "cute": "cutlass.cute" in sys.modules}))
"""


def test_prebuilt_kernel_runs_in_fresh_process(quack_settings, cache_dir):
    toykernels.toy_scale("bfloat16", 256, True)
    env = dict(os.environ, QUACK_CACHE_DIR=str(cache_dir), QUACK_MODE="prebuilt", QUACK_ARCH="sm_90a")
    r = subprocess.run([sys.executable, "-c", _FRESH], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["err"] < 0.05 and out["compiles"] == 0 and out["how"] == "so" and out["cute"] is False
