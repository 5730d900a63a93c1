"""CPU tier: round 5's mixed-precision norm knobs (issue 14 part 6; benchmarks/tune_k5f.py):
which rows each default table reaches, the gates of the new paths, the sweep's decision
rule and its rewrite of the tables, and that the new kernels compile for sm_90a."""

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from quack_kernels import _ln_row, _norm_bwd, layernorm, rmsnorm  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tables(monkeypatch):
    """Set the round 5 tables for one test (restored after it)."""

    def set_(wide_fwd=None, row_cluster=None, w_smem=None):
        monkeypatch.setattr(rmsnorm, "WIDE_FWD", dict(wide_fwd or {}))
        monkeypatch.setattr(rmsnorm, "_TUNE", {})
        monkeypatch.setattr(_ln_row, "ROW_CLUSTER", dict(row_cluster or {}))
        monkeypatch.setattr(layernorm, "_TUNE", {})
        monkeypatch.setattr(_norm_bwd, "W_SMEM_WIDE_ONE_CTA", dict(w_smem or {"rms": False, "layer": False}))

    return set_


@pytest.fixture(scope="module")
def tk():
    spec = importlib.util.spec_from_file_location("tune_k5f_rules", ROOT / "benchmarks" / "tune_k5f.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
    tables(row_cluster={"wide@16": "xs mb4"})
    want = _ln_row.ROW_CLUSTER_VARIANTS["xs mb4"]
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


def _r(group, label, us, ok=True):
    return dict(group=group, label=label, us=us, ok=ok, tune={})


def test_decide_adopts_only_clear_correct_wins(tk, tables):
    tables()
    results = [
        # 3 % faster but wrong, then 2 % faster and right: the right one
        _r("rms_w32 65536", "w32 (default)", 100.0),
        _r("rms_w32 65536", "xs2 mb3", 97.0, ok=False),
        _r("rms_w32 65536", "rt sw mb3", 98.0),
        # 1 % faster: kept
        _r("rms_w32 262144", "w32 (default)", 100.0),
        _r("rms_w32 262144", "ring 2x64", 99.0),
        _r("ln_w32 16384", "w32 (default)", 100.0),
        _r("ln_w32 16384", "xs2 mb3", 90.0),
        _r("ln_w32 262144", "w32 (default)", 100.0),
        _r("ln_w32 262144", "same (default)", 100.0),
        _r("ln_w32 262144", "xs mb4", 95.0),
        _r("ln_w32 262144", "same xs mb5", 97.0),
        _r("rms_bwd_w32 4096", "w32 (default)", 100.0),
        _r("rms_bwd_w32 4096", "w_smem", 98.4),
    ]
    edits, why = tk.decide(results)
    assert edits["kernels/rmsnorm.py"] == {"WIDE_FWD: dict": {"4": "rt sw mb3"}}
    assert edits["kernels/_ln_row.py"]["ROW_CTA: dict"] == {
        "same": _ln_row.ROW_CTA["same"],
        "wide": "xs2 mb3",
    }
    assert edits["kernels/_ln_row.py"]["ROW_CLUSTER: dict"] == {"wide@16": "xs mb4", "same@16": "xs mb5"}
    assert edits["kernels/_norm_bwd.py"] == {"W_SMEM_WIDE_ONE_CTA": {"rms": True, "layer": False}}
    assert sum(not w.endswith("-> keep") for w in why) == 5


def test_decide_keeps_the_entries_of_groups_not_measured(tk, tables):
    tables(wide_fwd={"4": "xs2 mb3"}, row_cluster={"same@16": "xs mb3"}, w_smem={"rms": True, "layer": False})
    results = [
        _r("rms_w32 262144", "w32 (default)", 100.0),
        _r("rms_w32 262144", "ring 1x128", 90.0),
        _r("ln_w32 262144", "w32 (default)", 100.0),
        _r("ln_w32 262144", "xs2 mb3", 99.0),
    ]
    edits, why = tk.decide(results)
    assert edits["kernels/rmsnorm.py"] == {"WIDE_FWD: dict": {"4": "xs2 mb3", "16": "ring 1x128"}}
    assert edits["kernels/_ln_row.py"]["ROW_CLUSTER: dict"] == {"same@16": "xs mb3"}
    assert edits["kernels/_norm_bwd.py"] == {"W_SMEM_WIDE_ONE_CTA": {"rms": True, "layer": False}}
    assert sum(not w.endswith("-> keep") for w in why) == 1


def test_apply_rewrites_the_tables(tk, tmp_path):
    for rel in ("kernels/rmsnorm.py", "kernels/_ln_row.py", "kernels/_norm_bwd.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    edits = {
        "kernels/rmsnorm.py": {"WIDE_FWD: dict": {"4": "xs2 mb3"}},
        "kernels/_ln_row.py": {
            "ROW_CTA: dict": {"same": "xs512 mb3", "wide": "xs2 mb2"},
            "ROW_CLUSTER: dict": {},
        },
        "kernels/_norm_bwd.py": {"W_SMEM_WIDE_ONE_CTA": {"rms": True, "layer": False}},
    }
    tk.apply(edits, tmp_path)
    text = (tmp_path / "kernels/rmsnorm.py").read_text()
    assert text.count('\nWIDE_FWD: dict = {"4": "xs2 mb3"}\n') == 1
    text = (tmp_path / "kernels/_ln_row.py").read_text()
    assert text.count('\nROW_CTA: dict = {"same": "xs512 mb3", "wide": "xs2 mb2"}\n') == 1
    assert text.count("\nROW_CLUSTER: dict = {}\n") == 1
    text = (tmp_path / "kernels/_norm_bwd.py").read_text()
    assert text.count('\nW_SMEM_WIDE_ONE_CTA = {"rms": True, "layer": False}\n') == 1


@pytest.mark.parametrize("label", ["rt swp mb3", "xs late mb4", "xs2 mb3", "xs wregs mb2"])
def test_rmsnorm_wide_variants_compile_for_sm90(tables, label):
    tables()
    rmsnorm._TUNE.update(rmsnorm.WIDE_VARIANTS[label])
    assert rmsnorm.compile_rmsnorm_fwd.raw("bfloat16", 65536, True, False, False, "float32") is not None


@pytest.mark.parametrize("label", ["xs mb4", "xs2 mb3"])
@pytest.mark.parametrize("wdt", ["same", "float32"])
def test_layernorm_cluster_variants_compile_for_sm90(tables, label, wdt):
    tables()
    layernorm._TUNE.update(_ln_row.ROW_CLUSTER_VARIANTS[label])
    assert layernorm.compile_layernorm_fwd.raw("bfloat16", 262144, True, True, wdt) is not None
