"""The GPU tier's `quack verify --run` over every shipped manifest, started in the background
as soon as collection ends, so it shares the GPU with the other tests instead of following them.

`test_verify_run_passes_over_every_shipped_manifest` (tests/kernels/test_reference_hooks_gpu.py)
runs `quack build` (a no-op for what README command 2 built) then `quack verify --run` over
manifests/*.toml: ~1,170 configurations, 38 s of the warm strict tier's 93 s on the H200
when it ran in line. Both are subprocesses that use the GPU only through verify's loader
processes, which already share the one GPU among themselves, so the job can overlap the rest.

* One pytest process: `Plugin.pytest_collection_finish` starts the job when the test is
  selected and a GPU is visible; the test waits for it.
* Under xdist the test is a unit of its own, handed out first (tests/xdist_units.py), so it
  overlaps the GPU unit on another worker; it runs the job when it comes.

Every wait has an exit: each step is bounded (`STEPS`), the test's wait is bounded, and the
session's end (a failure, `-x`, Ctrl-C) kills a job still running."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = "quack-verify-all"
NODEID = "tests/kernels/test_reference_hooks_gpu.py::test_verify_run_passes_over_every_shipped_manifest"


def steps(root: Path = ROOT) -> list[tuple[list[str], float]]:
    """The job's commands (arguments of `python -m quack_build`) and each one's time limit."""
    mans = sorted(glob.glob(os.path.join(root, "manifests", "*.toml")))
    jobs = str(min(16, os.cpu_count() or 1))
    # verify's loader processes share the one GPU: 8 at most (its own default's cap).
    load_jobs = str(min(8, os.cpu_count() or 1))
    return [
        (["build", "-j", jobs, *mans], 2400.0),
        (["verify", "--run", "-j", load_jobs, *mans], 1200.0),
    ]


class Job:
    """``commands`` run one after another in a thread, each a subprocess bounded by its
    limit; the first that fails (or times out) ends the job. ``outcome()``: (the failed
    step's name or "", the last step's output)."""

    def __init__(self, commands: list[tuple[list[str], float]], env: dict, cwd: Path = ROOT):
        self._commands, self._env, self._cwd = commands, env, cwd
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._stopped = False
        self._failed = "not finished"
        self._out = ""
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="quack-verify-all", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for cmd, limit in self._commands:
                with self._lock:
                    if self._stopped:
                        self._failed = f"{cmd[0]}: stopped"
                        return
                    self._proc = subprocess.Popen(
                        cmd,
                        cwd=self._cwd,
                        env=self._env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                    )
                try:
                    self._out, _ = self._proc.communicate(timeout=limit)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._out, _ = self._proc.communicate()
                    self._failed = f"{cmd[0]}: over its {limit:.0f} s limit (killed)"
                    return
                if self._proc.returncode != 0:
                    self._failed = f"{cmd[0]}: exit status {self._proc.returncode}"
                    return
            self._failed = ""
        except BaseException as e:  # noqa: BLE001 - reported by outcome(), not lost in a thread
            self._failed = f"the job broke: {e!r}"
        finally:
            self.done.set()

    def outcome(self, timeout: float) -> tuple[str, str]:
        """Waits at most ``timeout`` s; a job still running then is stopped and reported."""
        if not self.done.wait(timeout):
            self.stop()
            return f"not done in {timeout:.0f} s (stopped)", self._out
        return self._failed, self._out

    def stop(self) -> None:
        """Kills the running step and starts no other; returns once the thread has ended."""
        with self._lock:
            self._stopped = True
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()
        self._thread.join(30)


def quack_commands(env_cache: str, root: Path = ROOT) -> tuple[list[tuple[list[str], float]], dict]:
    env = dict(os.environ, QUACK_CACHE_DIR=env_cache)
    return [([sys.executable, "-m", "quack_build", *a], t) for a, t in steps(root)], env


def kernel_cache_dir() -> str:
    """The cache the `kernel_cache` fixture names (tests/kernels/_fixtures.py)."""
    from quack import settings

    return os.environ.get("QUACK_TEST_KERNEL_CACHE") or str(settings.get().cache_dir)


class Plugin:
    """Registered by tests/conftest.py: starts the job early in a one-process run.
    ``has_gpu``: whether a GPU is visible (the test skips without one)."""

    def __init__(self, has_gpu) -> None:
        self._has_gpu = has_gpu
        self.job: Job | None = None
        self.cache = ""

    def pytest_collection_finish(self, session) -> None:
        if os.environ.get("PYTEST_XDIST_WORKER") or session.config.option.collectonly:
            return  # an xdist worker: the test is its own unit, handed out first
        if any(it.nodeid == NODEID for it in session.items) and self._has_gpu():
            self.cache = kernel_cache_dir()
            self.job = Job(*quack_commands(self.cache))

    def take(self, cache: str) -> Job:
        """The job started at collection if it used ``cache``, else one started now."""
        job, self.job = self.job, None
        if job is not None and self.cache == cache:
            return job
        if job is not None:  # another cache than the test's (a fixture override): not its job
            job.stop()
        return Job(*quack_commands(cache))

    def pytest_sessionfinish(self, session) -> None:
        if self.job is not None:
            self.job.stop()
            self.job = None
