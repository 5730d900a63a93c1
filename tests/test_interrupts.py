"""Ctrl-C (SIGINT to the process group, as a terminal sends it) and SIGTERM (to the build's
pid only, as `kill` or a CI runner's cancel sends it) end `quack build` in every phase:
exit 130 / 143, no traceback, no entry of the interrupted keys, no process left in the
build's session. Each phase is reached by an event (a marker the gate package writes
where it stops), with the CPUs oversubscribed on purpose (busy_machine)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from interrupt_support import busy_machine, gate_env, scaled, session_processes, wait_for, write_gate_project

from quack.cache.store import DiskStore
from quack_build.build import plan as planning
from quack_build.build import results, scheduler

__all__ = ["busy_machine"]  # the fixture, used by name

GRACE_S = 8.0  # quack_build.build.interrupts.GRACE_S: the longest a cleanup may take


def _start(tmp_path: Path, block: str, **extra: str):
    proj, pkgs, marks = write_gate_project(tmp_path)
    cache = tmp_path / "cache"
    p = subprocess.Popen(
        [sys.executable, "-m", "quack_build.cli.main", "build", "-j", "2", "-v"],
        cwd=proj,
        env=gate_env(cache, pkgs, marks, block, **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own session: what is left of it can be listed
    )
    return p, cache, marks


def _stop(p: subprocess.Popen, sig: int) -> str:
    if sig == signal.SIGINT:
        os.killpg(p.pid, sig)
    else:
        os.kill(p.pid, sig)
    try:
        out, _ = p.communicate(timeout=scaled(30) + GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate(timeout=60)
        pytest.fail(f"quack build did not end after {signal.Signals(sig).name}:\n{out[-3000:]}")
    return out


def _check_ended_cleanly(p, out: str, sig: int, cache: Path, marks: Path) -> None:
    left = wait_for(lambda: not session_processes(p.pid), scaled(10))
    survivors = session_processes(p.pid)
    (marks / "release").touch()  # let anything still gated go (it fails the test anyway)
    assert left, f"processes left after {signal.Signals(sig).name}: {survivors}"
    assert p.returncode == 128 + sig, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "interrupted" in out, out[-3000:]
    assert not list(cache.glob("v1/*/qgate/*/*.o")), "an object of an interrupted key was left"
    assert not list(cache.glob("v1/*/qgate/*/*.tmp-*"))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("phase", ["import", "preload", "compile"])
def test_a_signal_ends_the_build_in_every_phase(tmp_path, busy_machine, phase, sig):
    """import: before any worker exists (a SIGTERM there used to kill the build without
    any cleanup, rc -15); preload: the forkserver importing cutlass and the kernels (it
    outlived the build, holding its stdout open, until its preload ended); compile: a
    worker compiling (SIGTERM used to exit 130)."""
    p, cache, marks = _start(tmp_path, phase)
    try:
        got = wait_for(lambda: sorted(marks.glob(f"{phase}-*")), scaled(120))
        assert got, f"the build never reached the {phase} phase"
        out = _stop(p, sig)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate(timeout=60)
    _check_ended_cleanly(p, out, sig, cache, marks)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_thread_stuck_at_exit_cannot_keep_the_build_alive(tmp_path, sig):
    """A library thread blocked for ever in a read (the remote pull's open() of a FIFO was
    one): interpreter exit joins it, so the interrupted build never ended. The watchdog
    armed by the signal ends it within its grace, with the signal's exit status."""
    p, cache, marks = _start(tmp_path, "compile", QGATE_STUCK_THREAD="1")
    try:
        assert wait_for(lambda: sorted(marks.glob("compile-*")), scaled(120)), "no compile started"
        out = _stop(p, sig)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate(timeout=60)
    assert "did not end within" in out, out[-3000:]
    _check_ended_cleanly(p, out, sig, cache, marks)


class _InterruptedRemote:
    """A remote tier whose fetch is interrupted by Ctrl-C (as a pull blocked in a slow or
    hung remote is)."""

    url = "file:///nowhere"
    offline = False

    def fetch(self, ref):
        raise KeyboardInterrupt

    class counters:  # noqa: N801 - the tier's attribute
        @staticmethod
        def to_json():
            return {}


class _RecordingExecutor:
    name = "fake"
    jobs = 1

    def __init__(self):
        self.started = False

    def start(self, n):
        self.started = True
        raise AssertionError("the build went on compiling after Ctrl-C in the pull")


def test_ctrl_c_during_the_pull_stops_the_build(tmp_path):
    """It used to be swallowed: the build went on to compile everything and exited 0."""
    from test_build_scheduler import _cfg

    store = DiskStore(tmp_path / "cache", fsync=False)
    tasks = planning.plan([_cfg(32), _cfg(64)], store)
    ex = _RecordingExecutor()
    res = scheduler.BuildSession(
        tasks, store, scheduler.BuildOptions(jobs=1, remote=_InterruptedRemote(), executor=ex)
    ).run()
    assert res.interrupted and not ex.started
    assert res.count(results.INTERRUPTED) == 2 and not res.ok
