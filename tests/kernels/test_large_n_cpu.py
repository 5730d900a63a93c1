"""CPU tier: which large-row paths the kernels pick (pure planning, no GPU, no cutlass).

The paths themselves compile in CI through manifests/tests.toml (softmax_bwd at 262144:
rows in shared memory; rmsnorm_fwd / layernorm_fwd bf16 65536 / 131072 / 262144 with
fp32 weights: the ring forward; rmsnorm_bwd bf16 131074 fp32 w: the weight in shared
memory with a tail) and run on the GPU tier (tests/kernels/test_training_gpu.py,
test_kernels_gpu.py)."""

import logging

import pytest
from quack_kernels import _norm_fwd, _occupancy
from quack_kernels._norm_bwd import bwd_plan, w_smem_ok
from quack_kernels._norm_fwd import (
    RING_MIN_CLUSTER,
    SM_SMEM,
    SMEM_MAX,
    WIDE_PERM,
    reducer_bytes,
    ring_cfg,
    ring_plan,
)
from quack_kernels._plan import plan_rows


def _ring(kind="rms", dtype="bfloat16", n=262144, w=True, b=False, res=False, wdt="float32", tune=None):
    return ring_cfg(kind, dtype, n, w, b, res, wdt, tune or {})


def _fits(cfg, n, count, wbits):
    """The configuration's shared memory: reduction buffers, weight / bias, x stages, within
    a CTA's share of the SM (``ctas_per_sm``)."""
    plan = ring_plan(n, "bfloat16", cfg)
    want = reducer_bytes(plan) + count * plan.tile_n * wbits // 8 + cfg["stages"] * plan.tile_n * 2
    per_cta = min(SMEM_MAX, SM_SMEM // cfg["ctas_per_sm"] - 1024)
    return cfg["smem_bytes"] == want and want <= per_cta


def test_ring_forward_for_16_cta_rows_and_fits_shared_memory():
    cfg = _ring()
    assert cfg is not None and cfg["stages"] >= 2 and cfg["cp_async_wb"] is False
    plan = plan_rows(262144, 16, budget=64)
    assert plan.cluster_n == 16 and plan.even
    assert _fits(cfg, 262144, 1, 32)
    ln = _ring("layer", b=True, wdt="same")
    assert ln is not None and ln["cp_async_wb"] is True and _fits(ln, 262144, 2, 16)
    ln32 = _ring("layer", b=True)
    assert ln32 is not None and _fits(ln32, 262144, 2, 32)
    # fp32 weight + bias (128 KiB a CTA): a third x stage only within the 227 KiB budget
    assert _ring("layer", b=True, tune={"smem_kb": 220})["stages"] == 2
    big = _ring("layer", b=True, tune={"smem_kb": 227})
    assert big["stages"] == 3 and _fits(big, 262144, 2, 32)


@pytest.mark.parametrize(
    "kind, wdt, key",
    [("rms", "float32", "rms_wide"), ("layer", "same", "layer"), ("layer", "float32", "layer_wide")],
)
@pytest.mark.parametrize("n, cluster", [(65536, 4), (131072, 8), (262144, 16)])
def test_ring_forward_cluster_sizes_follow_the_defaults(kind, wdt, key, n, cluster):
    assert plan_rows(n, 16, budget=64).cluster_n == cluster
    cfg = _ring(kind, n=n, b=kind == "layer", wdt=wdt)
    assert (cfg is not None) is (cluster >= RING_MIN_CLUSTER[key])
    if cfg is not None:
        assert _fits(cfg, n, 1 + int(kind == "layer"), 32 if wdt == "float32" else 16)


@pytest.mark.parametrize(
    "kw",
    [
        dict(wdt="same"),  # RMSNorm with same-width weights: one row tile per CTA is faster
        dict(n=32768),  # clusters of 2
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
    assert _ring(tune={"wide_perm": True})["wide_perm"] is True
    assert _ring(tune={"wide_perm": False})["wide_perm"] is False
    # the default layout of a wide weight is per kind
    assert _ring()["wide_perm"] is WIDE_PERM["rms"]
    assert _ring("layer", b=True)["wide_perm"] is WIDE_PERM["layer"]


def test_ring_one_stage_shapes():
    """The ring's shape knobs ("ctas_per_sm", "ring_budget"): 2 CTAs per SM split the SM's shared
    memory (one x stage beside the fp32 weight slice), 128 elements a thread halve the
    cluster (clusters of 2 at N = 65536); both fit, with a single stage."""
    two = _ring(n=65536, tune={"ctas_per_sm": 2, "ring_budget": 64})
    assert two["ctas_per_sm"] == 2 and two["stages"] == 1 and _fits(two, 65536, 1, 32)
    assert ring_plan(65536, "bfloat16", two).cluster_n == 4
    wide = _ring(n=65536, tune={"ring_budget": 128, "ctas_per_sm": 1})
    assert wide["budget"] == 128 and wide["stages"] == 1 and _fits(wide, 65536, 1, 32)
    plan = ring_plan(65536, "bfloat16", wide)
    assert plan.cluster_n == 2 and plan.elems_per_thread == 128 and plan.even
    # fp32 weight + bias (128 KiB a CTA at clusters of 4) leave no stage at 2 CTAs per SM
    assert _ring("layer", n=65536, b=True, tune={"ctas_per_sm": 2}) is None
    # the plain ring keeps at least 2 stages: a stage limit of 1 is refused there
    assert _ring(n=65536, tune={"stages": 1, "ring_budget": 64, "ctas_per_sm": 1}) is None


def test_ring_shape_knobs_apply():
    """The measured ring shape for RMSNorm fp32 w at N = 65536 (128 elements a thread, the
    spread weight: a candidate of ``rmsnorm.search_space``)
    yields a ring that fits (clusters of 2); without knobs every size keeps 1x64."""
    cfg = _ring(n=65536, tune={"ring_budget": 128, "wide_perm": True})
    assert (cfg["ctas_per_sm"], cfg["budget"]) == (1, 128) and _fits(cfg, 65536, 1, 32)
    assert cfg["wide_perm"] is True
    plain = _ring(n=65536)
    assert (plain["ctas_per_sm"], plain["budget"]) == (1, 64) and plain["wide_perm"] is WIDE_PERM["rms"]
    assert _ring()["budget"] == 64 and _ring()["ctas_per_sm"] == 1


def test_ring_clusterless_only_for_one_full_cta_a_row():
    """The ring on rows of one CTA (LayerNorm N = 16384): a knob / default per key, only for
    256-thread plans (N = 8192 runs 128 threads a row: the row-tile kernel stays)."""
    on = {"ring_clusterless": True}
    cfg = _ring("layer", n=16384, b=True, wdt="same", tune=on)
    assert cfg is not None and cfg["stages"] == 4 and _fits(cfg, 16384, 2, 16)
    assert ring_plan(16384, "bfloat16", cfg).cluster_n == 1
    two = _ring("layer", n=16384, b=True, wdt="same", tune={**on, "ctas_per_sm": 2})
    assert two["stages"] == 1 and _fits(two, 16384, 2, 16)
    assert _ring("layer", n=8192, b=True, wdt="same", tune=on) is None
    assert _ring("layer", n=16384, b=True, wdt="same", tune={"ring_clusterless": False}) is None
    # clusters of 2 stay below RING_MIN_CLUSTER whatever the clusterless flag says
    assert _ring("layer", n=32768, b=True, wdt="same", tune=on) is None


def test_rmsnorm_x_smem_plans():
    """The row-tile RMSNorm forward stages x in shared memory only for one even row a CTA
    over a cluster from ``X_SMEM_MIN_CLUSTER`` up, without a residual (knob overrides)."""
    from quack_kernels import _rms_fwd

    def ok(n, res=False, **tune):
        return _rms_fwd.x_smem_ok(plan_rows(n, 16, budget=64), 16, res, tune)

    assert ok(262144, x_smem=True) and ok(65536, x_smem=True)
    assert not ok(262144, res=True, x_smem=True)
    assert not ok(262143, x_smem=True)  # odd: a column predicate
    assert not ok(16384, x_smem=True)  # no cluster
    assert not _rms_fwd.x_smem_ok(plan_rows(262144, 32, budget=64), 32, False, {})  # fp32 rows
    assert ok(262144, x_smem_min_cluster=16) and not ok(131072, x_smem_min_cluster=16)
    assert ok(262144) is (16 >= _rms_fwd.X_SMEM_MIN_CLUSTER)


class _Dev:
    """Stands in for the torch device: ring_grid only passes it to the (patched) helpers."""


@pytest.fixture
def fake_gpu(monkeypatch):
    """132 SMs; the occupancy query answers from ``answers`` (cluster size -> clusters or
    an exception) and records its calls."""
    from quack_kernels import _torch as kt

    calls = []
    answers = {}

    def query(index, cluster_n, threads, smem):
        calls.append((index, cluster_n, threads, smem))
        a = answers[cluster_n]
        if isinstance(a, Exception):
            raise a
        return a

    monkeypatch.setattr(kt, "sm_count", lambda device: 132)
    monkeypatch.setattr(kt, "device_index", lambda device: 0)
    monkeypatch.setattr(_occupancy, "query_max_active_clusters", query)
    _occupancy.max_active_clusters.cache_clear()
    yield answers, calls
    _occupancy.max_active_clusters.cache_clear()


def test_ring_grid_is_the_occupancy_calculators_cached_per_shape(fake_gpu):
    answers, calls = fake_gpu
    answers.update({4: 30, 16: 7})
    cfg4 = _ring("layer", n=65536, b=True, wdt="same", tune={"ring_min_cluster": 4})
    assert _norm_fwd.ring_grid(32768, "bfloat16", 65536, cfg4, _Dev()) == 30
    assert _norm_fwd.ring_grid(32768, "bfloat16", 65536, cfg4, _Dev()) == 30
    # asked once, with the kernel's shape and the CTA's whole share of the SM's shared memory
    assert calls == [(0, 4, 256, max(cfg4["smem_bytes"], SM_SMEM - 1024))]
    assert _norm_fwd.ring_grid(5, "bfloat16", 65536, cfg4, _Dev()) == 5  # never more CTAs than rows
    cfg16 = _ring()
    assert _norm_fwd.ring_grid(4096, "bfloat16", 262144, cfg16, _Dev()) == 7
    assert len(calls) == 2
    pinned = _ring(tune={"ring_clusters": 5})
    assert _norm_fwd.ring_grid(4096, "bfloat16", 262144, pinned, _Dev()) == 5
    assert _norm_fwd.ring_grid(4096, "bfloat16", 262144, None, _Dev()) == 1
    assert len(calls) == 2


def test_ring_grid_two_ctas_per_sm_and_clusterless(fake_gpu):
    """2 CTAs per SM: the occupancy calculator is asked with the halved shared memory (it
    answers for 2 a SM); without a cluster the grid is SMs x CTAs per SM, no query."""
    answers, calls = fake_gpu
    answers.update({4: 66})
    two = _ring(n=65536, tune={"ctas_per_sm": 2, "ring_budget": 64})
    assert _norm_fwd.ring_grid(32768, "bfloat16", 65536, two, _Dev()) == 66
    assert calls == [(0, 4, 256, SM_SMEM // 2 - 1024)] and two["smem_bytes"] <= SM_SMEM // 2 - 1024
    on = {"ring_clusterless": True}
    one = _ring("layer", n=16384, b=True, wdt="same", tune=on)
    assert _norm_fwd.ring_grid(32768, "bfloat16", 16384, one, _Dev()) == 132
    both = _ring("layer", n=16384, b=True, wdt="same", tune={**on, "ctas_per_sm": 2})
    assert _norm_fwd.ring_grid(32768, "bfloat16", 16384, both, _Dev()) == 264
    assert _norm_fwd.ring_grid(100, "bfloat16", 16384, both, _Dev()) == 100
    assert len(calls) == 1


def test_ring_grid_without_an_answer_estimates_and_warns_once(fake_gpu, log_records):
    answers, calls = fake_gpu
    answers.update({4: RuntimeError("CUDA driver error 999"), 16: 0})
    cfg4 = _ring("layer", n=65536, b=True, wdt="same", tune={"ring_min_cluster": 4})
    with log_records("quack_kernels", logging.WARNING) as records:
        for _ in range(3):
            assert _norm_fwd.ring_grid(32768, "bfloat16", 65536, cfg4, _Dev()) == 132 // 4 - 1
        # an answer of 0 (the shape does not fit) falls back too: the launch says why
        assert _norm_fwd.ring_grid(4096, "bfloat16", 262144, _ring(), _Dev()) == 132 // 16 - 1
    warnings = [r for r in records if "occupancy query failed" in r.getMessage()]
    assert len(warnings) == 1 and "CUDA driver error 999" in warnings[0].getMessage()
    assert len(calls) == 2


def test_occupancy_query_without_a_gpu_falls_back():
    # no driver on the CPU tier: the real query raises, the cached wrapper answers the estimate
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():  # seen on the H200: the driver answers (30), not the estimate
        pytest.skip("a GPU answers the occupancy query here (the GPU tier checks that answer)")
    _occupancy.max_active_clusters.cache_clear()
    try:
        assert _occupancy.max_active_clusters(0, 4, 256, 200 * 1024, 31) == 31
    finally:
        _occupancy.max_active_clusters.cache_clear()


def test_occupancy_probe_is_valid_ptx(tmp_path):
    import shutil
    import subprocess

    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("no ptxas")
    from quack.runtime.occupancy import probe_ptx

    ptx = probe_ptx(9, 0)
    assert ptx.endswith(b"\0") and ptx.count(b"\0") == 1  # the driver reads a C string
    src = tmp_path / "probe.ptx"
    src.write_bytes(ptx[:-1])
    out = subprocess.run([ptxas, "-arch=sm_90", str(src), "-o", str(tmp_path / "probe.cubin")], timeout=60)
    assert out.returncode == 0


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
    from quack_kernels.softmax import bwd_budget

    width = {"float32": 32, "float16": 16, "bfloat16": 16}[dtype]
    assert (
        rr.smem_rows_ok(plan_rows(n, width, budget=bwd_budget(dtype, n, _sm_knobs(dtype, n))), width, 2)
        is staged
    )


def _sm_knobs(dtype, n):
    """The softmax backward's derived configuration (the tuning table's, sm_90a)."""
    from quack_kernels import softmax

    return softmax.compile_softmax_bwd.spec.bind((dtype, n), {}, arch="sm_90a")["config"].knobs()


def test_softmax_bwd_budget_by_row_length():
    from quack_kernels import softmax

    assert softmax.bwd_budget("bfloat16", 4096, _sm_knobs("bfloat16", 4096)) == softmax.BWD_BUDGET_SMALL
    assert softmax.bwd_budget("float16", 8192, _sm_knobs("float16", 8192)) == softmax.BWD_BUDGET_SMALL
    assert softmax.bwd_budget("bfloat16", 16384, _sm_knobs("bfloat16", 16384)) == softmax.BWD_BUDGET_MID
    assert softmax.bwd_budget("bfloat16", 8193, _sm_knobs("bfloat16", 8193)) == softmax.BWD_BUDGET_MID
    for dtype, n in (("bfloat16", 4095), ("bfloat16", 16385), ("float32", 4096), ("float32", 16384)):
        assert softmax.bwd_budget(dtype, n, _sm_knobs(dtype, n)) == 32
    assert softmax.bwd_budget("float32", 100, {"bwd_budget": 16}) == 16


@pytest.mark.parametrize("n, staged", [(262144, True), (131074, True), (65536, False), (4096, False)])
def test_norm_bwd_weight_in_shared_memory_for_16_cta_rows(n, staged):
    assert w_smem_ok(bwd_plan("bfloat16", n)) is staged
    assert w_smem_ok(bwd_plan("bfloat16", n), {"w_smem": not staged}) is (not staged)
