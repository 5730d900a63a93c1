"""The GPU tier's background `quack verify --run` job (tests/verify_all.py), with stand-in
commands: steps run in order, the first failure or time-out ends it and is named, the
test's wait is bounded, and stopping it kills the step in progress. Then when the plugin
starts it early (one process, the test selected, a GPU) and when not."""

import os
import sys
import types
from pathlib import Path

import pytest
import verify_all

PY = sys.executable


def _job(*cmds, limit=60.0):
    return verify_all.Job([([PY, "-c", c], limit) for c in cmds], dict(os.environ), cwd=Path.cwd())


def test_steps_run_in_order_and_the_last_ones_output_is_reported():
    failed, out = _job("print('built')", "print('verified: all good')").outcome(timeout=120)
    assert failed == "" and out.strip() == "verified: all good"


def test_the_first_failing_step_ends_the_job_and_is_named(tmp_path):
    marker = tmp_path / "second-ran"
    job = _job("import sys; print('broken build'); sys.exit(3)", f"open({str(marker)!r}, 'w')")
    failed, out = job.outcome(timeout=120)
    assert failed == f"{PY}: exit status 3" and "broken build" in out
    assert not marker.exists()


def test_a_step_over_its_limit_is_killed_and_named():
    job = _job("import time; print('slow', flush=True); time.sleep(600)", limit=1.0)
    failed, out = job.outcome(timeout=120)
    assert "over its 1 s limit (killed)" in failed and "slow" in out


def test_a_wait_that_runs_out_stops_the_job_and_kills_its_step(tmp_path):
    pidfile = tmp_path / "pid"
    job = _job(f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(600)")
    failed, _ = job.outcome(timeout=0.5)
    assert failed == "not done in 0 s (stopped)"
    assert job.done.is_set()  # the thread ended: nothing left waiting
    if pidfile.exists():  # the step had started: it is gone
        pid = int(pidfile.read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_stopped_job_starts_no_further_step(tmp_path):
    marker = tmp_path / "second-ran"
    job = _job("import time; time.sleep(600)", f"open({str(marker)!r}, 'w')")
    job.stop()
    assert job.done.is_set() and not marker.exists()
    failed, _ = job.outcome(timeout=5)
    assert failed  # never "" for a job that was stopped


def test_the_real_steps_build_then_verify_every_shipped_manifest():
    (b, tb), (v, tv) = verify_all.steps()
    mans = sorted(str(p) for p in (verify_all.ROOT / "manifests").glob("*.toml"))
    assert b[0] == "build" and b[-len(mans) :] == mans and tb > 0
    assert v[:2] == ["verify", "--run"] and v[-len(mans) :] == mans and tv > 0


def _session(nodeids, collectonly=False):
    items = [types.SimpleNamespace(nodeid=n) for n in nodeids]
    return types.SimpleNamespace(
        items=items, config=types.SimpleNamespace(option=types.SimpleNamespace(collectonly=collectonly))
    )


@pytest.fixture
def started(monkeypatch):
    """Jobs the plugin starts, recorded instead of run."""
    seen = []

    class Rec:
        def __init__(self, commands, env, cwd=None):
            self.commands, self.env, self.stopped = commands, env, False
            seen.append(self)

        def stop(self):
            self.stopped = True

    monkeypatch.setattr(verify_all, "Job", Rec)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setenv("QUACK_TEST_KERNEL_CACHE", "/tmp/kc")
    return seen


def test_one_process_run_starts_the_job_when_collection_ends(started):
    p = verify_all.Plugin(lambda: True)
    p.pytest_collection_finish(_session(["tests/x.py::t", verify_all.NODEID]))
    assert len(started) == 1 and started[0].env["QUACK_CACHE_DIR"] == "/tmp/kc"
    assert started[0].commands[1][0][1:4] == ["-m", "quack_build", "verify"]
    assert p.take("/tmp/kc") is started[0] and len(started) == 1  # the test gets that job


@pytest.mark.parametrize("why", ["not selected", "no GPU", "xdist worker", "collect only"])
def test_no_early_start(started, monkeypatch, why):
    p = verify_all.Plugin(lambda: why != "no GPU")
    if why == "xdist worker":
        monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    ids = ["tests/x.py::t"] + ([] if why == "not selected" else [verify_all.NODEID])
    p.pytest_collection_finish(_session(ids, collectonly=why == "collect only"))
    assert started == []
    job = p.take("/tmp/kc")  # the test, when it runs, starts its own
    assert started == [job] and job.env["QUACK_CACHE_DIR"] == "/tmp/kc"


def test_an_early_job_on_another_cache_is_stopped_not_reported(started):
    p = verify_all.Plugin(lambda: True)
    p.pytest_collection_finish(_session([verify_all.NODEID]))
    early = started[0]
    job = p.take("/elsewhere")
    assert early.stopped and job is not early and job.env["QUACK_CACHE_DIR"] == "/elsewhere"


def test_the_session_end_stops_a_job_nobody_took(started):
    p = verify_all.Plugin(lambda: True)
    p.pytest_collection_finish(_session([verify_all.NODEID]))
    p.pytest_sessionfinish(_session([]))
    assert started[0].stopped and p.job is None


def test_a_real_stop_leaves_no_process(tmp_path):
    """The real thing, end to end: a sleeping step's process is gone after stop()."""
    pidfile = tmp_path / "pid"
    job = _job(f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(600)")
    for _ in range(600):  # bounded: the step writes its pid once it runs
        if pidfile.exists() and pidfile.read_text():
            break
        job.done.wait(0.1)
    pid = int(pidfile.read_text())
    job.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
