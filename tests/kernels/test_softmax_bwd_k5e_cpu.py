"""CPU tier: the softmax backward's round-5 knobs (issue 14 part 6; kernels/softmax.py
``_bwd_plan``, ``_cachehint.io_copy``, benchmarks/tune_k5e.py): which rows the small class's default
reaches, the plans and cache hints the knobs make (in the PTX, for sm_90a), and the sweep's
decision rule and its rewrite of ``DEFAULTS``. The GPU side: tests/kernels/test_kernels_gpu.py
and test_training_gpu.py run the kernels (N = 4096 and 4100 are in the small class)."""

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from quack_kernels import softmax  # noqa: E402
from quack_kernels._plan import plan_rows  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tk():
    spec = importlib.util.spec_from_file_location("tune_k5e_rules", ROOT / "benchmarks" / "tune_k5e.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def tune(monkeypatch):
    """Set softmax's ``_TUNE`` for one test (restored after it)."""

    def set_(knobs):
        monkeypatch.setattr(softmax, "_TUNE", dict(knobs))

    return set_


def test_small_class_default_is_torch_compiles_kernel(tk):
    small = softmax.DEFAULTS["small"]
    assert small == tk.ROUND2["triton (const policy)"]
    assert small["bwd_twopass"] and small["bwd_tpr"] == 512
    assert small["bwd_ld"] == {"evict": "last", "l2": "evict_last"}
    assert small["bwd_ld2"] == {"evict": "first", "l2": "evict_first"}
    for dt in ("bfloat16", "float16"):
        for n in (4096, 4100, 6144, 8192):
            assert softmax.knobs(dt, n) == small
        assert softmax.knobs(dt, 16384) == softmax.DEFAULTS["mid"]
        assert softmax.knobs(dt, 4095) == {}
    assert softmax.knobs("float32", 4096) == {}


def test_bwd_plan_512_threads_where_the_row_splits_evenly(tune):
    p = softmax._bwd_plan("bfloat16", 4096, 16)
    assert (p.threads_per_row, p.num_threads, p.cluster_n, p.nvec, p.vec) == (512, 512, 1, 1, 8)
    p = softmax._bwd_plan("float16", 8192, 16)
    assert (p.threads_per_row, p.num_threads, p.nvec) == (512, 512, 2)
    # a row that does not split into 16-byte vectors over 512 threads keeps the budget's plan
    for n in (4100, 5000, 6144):
        assert softmax._bwd_plan("bfloat16", n, 16) == plan_rows(n, 16, budget=32)
    assert softmax._bwd_plan("float32", 4096, 32) == plan_rows(4096, 32, budget=32)
    tune({"bwd_tpr": 1024})  # one CTA a row instead of a cluster of 4 (budget 16 at 16384)
    p = softmax._bwd_plan("bfloat16", 16384, 16)
    assert (p.threads_per_row, p.cluster_n, p.nvec) == (1024, 1, 2)
    tune({"bwd_tpr": 512, "bwd_budget": 16})  # more than 32 elements a thread: not taken
    assert softmax._bwd_plan("bfloat16", 32768, 16) == plan_rows(32768, 16, budget=16)
    tune({"bwd_width": 32})  # 64-bit accesses of 16-bit rows
    assert softmax._bwd_plan("bfloat16", 4096, 16).vec == 4


def test_l2_policy_operands():
    from quack_kernels import _cachehint as ch

    assert ch.l2_policy(None) is None and ch.l2_policy({"evict": "last"}) is None
    assert ch.l2_policy({"l2": "evict_last"}) == ch.L2_POLICY["evict_last"] == 0x14F0000000000000
    assert ch.l2_policy({"l2": "cp:evict_first"}) == "evict_first"


PTX_CONFIGS = (("bfloat16", 4096), ("float16", 8192), ("bfloat16", 16384))
_PTX_SCRIPT = """
import glob, os, shutil, sys
from quack_kernels import softmax
out = sys.argv[1]
for arg in sys.argv[2:]:
    dtype, n = arg.split(":")
    before = set(glob.glob(os.path.join(out, "*.ptx")))
    softmax.compile_softmax_bwd.raw(dtype, int(n))
    (new,) = set(glob.glob(os.path.join(out, "*.ptx"))) - before
    shutil.move(new, os.path.join(out, f"{dtype}-{n}.txt"))
"""


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    """The PTX of the default kernels of ``PTX_CONFIGS`` (CUTE_DSL_KEEP is read once a
    process: compiled in a child process, so that no other test dumps its PTX)."""
    out = tmp_path_factory.mktemp("ptx")
    env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(out), CUTE_DSL_ARCH="sm_90a")
    args = [f"{d}:{n}" for d, n in PTX_CONFIGS]
    r = subprocess.run([sys.executable, "-c", _PTX_SCRIPT, str(out), *args], env=env, timeout=300)
    assert r.returncode == 0
    return {(d, n): (out / f"{d}-{n}.txt").read_text() for d, n in PTX_CONFIGS}


@pytest.mark.parametrize("dtype, n, threads, loads", [("bfloat16", 4096, 512, 4), ("float16", 8192, 512, 8)])
def test_small_default_compiles_to_the_hinted_two_pass_kernel(ptx, dtype, n, threads, loads):
    text = ptx[(dtype, n)]
    assert f".reqntid {threads}, 1, 1" in text
    first = re.findall(r"ld\.global\.L1::evict_last\.L2::cache_hint\.v4\.b32", text)
    second = re.findall(r"ld\.global\.L1::evict_first\.L2::cache_hint\.v4\.b32", text)
    assert len(first) == len(second) == loads // 2
    assert len(re.findall(r"ld\.global", text)) == loads
    assert re.findall(r"st\.global[.\w:]*", text) == ["st.global.v4.b32"] * (loads // 4)


def test_other_rows_keep_their_plain_kernel(ptx):
    text = ptx[("bfloat16", 16384)]  # the mid class (a cluster of 4)
    assert "cache_hint" not in text and "evict" not in text
    assert len(re.findall(r"ld\.global\.v4\.b32", text)) == 4


@pytest.mark.parametrize(
    "knobs",
    [
        {"bwd_st": {"mode": "cs"}, "bwd_ld": {"mode": "nc"}},
        {"bwd_twopass": True, "bwd_tpr": 512, "bwd_ld": {"evict": "last", "l2": "cp:evict_last"}},
        {"bwd_width": 32, "bwd_st": {"l2": "evict_first"}},
    ],
)
def test_measured_knob_sets_compile_with_a_row_tail(tune, knobs):
    """Hinted copies keep the column predicate (N = 4100: 4-element vectors, a tail)."""
    tune(knobs)
    assert softmax.compile_softmax_bwd.raw("bfloat16", 4100) is not None


# ----------------------------------------------------------------------------- the sweep's rule


def _r(group, label, us, ok=True, tune=None):
    return dict(group=group, label=label, us=us, ok=ok, tune=tune or {})


G4, G8, G16 = "sm_bwd 32768x4096", "sm_bwd 32768x8192", "sm_bwd 32768x16384"


def test_decide_takes_the_fastest_clear_win_that_passes_the_guard(tk):
    results = [
        _r(G4, "default", 190.0),
        _r(G4, "torch.compile", 150.0),  # a peer: never adopted
        _r(G4, "wrong", 160.0, ok=False, tune={"bwd_tpr": 512}),
        _r(G4, "a", 180.0, tune={"a": 1}),  # fastest, but slower at 8192
        _r(G4, "b", 185.0, tune={"b": 1}),  # 2.6 % faster, within the guard
        _r(G4, "c", 186.0, tune={"c": 1}),
        _r(G8, "default", 370.0),
        _r(G8, "a", 380.0),
        _r(G8, "b", 371.0),
        _r(G16, "default", 734.0),
        _r(G16, "d", 730.0, tune={"d": 1}),  # 0.5 %: under the rule
    ]
    adopt, why = tk.decide(results)
    assert adopt == {"small": {"b": 1}}
    assert sum("fails the guard" in w for w in why) == 1
    assert sum(w.endswith("-> keep") for w in why) == 1


def test_decide_keeps_without_a_correct_default_or_a_measured_guard(tk):
    results = [
        _r(G4, "default", 190.0),
        _r(G4, "a", 150.0, tune={"a": 1}),  # not measured at 8192: fails the guard
        _r(G8, "default", 370.0),
        _r(G16, "default", 734.0, ok=False),
        _r(G16, "d", 600.0, tune={"d": 1}),
    ]
    adopt, why = tk.decide(results)
    assert adopt == {}
    assert len(why) == 3


def test_apply_rewrites_one_line_that_ruff_leaves(tk, tmp_path):
    (tmp_path / "kernels").mkdir()
    for name in ("softmax.py", "cross_entropy.py"):
        shutil.copy(ROOT / "kernels" / name, tmp_path / "kernels" / name)
    tk.apply_classes({"small": {"bwd_tpr": 512, "bwd_ld": {"evict": "last", "l2": "evict_last"}}}, tmp_path)
    text = (tmp_path / "kernels" / "softmax.py").read_text()
    ast.parse(text)
    lines = [ln for ln in text.splitlines() if ln.startswith("DEFAULTS: dict = ")]
    assert len(lines) == 1 and lines[0].endswith("  # fmt: skip")  # longer than 110 columns
    ns: dict = {}
    exec(lines[0].replace("DEFAULTS: dict", "DEFAULTS"), ns)
    assert ns["DEFAULTS"] == {
        "mid": softmax.DEFAULTS["mid"],
        "small": {"bwd_tpr": 512, "bwd_ld": {"evict": "last", "l2": "evict_last"}},
    }
    tk.apply_classes({"small": {}}, tmp_path)  # an emptied class goes; a short line stays plain
    line = [
        ln for ln in (tmp_path / "kernels" / "softmax.py").read_text().splitlines() if ln.startswith("DEF")
    ]
    assert line == ['DEFAULTS: dict = {"mid": {"bwd_min_blocks": 4}}']
