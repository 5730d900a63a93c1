"""CPU tier: which large-row paths the kernels pick (pure planning, no GPU, no cutlass).

The paths themselves compile in CI through manifests/tests.toml (softmax_bwd at 262144:
rows in shared memory; rmsnorm_fwd / layernorm_fwd bf16 262144 with fp32 weights: the
ring forward; rmsnorm_bwd bf16 131074 fp32 w: the weight in shared memory with a tail)
and run on the GPU tier (tests/kernels/test_training_gpu.py, test_kernels_gpu.py)."""

import pytest
from quack_kernels._norm_bwd import bwd_plan, w_smem_ok
from quack_kernels._norm_fwd import SMEM_BYTES, ring_cfg
from quack_kernels._plan import plan_rows


def _ring(kind="rms", dtype="bfloat16", n=262144, w=True, b=False, res=False, wdt="float32", tune=None):
    return ring_cfg(kind, dtype, n, w, b, res, wdt, tune or {})


def test_ring_forward_only_for_16_cta_rows_and_fits_shared_memory():
    cfg = _ring()
    assert cfg is not None and cfg["stages"] >= 2 and cfg["cp_async_wb"] is False
    plan = plan_rows(262144, 16, budget=64)
    assert plan.cluster_n == 16 and plan.even
    assert plan.tile_n * 4 + cfg["stages"] * plan.tile_n * 2 <= SMEM_BYTES
    ln = _ring("layer", b=True, wdt="same")
    assert ln is not None and ln["cp_async_wb"] is True
    ln32 = _ring("layer", b=True)
    assert ln32 is not None and 2 * plan.tile_n * 4 + ln32["stages"] * plan.tile_n * 2 <= SMEM_BYTES


@pytest.mark.parametrize(
    "kw",
    [
        dict(wdt="same"),  # RMSNorm with same-width weights: one row tile per CTA is faster
        dict(n=65536),  # clusters of 4: the ring lost there
        dict(n=262143),  # odd N: no column predicate in the ring
        dict(res=True),
        dict(w=False, b=False),
        dict(kind="layer", dtype="float32", b=True),  # fp32 w + b + 2 stages do not fit
        dict(tune={"ring": False}),
    ],
)
def test_ring_forward_not_taken(kw):
    assert _ring(**kw) is None


def test_ring_forward_tune_knobs():
    cfg = _ring(n=65536, wdt="same", tune={"ring_min_cluster": 4, "ring_same": True, "ring_clusters": 28})
    assert cfg is not None and cfg["clusters"] == 28
    assert _ring(tune={"stages": 2})["stages"] == 2


@pytest.mark.parametrize(
    "dtype, n, staged",
    [
        ("bfloat16", 262144, True),
        ("bfloat16", 65536, True),
        ("float16", 262144, True),
        ("bfloat16", 16384, False),  # 2 CTAs a row: measured slower staged
        ("bfloat16", 32768, False),
        ("bfloat16", 131074, False),  # odd N
        ("float32", 262144, False),  # 2 x 64 KiB a CTA
    ],
)
def test_softmax_bwd_rows_in_shared_memory(dtype, n, staged):
    rr = pytest.importorskip("quack_kernels._rowreduce")  # imports cutlass
    width = {"float32": 32, "float16": 16, "bfloat16": 16}[dtype]
    assert rr.smem_rows_ok(plan_rows(n, width, budget=32), width, 2) is staged


@pytest.mark.parametrize("n, staged", [(262144, True), (131074, True), (65536, False), (4096, False)])
def test_norm_bwd_weight_in_shared_memory_for_16_cta_rows(n, staged):
    assert w_smem_ok(bwd_plan("bfloat16", n)) is staged
    assert w_smem_ok(bwd_plan("bfloat16", n), {"w_smem": not staged}) is (not staged)
