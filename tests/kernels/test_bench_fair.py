"""The fair benchmark's pure logic (benchmarks/bench_kernels.py), on the CPU: the
aggregation over allocations, the interleaving order, the best-peer ratio, the per-allocation
input sets, and the reference worker's protocol (start, an error reply, a deadline)."""

import importlib.util
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bk():
    spec = importlib.util.spec_from_file_location(
        "bench_kernels_fair", ROOT / "benchmarks" / "bench_kernels.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_median_of_medians(bk):
    assert bk.median_of_medians([3.0, 1.0, 2.0]) == 2.0
    assert bk.median_of_medians([4.0, 1.0, 3.0, 2.0]) == 2.5
    # one allocation placed badly (+10 %) does not move the figure
    assert bk.median_of_medians([135.0, 149.0, 134.0]) == 135.0
    assert bk.median_of_medians([None, 5.0, None]) == 5.0
    assert bk.median_of_medians([]) is None
    assert bk.median_of_medians([None]) is None


def test_interleave_order_rotates(bk):
    cols = ["ours", "eager", "compile", "ref"]
    orders = [bk.interleave_order(cols, k) for k in range(len(cols))]
    assert [o[0] for o in orders] == cols  # each column leads exactly once
    assert all(sorted(o) == sorted(cols) for o in orders)
    assert bk.interleave_order(cols, 5) == bk.interleave_order(cols, 1)
    assert bk.interleave_order([], 3) == []


def test_best_peer_ratio(bk):
    res = {"ours": (100.0, 4.0), "ref": (98.0, 4.1), "eager": (150.0, 2.7), "compile": None}
    assert bk.best_peer_ratio(res) == pytest.approx(0.98)
    assert bk.best_peer_ratio({"ours": (100.0, 4.0)}) is None
    assert bk.best_peer_ratio({"ref": (1.0, 1.0)}) is None


def test_make_sets_distinct_and_reproducible(bk):
    def setup(m, n):
        return (torch.randn(m, n), torch.randint(0, n, (m,)))

    a = bk.make_sets(setup, 4, 8, 3)
    b = bk.make_sets(setup, 4, 8, 3, prep=lambda x, t: (x * 2, t))
    assert len(a) == 3 and len(b) == 3
    # the same K sets in every process (the reference worker builds them too) ...
    assert all(torch.equal(x[0] * 2, y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
    # ... and K different allocations with different contents
    assert not torch.equal(a[0][0], a[1][0]) and not torch.equal(a[1][0], a[2][0])
    seeds = {bk.seed_of(m, n, k) for m, n in bk.DEFAULT_SHAPES for k in range(3)}
    assert len(seeds) == 3 * len(bk.DEFAULT_SHAPES)


def _fake_ref(tmp_path, init=""):
    """A directory that imports as the reference library ``quack`` (with the names
    ``ref_fns`` reads), its ``__init__`` running ``init``."""
    pkg = tmp_path / "ref" / "quack"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(init)
    (pkg / "softmax.py").write_text(
        "def softmax_fwd(x):\n    return x\n\ndef softmax_bwd(dy, y):\n    return y\n"
    )
    (pkg / "rmsnorm.py").write_text("")
    (pkg / "cross_entropy.py").write_text("")
    return str(tmp_path / "ref")


class _Args:
    dtype = "bfloat16"

    def __init__(self, ref):
        self.ref = ref


@pytest.mark.skipif(torch.cuda.is_available(), reason="the setup error path needs a machine without CUDA")
def test_ref_worker_protocol_reports_errors(bk, tmp_path):
    """The worker starts, answers a setup it cannot run (no CUDA here) with an error, and
    ends on EOF: the reference column fails, the client and the benchmark go on."""
    client = bk.RefClient(_Args(_fake_ref(tmp_path)), timeout_s=120)
    try:
        assert client.alive
        r = client.ask(cmd="setup", op="softmax_fwd", m=4, n=8, allocs=2)
        assert r is not None and r.get("error")
        assert client.ask(cmd="free") == {"ok": True}
    finally:
        client.close()
    assert client.p.poll() is not None
    assert client.ask(cmd="time", k=0, reps=1) is None  # closed: no more requests


def test_ref_worker_deadline(bk, tmp_path):
    """A worker that never answers ends its column after the deadline, and is ended."""
    ref = _fake_ref(tmp_path, init="import time\ntime.sleep(60)\n")
    t0 = time.time()
    # 0.5 s: the worker never answers, so any deadline proves it; a longer one only waited.
    client = bk.RefClient(_Args(ref), timeout_s=0.5)
    assert not client.alive
    assert time.time() - t0 < 30
    assert client.p.poll() is not None
