"""The plugin under --async-compile runs every attempt of every test through pytest's
``pytest_runtest_protocol`` hook, so the other plugins' wrappers of that hook wrap it:
pytest-timeout, faulthandler_timeout and the warnings summary (they were all off under
--async-compile: the runner called runtestprotocol itself). pytester subprocesses with
real CPU compiles of the toy kernels, single process and under xdist."""

import re

import pytest
from reliability_support import NO_TORCH

pytest_plugins = ["pytester"]

# Each slow test sleeps far past its pytest-timeout (5 s): it is failed by the timeout,
# or, where no timeout wraps it, passes after the sleep (the regression) - never a hang.
SUITE = r"""
import time
import warnings

import pytest
import toykernels

def test_plain_warns():
    warnings.warn("quack-plain-warning", UserWarning)

@pytest.mark.timeout(5)
def test_plain_slow():
    time.sleep(40)

def test_deferred_warns():
    assert callable(toykernels.toy_scale("float32", 640, False))   # a miss: deferred
    warnings.warn("quack-deferred-warning", UserWarning)            # on the retry

@pytest.mark.timeout(5)
def test_deferred_slow():
    assert callable(toykernels.toy_scale("float32", 640, False))   # deferred, or waits
    time.sleep(40)                                                  # on the retry

def test_last():
    pass
"""

NAMES = ("test_plain_warns", "test_plain_slow", "test_deferred_warns", "test_deferred_slow", "test_last")


@pytest.fixture
def run_env(pytester, tmp_path, monkeypatch):
    monkeypatch.setenv("QUACK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("QUACK_COMPILE_TIMEOUT", "120")
    monkeypatch.delenv("QUACK_MODE", raising=False)
    pytester.makeconftest(NO_TORCH)
    pytester.makepyfile(test_suite=SUITE)
    return tmp_path


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["single", "xdist"])
def test_every_attempt_runs_inside_the_other_plugins_protocol_wrappers(pytester, run_env, xdist):
    r = pytester.runpytest_subprocess(
        "--async-compile=1",
        "-rA",
        "-p",
        "no:cacheprovider",
        "-o",
        "faulthandler_timeout=3",
        "-W",
        "always::UserWarning",
        *xdist,
        timeout=300,
    )
    out = r.stdout.str()
    r.assert_outcomes(passed=3, failed=2, warnings=2)
    for name in NAMES:  # one real outcome per test
        assert len(re.findall(rf"^(PASSED|FAILED|ERROR) test_suite.py::{name}\b", out, re.M)) == 1, name
    # pytest-timeout failed both slow tests, the deferred one on its retry
    for name in ("test_plain_slow", "test_deferred_slow"):
        timed_out = rf"^FAILED test_suite.py::{name} - Failed: Timeout \(>5.0s\)"
        assert re.search(timed_out, out, re.M), out[-3000:]
    # the warnings summary names both warnings, each under its own test
    summary = out.split("warnings summary", 1)[1]
    assert re.search(r"test_suite.py::test_plain_warns\n.*\n\s+.*quack-plain-warning", summary), summary
    assert re.search(r"test_suite.py::test_deferred_warns\n.*\n\s+.*quack-deferred-warning", summary), summary
    m = re.search(r"quack: \d+ keys submitted .*, (\d+) deferrals", out)
    assert m and int(m.group(1)) >= 1, out[-3000:]
    if not xdist:  # faulthandler_timeout dumped the slow tests' stacks (an xdist worker's stderr is its own)
        err = r.stderr.str()
        assert err.count("Timeout (0:00:03)!") >= 2, err[-3000:]
        assert "in test_deferred_slow" in err and "in test_plain_slow" in err, err[-3000:]
    assert "INTEGRITY" not in out
