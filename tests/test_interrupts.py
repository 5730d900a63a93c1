"""Ctrl-C (SIGINT to the process group, as a terminal sends it) and SIGTERM (to the build's
pid only, as `kill` or a CI runner's cancel sends it) end `quack build` in every phase:
exit 130 / 143, no traceback, no entry of the interrupted keys, no process left in the
build's session. Each phase is reached by an event (a marker the gate package writes
where it stops), with the CPUs oversubscribed on purpose (busy_machine). SIGTERM and
SIGHUP to the whole process group (systemd's stop, `timeout`, a CI job's kill, a closed
terminal) reach the compile workers and the forkserver too: the build still ends them
itself and sweeps their temp files (exit 143 / 129)."""

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


def _stop(p: subprocess.Popen, sig: int, group: bool = False) -> str:
    if sig == signal.SIGINT or group:
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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signal_to_the_process_group_mid_compile_leaves_no_temp_file(tmp_path, sig):
    """Both workers hold a reserved temp object (``<key>.o.tmp-<worker pid>-...``) when the
    signal reaches the whole group. It used to kill the workers and the forkserver with the
    build: the forkserver's death made join() return before the workers were gone, the
    sweep took them (zombies) for live writers and left both temp files, and the summary
    still said "no partial entries were left"; SIGHUP killed the build with no cleanup and
    no summary (exit 129)."""
    p, cache, marks = _start(tmp_path, "compile")
    try:
        # The gate writes its marker inside the compile, after the worker reserved its
        # temp object: both workers are mid-compile with a temp file on disk.
        assert wait_for(lambda: len(list(marks.glob("compile-*"))) >= 2, scaled(120)), "no compile started"
        tmps = list(cache.glob("v1/*/qgate/*/*.o.tmp-*"))
        assert len(tmps) == 2, tmps
        out = _stop(p, sig, group=True)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate(timeout=60)
    _check_ended_cleanly(p, out, sig, cache, marks)
    assert "0 compiled before the stop; 2 not built (no partial entries were left)" in out, out[-3000:]


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


class _StuckWorkerExecutor:
    """One "worker" (a real child process, ``proc``) holding a temp object of the key it
    was given when Ctrl-C comes; ``cancel`` kills it (``kill``) and does not reap it (a
    forkserver's worker is the forkserver's child, not the build's), or leaves it running
    (a worker stuck in the kernel)."""

    name = "stuck"
    jobs = 1
    start_s = 0.0

    def __init__(self, store: DiskStore, proc: subprocess.Popen, kill: bool):
        self.store, self.proc, self.kill = store, proc, kill
        self.tmp: Path | None = None

    def start(self, n):
        """Nothing to start: the stand-in's one "worker" is the test's own child process."""

    def submit(self, item):
        from quack.compile import builder

        ref = builder.entry_ref(item.spec, item.bound, item.arch)
        d = self.store.paths(ref)["obj"].parent
        d.mkdir(parents=True, exist_ok=True)
        self.tmp = d / f"{ref.key}.o.tmp-{self.proc.pid}-0badcafe"
        self.tmp.write_bytes(b"half an object")

    def poll(self, timeout):
        raise KeyboardInterrupt

    def worker_pids(self):
        return [self.proc.pid]

    def cancel(self):
        if self.kill:
            os.kill(self.proc.pid, signal.SIGKILL)  # not reaped: a zombie until Popen.wait

    def close(self):
        """Nothing to stop: the test reaps its child itself."""


def _interrupted_build(tmp_path, monkeypatch, kill: bool):
    import io

    from rich.console import Console
    from test_build_scheduler import _cfg

    from quack_build.build import progress

    monkeypatch.setattr(scheduler, "WORKERS_GONE_S", scaled(2.0) if kill else 0.2)
    store = DiskStore(tmp_path / "cache", fsync=False)
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        ex = _StuckWorkerExecutor(store, proc, kill)
        tasks = planning.plan([_cfg(32)], store)
        res = scheduler.BuildSession(tasks, store, scheduler.BuildOptions(jobs=1, executor=ex)).run()
        con = Console(file=io.StringIO(), width=300)
        progress.print_summary(con, res)
        assert ex.tmp is not None
        return res, con.file.getvalue(), ex.tmp
    finally:
        proc.kill()
        proc.stdin.close()
        proc.wait(60)


def test_an_interrupted_build_sweeps_the_temp_file_of_a_worker_it_killed(tmp_path, monkeypatch):
    """The killed worker is a zombie when the sweep runs: kill(pid, 0) still answers for a
    zombie, so "is its writer alive" said yes and the temp object stayed, while the
    summary said no partial entry was left."""
    res, out, tmp = _interrupted_build(tmp_path, monkeypatch, kill=True)
    assert res.interrupted and res.partial_left == []
    assert not tmp.exists()
    assert "not built (no partial entries were left)" in out, out


def test_an_interrupted_build_names_what_a_worker_still_alive_left(tmp_path, monkeypatch):
    """A worker that does not end within the bounded wait keeps its temp file (it may still
    write it), and the summary says so instead of "no partial entries were left"."""
    res, out, tmp = _interrupted_build(tmp_path, monkeypatch, kill=False)
    assert tmp.exists() and res.partial_left == [str(tmp)]
    assert res.to_json()["partial_left"] == [str(tmp)]
    assert "no partial entries" not in out, out
    assert "1 partial file left, which `quack cache clean` removes once the writer has ended" in out
    assert str(tmp) in out


def test_the_watchdog_hard_exit_stops_the_ray_instance_the_build_started(monkeypatch):
    """hard_exit (the cleanup ran past its grace) killed the compile workers but left the
    local Ray instance of `--executor ray`: its raylet died with the build and the raylet's
    agents ran on for a minute. stop_ray, which hard_exit calls, stops the instance the
    way ray.shutdown does (each process a SIGTERM first: the raylet stops its children);
    nothing when Ray is not imported or started no instance here."""
    import types

    from quack_build.build import interrupts

    calls = []

    class Node:
        def kill_all_processes(self, **kw):
            calls.append(kw)

    monkeypatch.setitem(sys.modules, "ray._private.worker", types.SimpleNamespace(_global_node=Node()))
    interrupts.stop_ray()
    assert calls == [{"check_alive": False, "allow_graceful": True}]
    monkeypatch.setitem(sys.modules, "ray._private.worker", types.SimpleNamespace(_global_node=None))
    interrupts.stop_ray()  # connected to a cluster, or ray.init not done: none of ours
    monkeypatch.delitem(sys.modules, "ray._private.worker", raising=False)
    interrupts.stop_ray()  # Ray never imported
    assert len(calls) == 1

    class Exited(Exception):
        """The stand-in's exit: the test catches it where the process would have ended."""

    def exit_now(code):
        raise Exited(code)

    done = []
    monkeypatch.setattr(interrupts, "kill_children", lambda: done.append("workers"))
    monkeypatch.setattr(interrupts, "stop_ray", lambda: done.append("ray"))
    monkeypatch.setattr(interrupts.os, "_exit", exit_now)
    with pytest.raises(Exited, match="130"):
        interrupts.hard_exit(130, "interrupted: the cleanup did not end (a test of hard_exit)")
    assert done == ["workers", "ray"]
