"""CPU tier: the softmax backward's round-5 knobs (issue 14 part 6; kernels/softmax.py
``_bwd_plan``, ``_cachehint.io_copy``; the sweep, benchmarks/tune_k5e.py, is at commit aac952b):
which rows the small class's default reaches, the plans and cache hints the knobs make (in
the PTX, for sm_90a), and that the hints are imported only when compiling. The GPU side:
tests/kernels/test_kernels_gpu.py and test_training_gpu.py run the kernels (N = 4096 and 4100
are in the small class)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from quack_kernels import softmax  # noqa: E402
from quack_kernels._plan import plan_rows  # noqa: E402


@pytest.fixture
def tune(monkeypatch):
    """Set softmax's ``_TUNE`` for one test (restored after it)."""

    def set_(knobs):
        monkeypatch.setattr(softmax, "_TUNE", dict(knobs))

    return set_


def test_small_class_default_is_torch_compiles_kernel():
    small = softmax.DEFAULTS["small"]
    assert set(small) == {"bwd_twopass", "bwd_tpr", "bwd_ld", "bwd_ld2"}
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


def test_l2_policy_operands():
    from quack_kernels import _cachehint as ch

    assert ch.l2_policy(None) is None and ch.l2_policy({"evict": "last"}) is None
    assert ch.l2_policy({"l2": "evict_last"}) == ch.L2_POLICY["evict_last"] == 0x14F0000000000000
    assert ch.l2_policy({"l2": "evict_first"}) == 0x12F0000000000000


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
        {"bwd_ld": {"mode": "nc"}},
        {"bwd_twopass": True, "bwd_tpr": 512, "bwd_ld": {"evict": "last", "l2": "evict_last"}},
    ],
)
def test_measured_knob_sets_compile_with_a_row_tail(tune, knobs):
    """Hinted copies keep the column predicate (N = 4100: 4-element vectors, a tail)."""
    tune(knobs)
    assert softmax.compile_softmax_bwd.raw("bfloat16", 4100) is not None
