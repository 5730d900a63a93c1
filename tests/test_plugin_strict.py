"""Strict (prebuilt) mode cannot be escaped: a test that met a kernel miss fails whatever
it then did (passed, skipped in its body or a fixture, xfailed); a test skipped before any
miss stays skipped. pytester subprocesses with an empty cache, so every toy kernel misses."""

import os
import re

import pytest
from reliability_support import NO_TORCH

from quack import settings

pytest_plugins = ["pytester"]

ESCAPES = r"""
import pytest
import toykernels
from quack.errors import KernelNotPrebuilt

def test_skips_on_the_miss():
    try:
        toykernels.toy_scale("float32", 512, False)
    except KernelNotPrebuilt:
        pytest.skip("kernel not prebuilt")

@pytest.fixture
def kernel():
    try:
        return toykernels.toy_scale("float32", 544, False)
    except KernelNotPrebuilt:
        pytest.skip("kernel not prebuilt")

def test_fixture_skips_on_the_miss(kernel):
    pass

@pytest.mark.xfail(reason="expected to miss")
def test_xfails_on_the_miss():
    toykernels.toy_scale("float32", 576, False)

@pytest.mark.xfail(reason="swallows the miss")
def test_xpasses_after_a_swallowed_miss():
    try:
        toykernels.toy_scale("float32", 608, False)
    except KernelNotPrebuilt:
        pass

def test_skips_before_any_miss():
    pytest.skip("nothing to do with kernels")
    toykernels.toy_scale("float32", 640, False)

@pytest.mark.skipif(True, reason="marked skip")
def test_marked_skip():
    toykernels.toy_scale("float32", 672, False)

@pytest.mark.xfail(reason="fails for another reason")
def test_xfails_without_a_miss():
    assert False
"""


@pytest.fixture
def run_env(pytester, tmp_path, monkeypatch):
    monkeypatch.setenv("QUACK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("QUACK_MODE", raising=False)
    pytester.makeconftest(NO_TORCH)
    return tmp_path


def test_a_miss_fails_the_test_whatever_its_outcome(pytester, run_env):
    pytester.makepyfile(test_escapes=ESCAPES)
    r = pytester.runpytest_subprocess("--quack-prebuilt", "-rA", "-p", "no:cacheprovider", timeout=300)
    out = r.stdout.str()
    r.assert_outcomes(failed=3, errors=1, skipped=2, xfailed=1)
    for name, how in (
        ("test_skips_on_the_miss", "and was skipped:"),
        ("test_fixture_skips_on_the_miss", "and was skipped:"),  # at set-up: an error
        ("test_xfails_on_the_miss", "and was xfailed:"),
        ("test_xpasses_after_a_swallowed_miss", "(and caught the error):"),
    ):
        status = "ERROR" if "fixture" in name else "FAILED"
        assert re.search(rf"^{status} test_escapes.py::{name} - quack --quack-p", out, re.M), name
        section = rf"_ {'ERROR at setup of ' if 'fixture' in name else ''}{name} _+\n"
        head = "quack --quack-prebuilt: the test asked for a kernel that is not prebuilt "
        assert re.search(section + re.escape(head + how), out), (name, out[-4000:])
    for n in (512, 544, 576, 608):  # each names its kernel and how to build it
        assert re.search(rf"kernel 'toy_scale' with \{{'dtype': 'float32', 'block': {n}, ", out), n
    assert out.count("and run: quack build --arch sm_90a MANIFEST") >= 4
    assert re.search(r"^SKIPPED \[1\] test_escapes.py:\d+: nothing to do with kernels", out, re.M)
    assert re.search(r"^SKIPPED \[1\] test_escapes.py:\d+: marked skip", out, re.M)
    assert re.search(r"^XFAIL test_escapes.py::test_xfails_without_a_miss", out, re.M)


ESCAPES_MORE = r"""
import pytest
import toykernels
from quack import settings
from quack.errors import KernelNotPrebuilt

def test_override_then_skip():
    # an override keeps the mode and the cache: the miss is the session's
    with settings.override(compile_timeout=30) as s:
        assert s.mode == "prebuilt"
        try:
            toykernels.toy_scale("float32", 448, False)
        except KernelNotPrebuilt:
            pytest.skip("kernel not prebuilt")

def test_override_caught():
    with settings.override(compile_timeout=30):
        try:
            toykernels.toy_scale("float32", 480, False)
        except KernelNotPrebuilt:
            pass

@pytest.fixture
def teardown_miss():
    yield
    try:
        toykernels.toy_scale("float32", 704, False)
    except KernelNotPrebuilt:
        pass

def test_teardown_catches(teardown_miss):
    pass

@pytest.fixture
def setup_miss():
    try:
        toykernels.toy_scale("float32", 736, False)
    except KernelNotPrebuilt:
        pass
    yield

def test_setup_catches(setup_miss):
    pass  # the call's report fails, once: not the teardown's too

def test_private_prebuilt_cache(tmp_path):
    with settings.override(cache_dir=tmp_path / "own", mode="prebuilt"):
        with pytest.raises(KernelNotPrebuilt):  # the test's own business
            toykernels.toy_scale("float32", 768, False)
"""


def test_a_miss_under_an_override_or_in_a_teardown_fails_too(pytester, run_env):
    """Only a miss under the very settings object the plugin installed counted: any
    settings.override() (here a compile_timeout) let a caught miss pass or skip, and a
    fixture's teardown that caught one passed (only set-up and call were checked)."""
    pytester.makepyfile(test_more=ESCAPES_MORE)
    r = pytester.runpytest_subprocess("--quack-prebuilt", "-rA", "-p", "no:cacheprovider", timeout=300)
    out = r.stdout.str()
    r.assert_outcomes(failed=3, passed=2, errors=1)
    head = "quack --quack-prebuilt: the test asked for a kernel that is not prebuilt "
    for name, how in (
        ("test_override_then_skip", "and was skipped:"),
        ("test_override_caught", "(and caught the error):"),
        ("test_setup_catches", "(and caught the error):"),
    ):
        assert re.search(rf"^FAILED test_more.py::{name} - quack --quack-p", out, re.M), name
        assert re.search(rf"_ {name} _+\n" + re.escape(head + how), out), (name, out[-4000:])
    assert re.search(r"^ERROR test_more.py::test_teardown_catches - quack --quack-p", out, re.M), out[-4000:]
    assert re.search(r"_ ERROR at teardown of test_teardown_catches _+\n" + re.escape(head), out)
    assert not re.search(r"^ERROR test_more.py::test_setup_catches", out, re.M)  # charged once
    assert re.search(r"^PASSED test_more.py::test_private_prebuilt_cache", out, re.M)
    for n in (448, 480, 704, 736):
        assert re.search(rf"kernel 'toy_scale' with \{{'dtype': 'float32', 'block': {n}, ", out), n
        assert re.search(rf"^block = {n}$", out, re.M), n  # the manifest entry


COLLECTED_MISS = r"""
import pytest
import toykernels
from quack.errors import KernelNotPrebuilt
try:
    K = toykernels.toy_scale("float16", {block}, False)  # a miss at import (collection)
except KernelNotPrebuilt:
    K = None
{rest}
"""


def test_a_miss_while_collecting_fails_the_collector(pytester, run_env):
    """A module that caught a miss at import and skipped its tests (skipif(K is None), or
    a module-level skip) was 1 skipped, exit status 0: no test attempt was running."""
    pytester.makepyfile(
        test_skipif=COLLECTED_MISS.format(
            block=352,
            rest='@pytest.mark.skipif(K is None, reason="kernel unavailable")\ndef test_uses_k():\n    pass\n',
        ),
        test_modskip=COLLECTED_MISS.format(
            block=384, rest='if K is None:\n    pytest.skip("no kernel", allow_module_level=True)\n'
        ),
    )
    r = pytester.runpytest_subprocess("--quack-prebuilt", "-rA", "-p", "no:cacheprovider", timeout=300)
    out = r.stdout.str()
    assert r.ret == pytest.ExitCode.INTERRUPTED, out[-3000:]
    r.assert_outcomes(errors=2)
    for mod, n, how in (
        ("test_skipif", 352, "(and caught the error)"),
        ("test_modskip", 384, "and was skipped"),
    ):
        assert re.search(rf"^ERROR {mod}.py - quack --quack-p", out, re.M), (mod, out[-4000:])
        head = f"quack --quack-prebuilt: collecting {mod}.py asked for a kernel that is not prebuilt {how}:"
        assert re.search(rf"_ ERROR collecting {mod}.py _+\n" + re.escape(head), out), (mod, out[-4000:])
        assert re.search(rf"^block = {n}$", out, re.M), n


def test_a_miss_in_an_initial_conftest_fails_the_session(pytester, run_env, tmp_path):
    """The rootdir conftest is imported before pytest_configure installed the strict
    settings: a kernel it called compiled on demand, and a caught miss passed."""
    pytester.makeconftest(NO_TORCH + COLLECTED_MISS.format(block=320, rest=""))
    pytester.makepyfile(test_plain="def test_plain():\n    pass\n")
    r = pytester.runpytest_subprocess("--quack-prebuilt", "-rA", "-p", "no:cacheprovider", timeout=300)
    out = r.stdout.str()
    assert r.ret == pytest.ExitCode.INTERRUPTED, out[-3000:]
    head = "quack --quack-prebuilt: a conftest.py loaded before collection asked for a kernel that is not prebuilt"
    assert head in out and re.search(r"^block = 320$", out, re.M), out[-3000:]
    assert not list((tmp_path / "cache").rglob("*.o"))  # nothing compiled


CHILD = r"""
import os, subprocess, sys

def test_kernel_in_a_child_process():
    # a distributed / multi-process test whose ranks call the kernel
    child = 'import toykernels; toykernels.toy_scale("float32", 416, False)'
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                       env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-3000:]
"""


@pytest.mark.parametrize("xdist", [[], ["-n", "1"]], ids=["single", "xdist"])
def test_strict_mode_reaches_the_processes_a_test_starts(pytester, run_env, tmp_path, xdist):
    """--quack-prebuilt only installed the prebuilt settings in the pytest process: a
    child that called a kernel compiled it on demand (the cache gained an .o) and the test
    passed. The plugin exports QUACK_MODE=prebuilt to the session's processes."""
    pytester.makepyfile(test_child=CHILD)
    r = pytester.runpytest_subprocess(
        "--quack-prebuilt", "-rA", "-p", "no:cacheprovider", *xdist, timeout=300
    )
    out = r.stdout.str()
    r.assert_outcomes(failed=1)
    assert "KernelNotPrebuilt: kernel 'toy_scale' with {'dtype': 'float32', 'block': 416" in out, out[-3000:]
    assert re.search(r"^E +block = 416$", out, re.M), out[-3000:]  # the manifest entry
    assert not list((tmp_path / "cache").rglob("*.o"))


def test_the_exported_cache_is_put_back(monkeypatch, tmp_path):
    """QUACK_PYTEST_PREBUILT_CACHE is the session's only while it runs (an in-process
    pytest run, or the code after pytest.main, sees the environment it had)."""
    from types import SimpleNamespace

    from quack.testing import strict

    var = settings.PREBUILT_CACHE_ENV
    for before in (None, "/elsewhere"):
        if before is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, before)
        config = SimpleNamespace(stash=pytest.Stash())
        strict.export_cache(config, tmp_path / "c")
        strict.export_cache(config, tmp_path / "c")  # again, at configure: still the value from before
        assert os.environ[var] == os.path.realpath(tmp_path / "c")
        strict.restore_cache(config)
        assert os.environ.get(var) == before
        strict.restore_cache(config)  # nothing left to put back
        assert os.environ.get(var) == before
