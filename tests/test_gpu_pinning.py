"""GPU pinning of xdist workers (quack/testing/gpus.py) and issue 16's check
(tests/gpupin.py): CPU tests with fake GPU counts, and a GPU test that runs on a
real multi-GPU host under xdist (skipped where it cannot apply)."""

import os
from collections import Counter
from pathlib import Path

import gpupin
import pytest
from conftest import requires_gpu

from quack.testing import gpus

pytest_plugins = ["pytester"]


@pytest.mark.parametrize("n_gpus", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("n_workers", [1, 2, 3, 4, 5, 7, 8, 16])
def test_round_robin_assignment(n_gpus, n_workers):
    ids = [str(10 + i) for i in range(n_gpus)]
    pins = [gpus.assign(gpus.worker_index(f"gw{w}"), n_workers, ids) for w in range(n_workers)]
    counts = Counter(p.gpu for p in pins)
    if n_workers <= n_gpus:
        assert len(counts) == n_workers and set(counts.values()) == {1}
        assert not any(p.shared for p in pins)
    else:
        assert len(counts) == n_gpus, "a GPU holds no worker while another holds two"
        assert max(counts.values()) - min(counts.values()) <= 1
        assert all(p.shared for p in pins)


def test_pin_worker_rewrites_only_the_given_env():
    env = {"PYTEST_XDIST_WORKER": "gw3", "PYTEST_XDIST_WORKER_COUNT": "4", "CUDA_VISIBLE_DEVICES": "4,6"}
    saved = gpus.current
    try:
        pin = gpus.pin_worker(env, enabled=True, project_uses_quack=False)
        assert pin == gpus.Pin("6", True) and gpus.current == pin
        assert env["CUDA_VISIBLE_DEVICES"] == "6" and env["QUACK_PYTEST_GPU_SHARED"] == "1"
        off = {"PYTEST_XDIST_WORKER": "gw1", "CUDA_VISIBLE_DEVICES": "4,6"}
        assert gpus.pin_worker(off, enabled=False, project_uses_quack=True) is None
        assert off["CUDA_VISIBLE_DEVICES"] == "4,6"
        auto = dict(off)
        assert gpus.pin_worker(auto, enabled=None, project_uses_quack=False) is None
        assert gpus.pin_worker(auto, enabled=None, project_uses_quack=True) == gpus.Pin("6", False)
        assert gpus.pin_worker({"CUDA_VISIBLE_DEVICES": "1"}, enabled=True, project_uses_quack=True) is None
        assert (
            gpus.pin_worker(
                {"PYTEST_XDIST_WORKER": "gw0", "CUDA_VISIBLE_DEVICES": ""},
                enabled=True,
                project_uses_quack=True,
            )
            is None
        )
    finally:
        gpus.current = saved


def _recs(uuids):
    return [
        {"worker": f"gw{i}", "cvd": str(i), "uuid": u, "pid": 100 + i, "pinned": True, "workers": len(uuids)}
        for i, u in enumerate(uuids)
    ]


def test_session_check_accepts_good_pinning():
    assert gpupin.check(_recs(["A", "B"]), 2, 2) == []
    assert gpupin.check(_recs(["A", "B"]), 4, 2) == []
    assert gpupin.check(_recs(["A", "B", "A", "B"]), 2, 4) == []
    assert gpupin.check(_recs(["A", "B", "C", "A", "B"]), 3, 5) == []
    assert gpupin.check(_recs(["A"]), 2, 1) == []  # one worker: nothing to check
    assert gpupin.check([dict(r, pinned=False) for r in _recs(["A", "A"])], 2, 2) == []


def test_session_check_finds_bad_pinning():
    (p,) = gpupin.check(_recs(["A", "A"]), 2, 2)
    assert "2 workers share GPU A" in p and "gw0, gw1" in p
    assert gpupin.check(_recs(["A", "A", "A", "B"]), 2, 4)  # gw1 belongs on the other GPU
    assert gpupin.check(_recs(["A", "A", "B", "B"]), 2, 4)  # not round-robin
    partial = [r for r in _recs(["A", "B", "B", "A"]) if r["worker"] in ("gw0", "gw3")]
    assert gpupin.check(partial, 2, 4)  # gw0, gw3 differ mod 2 yet share


@requires_gpu
def test_this_worker_sees_its_own_gpu():
    """Under xdist on a GPU host: a pinned worker sees exactly its one GPU (the
    session-end check in gpupin compares the workers' device UUIDs)."""
    import torch

    if not os.environ.get("PYTEST_XDIST_WORKER") or gpus.current is None:
        pytest.skip("needs xdist workers pinned by the quack plugin (pytest -n N on a GPU host)")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == gpus.current.gpu
    assert torch.cuda.device_count() == 1
    torch.zeros(1, device="cuda")  # initialises CUDA here, so this worker records its GPU
    assert str(torch.cuda.get_device_properties(0).uuid)


_CONFTEST = """
import os
import gpupin
from gpupin import pytest_sessionfinish, pytest_terminal_summary, pytest_testnodedown

def _fake_record():
    # What torch.cuda.get_device_properties(0).uuid would say, from the pinned device
    # (no CUDA on this machine): {same} makes every worker claim one GPU.
    from quack.testing import gpus
    wid = os.environ.get("PYTEST_XDIST_WORKER")
    if not wid:
        return None
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    return {"worker": wid, "cvd": cvd, "uuid": {same} or "GPU-" + cvd, "pid": os.getpid(),
            "pinned": gpus.current is not None, "workers": int(os.environ["PYTEST_XDIST_WORKER_COUNT"])}

gpupin.record = _fake_record
"""


@pytest.mark.parametrize("same,ok", [("None", True), ('"GPU-one"', False)], ids=["round-robin", "shared"])
def test_session_end_check_through_xdist(pytester, monkeypatch, same, ok):
    """The helper's plumbing on CPU: records travel from 3 xdist workers pinned over two
    (fake) GPUs to the controller; a wrong assignment fails the session."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.setenv("QUACK_PYTEST_GPU_PIN", "1")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    )
    pytester.makeconftest(_CONFTEST.replace("{same}", same))
    pytester.makepyfile(
        test_a="""
        import pytest
        @pytest.mark.parametrize("i", range(9))
        def test_x(i):
            pass
    """
    )
    r = pytester.runpytest_subprocess("-n", "3", "-p", "no:cacheprovider", timeout=300)
    out = r.stdout.str()
    assert "quack GPU pinning: 3 workers on" in out, out
    if ok:
        assert r.ret == 0 and "PROBLEM" not in out
        assert "gw0: CUDA_VISIBLE_DEVICES=3" in out and "gw1: CUDA_VISIBLE_DEVICES=5" in out
    else:
        assert r.ret == 1 and "PROBLEM" in out and "not on the same GPU" not in out
        assert "are on the same GPU; round-robin over 2 GPUs says otherwise" in out


_WRITER = r"""
import os, sys, time
from quack.testing.gpus import GpuLock
lock = GpuLock(sys.argv[1], wait_s=float(sys.argv[2]))
assert lock.shared()                      # a test running on the shared GPU
open(sys.argv[3] + ".ready", "w").close()
while not os.path.exists(sys.argv[4]):    # both workers hold it shared, then both OOM
    time.sleep(0.01)
got = lock.exclusive()                    # the OOM retry
with open(sys.argv[3], "a") as f:
    f.write(f"{int(got)} {time.monotonic()}\n")
time.sleep(0.2)                           # the retried test
lock.release()
lock.shared()                             # back to the next test
lock.release()
"""


@pytest.mark.parametrize("wait_s", [60.0])
def test_two_workers_ooming_at_once_take_turns_instead_of_deadlocking(tmp_path, wait_s):
    # Two xdist workers on one GPU both hit CUDA OOM while the other still held its
    # reader lock: each waited for the other (gate vs reader hold) forever.
    import subprocess
    import sys
    import time
    import uuid

    gpu = f"test-{uuid.uuid4().hex[:8]}"
    go = tmp_path / "go"
    outs = [tmp_path / f"w{i}" for i in range(2)]
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, gpu, str(wait_s), str(o), str(go)]) for o in outs
    ]
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"w{i}.ready").exists() for i in range(2)):
            assert time.monotonic() < deadline, "writers did not start"
            time.sleep(0.01)
        go.touch()
        rcs = [p.wait(timeout=30) for p in procs]  # deadlocked before the fix: TimeoutExpired
    finally:
        for p in procs:
            p.kill()
    assert rcs == [0, 0]
    lines = [o.read_text().split() for o in outs]
    assert [int(g) for g, _ in lines] == [1, 1]  # both got the GPU exclusively, in turn


def test_a_gpu_lock_wait_ends_with_a_warning_after_its_time_out(tmp_path):
    import uuid

    from quack.testing.gpus import GpuLock

    gpu = f"test-{uuid.uuid4().hex[:8]}"
    holder = GpuLock(gpu)
    assert holder.exclusive()
    waiter = GpuLock(gpu, wait_s=0.3)
    with pytest.warns(RuntimeWarning, match="still held by another test after 0.3 s; running without it"):
        assert waiter.shared() is False
    holder.release()
    assert waiter.shared() is True
    waiter.release()
