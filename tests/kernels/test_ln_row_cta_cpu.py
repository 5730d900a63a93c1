"""CPU tier: the LayerNorm forward of 16-bit rows of one 256-thread CTA (issue 14 part 6,
round 4; ``_ln_row.ROW_CTA``, benchmarks/tune_k4c.py): which rows a default knob set
reaches, the plans the knobs make, and that every measured knob set compiles for sm_90a
(the GPU side: tests/kernels/test_ln_row_cta_gpu.py)."""

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from quack_kernels import _ln_row, layernorm  # noqa: E402


@pytest.fixture
def knobs(monkeypatch):
    """Set ``ROW_CTA`` (labels) / ``_TUNE`` for one test (restored after it)."""

    def set_(row_cta=None, tune=None):
        monkeypatch.setattr(_ln_row, "ROW_CTA", row_cta or {"same": "", "wide": ""})
        monkeypatch.setattr(_ln_row, "ROW_CTA_BY_N", {})  # round 8's N = 16384 key: out
        monkeypatch.setattr(_ln_row, "ROW_CLUSTER", {})
        monkeypatch.setattr(_ln_row, "ROW_CLUSTER_BY_N", {})  # round 9's N = 262144 key: out
        monkeypatch.setattr(_ln_row, "ROW_SMALL", {})  # round 7's table (rows of 2+ a CTA): out
        monkeypatch.setattr(layernorm, "_TUNE", dict(tune or {}))

    return set_


def test_row_cta_defaults_name_measured_variants():
    for kind in ("same", "wide"):
        label = _ln_row.ROW_CTA[kind]
        assert label == "" or label in _ln_row.ROW_CTA_VARIANTS


def test_row_cta_defaults_reach_only_16_bit_rows_of_one_256_thread_cta(knobs):
    knobs({"same": "xs mb5", "wide": "rowtile"})
    xs5 = _ln_row.ROW_CTA_VARIANTS["xs mb5"]
    assert xs5["x_smem"] and xs5["x_min_blocks"] == 5
    for dt in ("bfloat16", "float16"):
        for n in (10240, 12288, 16384):
            assert _ln_row.fwd_knobs(dt, n, "same", {}) == xs5
            assert _ln_row.fwd_knobs(dt, n, "float32", {}) == {"ring": False}
        # a column tail (not an even tiling), one warp / 128-thread rows, cluster rows
        for n in (12000, 16385, 4096, 8192, 65536, 262144):
            assert _ln_row.fwd_knobs(dt, n, "same", {}) == {}
            assert _ln_row.fwd_knobs(dt, n, "float32", {}) == {}
    assert _ln_row.fwd_knobs("float32", 16384, "same", {}) == {}
    # _TUNE over the defaults; "row_cta": False leaves them out (round 3's kernels)
    knobs({"same": "xs mb5", "wide": ""})
    t3 = {"x_min_blocks": 3}
    assert _ln_row.fwd_knobs("bfloat16", 16384, "same", t3) == xs5 | {"x_min_blocks": 3}
    assert _ln_row.fwd_knobs("bfloat16", 16384, "float32", t3) == {"x_min_blocks": 3}
    knobs({"same": "xs mb5", "wide": "xs mb5"})
    assert _ln_row.fwd_knobs("bfloat16", 16384, "same", {"row_cta": False}) == {"row_cta": False}


def test_wide_default_turns_the_ring_off_through_the_wrappers_config(knobs):
    knobs()
    assert layernorm.fwd_ring_cfg("bfloat16", 16384, True, True, "float32") is not None  # round 3
    knobs({"same": "", "wide": "xs mb4"})
    assert layernorm.fwd_ring_cfg("bfloat16", 16384, True, True, "float32") is None
    # the cluster rows keep theirs
    assert layernorm.fwd_ring_cfg("bfloat16", 65536, True, True, "float32") is not None


def test_row_plan_threads_knob():
    p = _ln_row.row_plan(16384, 16, {"threads": 512})
    assert (p.threads_per_row, p.num_threads, p.cluster_n, p.nvec, p.vec) == (512, 512, 1, 4, 8)
    assert p.even and p.elems_per_thread == 32
    for n in (4096, 16385, 65536):  # not a 256-thread one-CTA even row: unchanged
        assert _ln_row.row_plan(n, 16, {"threads": 512}) == _ln_row.row_plan(n, 16, {})
    assert _ln_row.row_plan(16384, 16, {}).num_threads == 256


def test_x_smem_ok_gates():
    on = {"x_smem": True}
    plan = _ln_row.row_plan(16384, 16, {})
    assert _ln_row.x_smem_ok(plan, 16, on) and not _ln_row.x_smem_ok(plan, 16, {})
    assert not _ln_row.x_smem_ok(_ln_row.row_plan(16385, 16, {}), 16, on)  # tail
    assert not _ln_row.x_smem_ok(_ln_row.row_plan(65536, 16, {}), 16, on)  # cluster
    assert not _ln_row.x_smem_ok(_ln_row.row_plan(16384, 32, {}), 32, on)  # fp32 rows


@pytest.mark.parametrize("label", sorted(_ln_row.ROW_CTA_VARIANTS))
@pytest.mark.parametrize("wdt, w, b", [("same", True, True), ("float32", True, True), ("same", False, False)])
def test_every_variant_compiles_for_sm90(knobs, label, wdt, w, b):
    """Every measured knob set (the sweep's and the defaults' table), at N = 16384, with a
    16-bit / fp32 / no weight and bias (the ring off, as the defaults do for fp32)."""
    knobs(tune=_ln_row.ROW_CTA_VARIANTS[label] | {"ring": False, "row_cta": False})
    fn = layernorm.compile_layernorm_fwd.raw("bfloat16", 16384, w, b, wdt)
    assert fn is not None
