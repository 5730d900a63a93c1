"""Ctrl-C under `-n 2 --async-compile`: the xdist workers' counts never reach the
controller, and its summary line said "0 keys submitted ... 0 deferrals" for a run that
had submitted and deferred. It must say the counts are unknown instead. A real pytest
subprocess, interrupted with SIGINT to its process group (what a terminal's Ctrl-C does)."""

import os
import re
import signal
import subprocess
import sys

import pytest
from interrupt_support import wait_for

pytest_plugins = ["pytester"]

# Each test says it started, then waits (bounded) for a file nobody writes: both workers
# are inside a test when the run is interrupted.
BLOCKING = r"""
import os, time
import pytest

@pytest.mark.parametrize("i", range(4))
def test_blocks(i):
    d = os.environ["QT_DIR"]
    open(os.path.join(d, f"started-{os.environ['PYTEST_XDIST_WORKER']}"), "w").close()
    end = time.monotonic() + 120
    while time.monotonic() < end and not os.path.exists(os.path.join(d, "never")):
        time.sleep(0.05)
"""


def test_interrupted_xdist_run_says_the_counts_are_unknown(pytester, tmp_path, monkeypatch):
    qt = tmp_path / "qt"
    qt.mkdir()
    monkeypatch.setenv("QT_DIR", str(qt))
    monkeypatch.setenv("QUACK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("QUACK_MODE", raising=False)
    pytester.makepyfile(test_block=BLOCKING)
    p = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--async-compile=1"],
        cwd=pytester.path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        started = wait_for(lambda: len(list(qt.glob("started-*"))) == 2, 120, "both workers in a test")
        assert started, "the xdist workers never started their tests"
        os.killpg(p.pid, signal.SIGINT)
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
    assert p.returncode == pytest.ExitCode.INTERRUPTED, out[-3000:]
    assert "KeyboardInterrupt" in out
    # none of the workers reported (a worker that did is counted, the others named unknown)
    unknown = r"quack: (keys submitted, failed and deferrals unknown|the counts of 1 of 2 xdist workers are unknown)"
    assert re.search(unknown + ": the session ended before they reported", out), out[-3000:]
    assert not re.search(r"quack: 0 keys submitted", out), out[-3000:]
