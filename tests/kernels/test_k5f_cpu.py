"""CPU tier: round 5's mixed-precision norm knobs (issue 14 part 6; the sweep,
benchmarks/tune_k5f.py, is at commit 6e935f3): which rows each default table reaches, the
gates of the new paths, and that the adopted kernels compile for sm_90a."""

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from quack_kernels import _ln_row, _norm_bwd, layernorm, rmsnorm  # noqa: E402


@pytest.fixture
def tables(monkeypatch):
    """Set the round 5 tables for one test (restored after it)."""

    def set_(wide_fwd=None, row_cluster=None, w_smem=None):
        monkeypatch.setattr(rmsnorm, "WIDE_FWD", dict(wide_fwd or {}))
        monkeypatch.setattr(rmsnorm, "WIDE_FWD_BY_N", {})  # round 9's N = 262144 key: out
        monkeypatch.setattr(rmsnorm, "_TUNE", {})
        monkeypatch.setattr(_ln_row, "ROW_CLUSTER", dict(row_cluster or {}))
        monkeypatch.setattr(_ln_row, "ROW_SMALL", {})  # round 7's table (rows of 2+ a CTA): out
        monkeypatch.setattr(layernorm, "_TUNE", {})
        monkeypatch.setattr(_norm_bwd, "W_SMEM_WIDE_ONE_CTA", dict(w_smem or {"rms": False, "layer": False}))

    return set_


def test_defaults_name_measured_variants():
    for label in rmsnorm.WIDE_FWD.values():
        assert label == "" or label in rmsnorm.WIDE_VARIANTS
    for key, label in _ln_row.ROW_CLUSTER.items():
        assert key.split("@")[0] in ("same", "wide") and (
            label == "" or label in _ln_row.ROW_CLUSTER_VARIANTS
        )
    assert set(_norm_bwd.W_SMEM_WIDE_ONE_CTA) == {"rms", "layer"}


def test_wide_fwd_reaches_only_wide_weights_of_its_cluster_size(tables):
    tables(wide_fwd={"4": "xs2 mb3"})
    xs2 = rmsnorm.WIDE_VARIANTS["xs2 mb3"]
    for dt in ("bfloat16", "float16"):
        assert rmsnorm.fwd_knobs(dt, 65536, "float32", {}) == xs2
        assert rmsnorm.fwd_ring_cfg(dt, 65536, True, False, False, "float32") is None  # the ring is off
        for n in (4096, 16384, 131072, 262144):  # other cluster sizes: untouched
            assert rmsnorm.fwd_knobs(dt, n, "float32", {}) == {}
        assert rmsnorm.fwd_knobs(dt, 65536, "same", {}) == {}
    assert rmsnorm.fwd_knobs("float32", 65536, "same", {}) == {}
    # _TUNE over the table; "wide_fwd": False leaves it out (the sweep's baselines)
    assert rmsnorm.fwd_knobs("bfloat16", 65536, "float32", {"x_min_blocks": 2}) == xs2 | {"x_min_blocks": 2}
    assert rmsnorm.fwd_knobs("bfloat16", 65536, "float32", {"wide_fwd": False}) == {"wide_fwd": False}
    tables()
    assert rmsnorm.fwd_ring_cfg("bfloat16", 65536, True, False, False, "float32") is not None  # round 3


def test_row_cluster_reaches_only_cluster_rows_of_its_kind(tables):
    tables(row_cluster={"wide@16": "xs mb3"})
    want = _ln_row.ROW_CLUSTER_VARIANTS["xs mb3"]
    assert _ln_row.fwd_knobs("bfloat16", 262144, "float32", {}) == want
    assert layernorm.fwd_ring_cfg("bfloat16", 262144, True, True, "float32") is None
    assert layernorm.fwd_ring_cfg("bfloat16", 262144, True, True, "same") is not None
    for n in (4096, 65536, 131072):
        assert _ln_row.fwd_knobs("bfloat16", n, "float32", {}) == {}
    assert _ln_row.fwd_knobs("bfloat16", 262144, "float32", {"row_cta": False}) == {"row_cta": False}


def test_x_smem_over_a_cluster_only_with_its_knob():
    on = {"x_smem": True}
    p = _ln_row.row_plan(262144, 16, {})
    assert p.cluster_n == 16
    assert not _ln_row.x_smem_ok(p, 16, on) and _ln_row.x_smem_ok(p, 16, on | {"x_smem_cluster": True})
    assert not _ln_row.x_smem_ok(_ln_row.row_plan(200000, 16, {}), 16, on | {"x_smem_cluster": True})  # tail


def test_wide_weight_in_shared_memory_on_rows_of_one_cta(tables):
    p4096 = _norm_bwd.bwd_plan("bfloat16", 4096)
    p16384 = _norm_bwd.bwd_plan("bfloat16", 16384)
    assert (p4096.cluster_n, p16384.cluster_n) == (1, 2)
    tables()
    assert not _norm_bwd.w_smem_ok(p4096, {}, True, "rms")
    tables(w_smem={"rms": True, "layer": False})
    assert _norm_bwd.w_smem_ok(p4096, {}, True, "rms")
    assert not _norm_bwd.w_smem_ok(p4096, {}, False, "rms")  # same-width weight
    assert not _norm_bwd.w_smem_ok(p4096, {}, True, "layer")
    assert not _norm_bwd.w_smem_ok(p16384, {}, True, "rms")  # cluster rows: round 2's rule
    assert _norm_bwd.w_smem_ok(_norm_bwd.bwd_plan("bfloat16", 262144), {}, False, "rms")


@pytest.mark.parametrize("label", sorted(rmsnorm.WIDE_VARIANTS))
def test_rmsnorm_wide_variants_compile_for_sm90(tables, label):
    tables()
    rmsnorm._TUNE.update(rmsnorm.WIDE_VARIANTS[label])
    assert rmsnorm.compile_rmsnorm_fwd.raw("bfloat16", 65536, True, False, False, "float32") is not None


@pytest.mark.parametrize("label", sorted(_ln_row.ROW_CLUSTER_VARIANTS))
@pytest.mark.parametrize("wdt", ["same", "float32"])
def test_layernorm_cluster_variants_compile_for_sm90(tables, label, wdt):
    tables()
    layernorm._TUNE.update(_ln_row.ROW_CLUSTER_VARIANTS[label])
    assert layernorm.compile_layernorm_fwd.raw("bfloat16", 262144, True, True, wdt) is not None
