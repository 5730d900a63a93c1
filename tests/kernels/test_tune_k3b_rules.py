"""benchmarks/tune_k3b.py's decision rule and its rewrite of the modules' DEFAULTS (CPU)."""

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tk():
    spec = importlib.util.spec_from_file_location("tune_k3b_rules", ROOT / "benchmarks" / "tune_k3b.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _r(group, label, us, ok=True, tune=None):
    return dict(group=group, label=label, us=us, ok=ok, tune=tune or {})


def test_decide_adopts_only_a_clear_correct_win(tk):
    g1, g2, g3, g4 = "sm_fwd 32768x4096", "sm_bwd 32768x4096", "ce_bwd 32768x16384", "ce_fwd 32768x4096"
    results = [
        # 2 % faster: adopted
        _r(g1, "default", 100.0),
        _r(g1, "smem", 98.0, tune={"fwd_smem": True}),
        # 1 % faster: under the 1.5 % rule, kept
        _r(g2, "default", 100.0),
        _r(g2, "b16", 99.0, tune={"bwd_budget": 16}),
        # fastest but wrong: ignored; the next one is a clear win
        _r(g3, "default", 100.0),
        _r(g3, "b16", 80.0, ok=False, tune={"bwd_budget": 16}),
        _r(g3, "smem+b128", 97.0, tune={"bwd_budget": 128, "bwd_smem": True}),
        # no correct default: kept
        _r(g4, "default", 100.0, ok=False),
        _r(g4, "regs", 50.0, tune={"stream": False}),
        dict(group=g4, label="s2", failed="compile"),
    ]
    defaults, why = tk.decide(results)
    assert defaults["kernels/softmax.py"] == {"small": {"fwd_smem": True}}
    assert defaults["kernels/cross_entropy.py"] == {"bwd_mid": {"bwd_budget": 128, "bwd_smem": True}}
    assert sum("adopt" in w for w in why) == 2
    assert len(why) == len(tk.CLASSES)


def test_decide_merges_forward_and_backward_knobs_of_a_class(tk):
    results = [
        _r("sm_fwd 32768x4096", "default", 100.0),
        _r("sm_fwd 32768x4096", "smem", 90.0, tune={"fwd_smem": True}),
        _r("sm_bwd 32768x4096", "default", 100.0),
        _r("sm_bwd 32768x4096", "b16", 90.0, tune={"bwd_budget": 16}),
    ]
    defaults, _ = tk.decide(results)
    assert defaults["kernels/softmax.py"] == {"small": {"fwd_smem": True, "bwd_budget": 16}}


def test_apply_rewrites_the_defaults_line(tk, tmp_path):
    for rel in ("kernels/softmax.py", "kernels/cross_entropy.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    value = {"small": {"fwd_smem": True, "bwd_budget": 16}, "mid": {"bwd_budget": 64}}
    tk.apply({"kernels/softmax.py": value, "kernels/cross_entropy.py": {}}, tmp_path)
    text = (tmp_path / "kernels/softmax.py").read_text()
    ns: dict = {}
    lines = [ln for ln in text.splitlines() if ln.startswith(("DEFAULTS: dict = ", "BWD_BUDGET_"))]
    exec("\n".join(ln.replace("DEFAULTS: dict", "DEFAULTS") for ln in lines), ns)
    # the budgets go to their constants, the other knobs to DEFAULTS (an emptied class goes)
    assert ns["DEFAULTS"] == {"small": {"fwd_smem": True}}
    assert (ns["BWD_BUDGET_SMALL"], ns["BWD_BUDGET_MID"]) == (16, 64)
    assert value["small"]["bwd_budget"] == 16  # the caller's decisions are left as they were
    assert "DEFAULTS: dict = {}" in (tmp_path / "kernels/cross_entropy.py").read_text()
    # every other line unchanged
    old = (ROOT / "kernels/softmax.py").read_text().splitlines()
    new = text.splitlines()
    assert len(old) == len(new) and sum(a != b for a, b in zip(old, new)) == 3
    (tmp_path / "kernels/softmax.py").write_text("no defaults here\n")
    with pytest.raises(SystemExit):
        tk.apply({"kernels/softmax.py": value}, tmp_path)


def test_size_classes_match_the_measured_shapes():
    from quack_kernels import cross_entropy, softmax

    assert [softmax.size_class("bfloat16", n) for n in (4096, 16384, 262144, 65536, 1000)] == [
        "small",
        "mid",
        "large",
        None,
        None,
    ]
    assert softmax.size_class("float32", 4096) is None
    assert [cross_entropy.size_class("float16", n) for n in (4096, 16384, 65536)] == ["small", "mid", None]
