"""CPU tier: round 6's cache hints on the norm forwards (issue 14 part 6; kernels/_cachehint.py,
the "io_hints" / "x_l2" knobs, benchmarks/tune_k6g.py): the hints the knobs put in the PTX for
sm_90a (and that the defaults carry none), the labels the sweep measures, and its decision
rule. The GPU side: the sweep checks each variant against fp32 torch on 256 rows."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from quack_kernels import _cachehint, _ln_row, rmsnorm, softmax  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# (name, op, n, weight dtype, knob label or "" for the default); op "ln" / "rms"
CASES = (
    ("ln_h", "ln", 262144, "float32", "xs2 mb3 h"),
    ("ln_xs_wbel1", "ln", 262144, "float32", "xs mb3 c44 wbel1"),
    ("ln_ring_xef", "ln", 262144, "float32", "ring xef"),
    ("ln_default", "ln", 262144, "float32", ""),
    ("ln16k_default", "ln", 16384, "float32", ""),
    ("rms_h", "rms", 262144, "float32", "xs2 mb3 h"),
    ("rms_default", "rms", 262144, "float32", ""),
)
_PTX_SCRIPT = """
import glob, os, shutil, sys
from quack_kernels import _ln_row, layernorm, rmsnorm
out = sys.argv[1]
for arg in sys.argv[2:]:
    name, op, n, wdt, label = arg.split(":")
    before = set(glob.glob(os.path.join(out, "*.ptx")))
    if op == "ln":
        table = _ln_row.ROW_CLUSTER_VARIANTS if int(n) > 16384 else _ln_row.ROW_CTA_VARIANTS
        layernorm._TUNE.update(table[label] | {"row_cta": False} if label else {})
        layernorm.compile_layernorm_fwd.raw("bfloat16", int(n), True, True, wdt)
        layernorm._TUNE.clear()
    else:
        rmsnorm._TUNE.update(rmsnorm.WIDE_VARIANTS[label] | {"wide_fwd": False} if label else {})
        rmsnorm.compile_rmsnorm_fwd.raw("bfloat16", int(n), True, False, False, wdt)
        rmsnorm._TUNE.clear()
    (new,) = set(glob.glob(os.path.join(out, "*.ptx"))) - before
    shutil.move(new, os.path.join(out, name + ".txt"))
"""


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    """The PTX of ``CASES`` (CUTE_DSL_KEEP is read once a process: compiled in a child
    process, so that no other test dumps its PTX)."""
    out = tmp_path_factory.mktemp("ptx")
    env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(out), CUTE_DSL_ARCH="sm_90a")
    args = [":".join(map(str, c)) for c in CASES]
    r = subprocess.run([sys.executable, "-c", _PTX_SCRIPT, str(out), *args], env=env, timeout=600)
    assert r.returncode == 0
    return {c[0]: (out / f"{c[0]}.txt").read_text() for c in CASES}


def _count(text, pattern):
    return len(re.findall(pattern, text))


CP_HINT = r"cp\.async\.cg\.shared\.global\.L2::cache_hint \[[^\]]+\], \[[^\]]+\], 16, "


def test_two_rows_with_every_hint(ptx):
    # LayerNorm 262144 over 16 CTAs: 64 elements = 8 vectors a thread, two rows a CTA
    text = ptx["ln_h"]
    ef, el = _cachehint.L2_POLICY["evict_first"], _cachehint.L2_POLICY["evict_last"]
    assert _count(text, CP_HINT + str(ef)) == 16  # x: 2 rows x 8 vectors
    # the loads' and stores' policies are registers: set once to the constants
    assert _count(text, rf"mov\.(b|u)64\s+%rd\d+, {el};") >= 1
    assert _count(text, rf"mov\.(b|u)64\s+%rd\d+, {ef};") >= 1
    assert _count(text, r"cp\.async\.cg\.shared\.global \[") == 0  # no unhinted x copy left
    # w and b: 8 vectors x 2 16-byte halves each, once for both rows; y: 2 rows x 8 vectors
    assert _count(text, r"ld\.global\.L2::cache_hint\.v4\.b32") == 32
    assert _count(text, r"st\.global\.L2::cache_hint\.v4\.b32") == 16


def test_l1_evict_last_on_the_weights(ptx):
    text = ptx["ln_xs_wbel1"]
    assert _count(text, r"ld\.global\.L1::evict_last\.L2::cache_hint\.v4\.b32") == 32
    assert _count(text, CP_HINT) == 8  # one row a CTA
    assert _count(text, r"st\.global\.L2::cache_hint") == 0  # y unhinted


def test_ring_x_hint(ptx):
    # the ring's prologue (one stage) and refill copies of x carry the policy
    assert _count(ptx["ln_ring_xef"], CP_HINT) >= 8
    assert _count(ptx["ln_ring_xef"], r"cp\.async\.cg\.shared\.global \[") == 0


def test_rmsnorm_two_rows_with_every_hint(ptx):
    text = ptx["rms_h"]
    assert _count(text, CP_HINT) == 16
    assert _count(text, r"ld\.global\.L2::cache_hint\.v4\.b32") == 16  # w only
    assert _count(text, r"st\.global\.L2::cache_hint\.v4\.b32") == 16


@pytest.mark.parametrize("name", ["ln_default", "ln16k_default", "rms_default"])
def test_defaults_carry_no_hint(ptx, name):
    assert "cache_hint" not in ptx[name]


def test_softmax_uses_the_shared_module_only_when_compiling():
    # moved, not copied: softmax keeps no copy of the hints, and importing it (a kernel
    # module's import is on every fresh process's path, issue 15) does not import them
    src = Path(softmax.__file__).read_text()
    assert "L2_POLICY = " not in src and "def io_copy" not in src and "def _io_copy" not in src
    assert "from . import _cachehint as ch" in src
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, quack_kernels.softmax; print('quack_kernels._cachehint' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False"


@pytest.fixture(scope="module")
def tk():
    spec = importlib.util.spec_from_file_location("tune_k6g_rules", ROOT / "benchmarks" / "tune_k6g.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_swept_labels_exist(tk):
    assert set(tk.RMS_262144) <= set(rmsnorm.WIDE_VARIANTS)
    assert set(tk.LN_262144) <= set(_ln_row.ROW_CLUSTER_VARIANTS)
    assert set(tk.LN_16384) <= set(_ln_row.ROW_CTA_VARIANTS)
    vs = tk.variants()
    assert {"rms_w32 262144", "ln_w32 262144", "ln_w32 16384"} <= {v["group"] for v in vs}
    # a candidate's knobs replace the default tables (else a table's x_rows leaks into an
    # "xs" label: the first round 6 sweep measured the two-row kernel under one-row labels)
    for v in vs:
        if "(default)" not in v["label"]:
            assert v["tune"].get("row_cta" if v["kern"] == "ln_fwd" else "wide_fwd") is False, v["label"]


def _r(group, label, us, ok=True):
    return dict(group=group, label=label, us=us, ok=ok, tune={})


def test_decide_adopts_only_clear_correct_wins(tk):
    results = [
        # 3 % faster but wrong; 2 % faster and right: the right one
        _r("ln_w32 262144", "w32 (default)", 100.0),
        _r("ln_w32 262144", "ring", 97.0, ok=False),
        _r("ln_w32 262144", "xs2 mb3 wbel", 98.0),
        # 1 % faster: kept
        _r("rms_w32 262144", "w32 (default)", 100.0),
        _r("rms_w32 262144", "xs2 mb3 wbel", 99.0),
        _r("ln_w32 16384", "w32 (default)", 100.0),
        _r("ln_w32 16384", "xs2 mb3 h", 98.4),
        # the same-dtype kernels are never changed
        _r("ln_w32 262144", "same (default)", 100.0),
        _r("ln_w32 262144", "same xs mb3 h", 90.0),
    ]
    edits, why = tk.decide(results)
    assert edits["kernels/rmsnorm.py"] == {"WIDE_FWD: dict": dict(rmsnorm.WIDE_FWD)}
    assert edits["kernels/_ln_row.py"]["ROW_CLUSTER: dict"] == dict(_ln_row.ROW_CLUSTER) | {
        "wide@16": "xs2 mb3 wbel"
    }
    assert edits["kernels/_ln_row.py"]["ROW_CTA: dict"] == dict(_ln_row.ROW_CTA) | {"wide": "xs2 mb3 h"}
    assert sum(not w.endswith("-> keep") for w in why) == 2
