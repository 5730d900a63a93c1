"""The pytest plugin, end to end in pytester subprocesses with real CPU compiles
of the toy kernels: --async-compile single-process and under xdist (load and
worksteal), the fault cases, OOM retry, strict prebuilt mode, the integrity check."""

import re

import pytest
import toykernels
from reliability_support import NO_TORCH

pytest_plugins = ["pytester"]

SUITE = r"""
import os
import pytest
import toykernels, poolkernels

def _note(name):
    with open(os.path.join(os.environ["QT_DIR"], name), "a") as f:
        f.write("x")

@pytest.fixture(scope="module")
def fixture_kernel():
    _note("fixture_setup")
    return toykernels.toy_scale("bfloat16", 64, False)   # a setup-phase miss

def test_setup_phase(fixture_kernel):
    _note("setup_body")   # must run once: never on a half-built fixture
    assert callable(fixture_kernel)

def test_call_phase():
    assert callable(toykernels.toy_scale("bfloat16", 64, True))

def test_same_key_again():
    assert callable(toykernels.toy_scale("bfloat16", 64, True))

def test_swallows_exceptions():
    try:
        k = toykernels.toy_scale("float16", 128, True)
    except Exception:
        k = None
    assert k is not None

def test_no_kernel():
    pass

def test_compile_error():
    poolkernels.pool_fault("raise", 7)

def test_worker_killed():
    poolkernels.pool_fault("selfkill", 8)

def test_wedged():
    poolkernels.pool_fault("wedge", 9)

def test_oom_once():
    marker = os.path.join(os.environ["QT_DIR"], "oom")
    if not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

def test_oom_always():
    raise RuntimeError("CUDA out of memory. Tried to allocate 4.00 GiB")
"""


@pytest.fixture
def run_env(pytester, tmp_path, monkeypatch):
    qt = tmp_path / "qt"
    qt.mkdir()
    monkeypatch.setenv("QT_DIR", str(qt))
    monkeypatch.setenv("QUACK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("QUACK_COMPILE_TIMEOUT", "4")
    monkeypatch.delenv("QUACK_MODE", raising=False)
    # These runs load kernels and never hand one a tensor: tvm_ffi is imported with torch
    # hidden (~3 CPU-s less in each pytest process and xdist worker of every run).
    pytester.makeconftest(NO_TORCH)
    return qt


@pytest.mark.parametrize(
    "xdist",
    [[], ["-n", "2"], ["-n", "2", "--dist", "worksteal"]],
    ids=["single", "xdist-load", "xdist-worksteal"],
)
def test_async_compile_defers_and_reports_each_test_once(pytester, run_env, xdist):
    pytester.makepyfile(test_suite=SUITE)
    r = pytester.runpytest_subprocess(
        "--async-compile=2", "-rA", "-p", "no:cacheprovider", *xdist, timeout=600
    )
    out = r.stdout.str()
    # failed: the compile error, the killed worker (WorkerDied), the wedged compile (its
    # worker killed at QUACK_COMPILE_TIMEOUT: CompileTimeout, never compiled again in the
    # test's own process, which would only move the hang there) and the OOM that stays
    r.assert_outcomes(passed=6, failed=4)
    # One real outcome per test: every test name appears once in the -rA summary.
    for name in (
        "test_setup_phase",
        "test_call_phase",
        "test_same_key_again",
        "test_swallows_exceptions",
        "test_no_kernel",
        "test_compile_error",
        "test_worker_killed",
        "test_wedged",
        "test_oom_once",
        "test_oom_always",
    ):
        assert len(re.findall(rf"^(PASSED|FAILED|ERROR) test_suite.py::{name}\b", out, re.M)) == 1, name
    assert re.search(r"^FAILED test_suite.py::test_compile_error - quack.errors.CompileError", out, re.M)
    assert "deliberate compile failure" in out
    assert re.search(r"^FAILED test_suite.py::test_worker_killed - quack.errors.WorkerDied", out, re.M)
    assert re.search(r"compile worker pid \d+ killed by SIGKILL while compiling", out)
    assert re.search(r"^FAILED test_suite.py::test_wedged - quack.errors.CompileTimeout", out, re.M)
    assert "compile_timeout" in out
    assert (run_env / "setup_body").read_text() == "x", "the body ran on a half-built fixture"
    m = re.search(
        r"quack: (\d+) keys submitted \((\d+) compiled, [\d.]+ s compile\), (\d+) failed, "
        r"(\d+) deferrals(.*)",
        out,
    )
    assert m, out[-3000:]
    submitted, compiled, failed, deferrals = map(int, m.groups()[:4])
    assert submitted >= 6 and failed >= 2 and deferrals >= 6
    assert "timed out" in m.group(5)
    assert "2 retried after CUDA OOM (1 saved: passed on the retry)" in m.group(5)
    assert "CUDA OOM retry: test_suite.py::test_oom_once (saved)" in out
    assert "CUDA OOM retry: test_suite.py::test_oom_always (not saved)" in out
    assert "INTEGRITY" not in out


def test_tests_on_one_wedged_key_wait_for_one_time_out(pytester, run_env):
    """Three tests asking for one wedged key: one submission and one time-out
    (QUACK_COMPILE_TIMEOUT=4), the other tests fail at once with the same CompileTimeout,
    saying it timed out in this process. Each test resubmitted the key and waited its
    own compile_timeout: N tests took N times compile_timeout."""
    pytester.makepyfile(
        test_w="""
        import pytest, poolkernels

        @pytest.mark.parametrize("i", range(3))
        def test_wedged_same_key(i):
            poolkernels.pool_fault("wedge", 4343)
    """
    )
    r = pytester.runpytest_subprocess("--async-compile=2", "-rA", "-p", "no:cacheprovider", timeout=600)
    r.assert_outcomes(failed=3)
    out = r.stdout.str()
    assert "quack: 1 keys submitted (0 compiled" in out and ", 1 failed," in out, out[-3000:]
    assert ", 1 timed out" in out, out[-3000:]
    assert (
        len(
            re.findall(
                r"^FAILED test_w.py::test_wedged_same_key\[\d\] - quack.errors.CompileTimeout", out, re.M
            )
        )
        == 3
    )
    assert "timed out in this process" in out


def test_warm_rerun_defers_nothing(pytester, run_env):
    pytester.makepyfile(
        test_ok="""
        import toykernels
        from quack import settings
        def test_a():
            assert callable(toykernels.toy_scale("float32", 320, False))
        def test_own_cache_waits_instead_of_deferring(tmp_path):
            saved = settings.installed()
            settings.set_current(settings.resolve({"cache_dir": str(tmp_path / "c"), "mode": "jit"}))
            try:
                assert callable(toykernels.toy_scale("float32", 352, False))
            finally:
                settings.set_current(saved)
    """
    )
    r1 = pytester.runpytest_subprocess("--async-compile", "-p", "no:cacheprovider", timeout=300)
    r1.assert_outcomes(passed=2)
    assert "quack: 2 keys submitted" in r1.stdout.str() and " 1 deferrals" in r1.stdout.str()
    r2 = pytester.runpytest_subprocess("--async-compile", "-p", "no:cacheprovider", timeout=300)
    r2.assert_outcomes(passed=2)
    assert "quack: 1 keys submitted" in r2.stdout.str() and " 0 deferrals" in r2.stdout.str()


STRICT = r"""
import pytest
import toykernels
from quack import settings
from quack.errors import KernelNotPrebuilt

def test_prebuilt_hit():
    assert callable(toykernels.toy_scale("float32", 480, False))

def test_miss_fails():
    toykernels.toy_scale("float32", 512, False)

def test_swallowed_miss_still_fails():
    try:
        toykernels.toy_scale("float32", 512, True)
    except KernelNotPrebuilt:
        pass

def test_own_settings_unaffected(tmp_path):
    saved = settings.installed()
    settings.set_current(settings.resolve({"cache_dir": str(tmp_path / "c"), "mode": "jit"}))
    try:
        assert callable(toykernels.toy_scale("float32", 544, False))
        with pytest.raises(KernelNotPrebuilt):   # deliberate, under the test's own settings
            settings.set_current(settings.resolve({"cache_dir": str(tmp_path / "c"), "mode": "prebuilt"}))
            toykernels.toy_scale("float32", 576, False)
    finally:
        settings.set_current(saved)

def test_leaves_no_settings():
    settings.set_current(None)

def test_still_strict_afterwards():
    toykernels.toy_scale("float32", 512, False)
"""


@pytest.mark.parametrize("how", ["flag", "env"])
def test_prebuilt_strict_mode(pytester, run_env, quack_settings, cache_dir, monkeypatch, how):
    toykernels.toy_scale("float32", 480, False)  # the one prebuilt entry
    monkeypatch.setenv("QUACK_CACHE_DIR", str(cache_dir))
    pytester.makepyfile(test_strict=STRICT)
    args = ["-rA", "-p", "no:cacheprovider"]
    if how == "flag":
        args.append("--quack-prebuilt")
    else:
        monkeypatch.setenv("QUACK_MODE", "prebuilt")
    r = pytester.runpytest_subprocess(*args, timeout=300)
    out = r.stdout.str()
    r.assert_outcomes(passed=3, failed=3)
    for name in ("test_miss_fails", "test_swallowed_miss_still_fails", "test_still_strict_afterwards"):
        assert re.search(rf"^FAILED test_strict.py::{name} - ", out, re.M), (name, out[-3000:])
    assert out.count("is not prebuilt") >= 3 and "Add this to a manifest" in out
    assert "the test asked for a kernel that is not prebuilt (and caught the error)" in out


def test_integrity_check_fails_a_run_with_a_lost_report(pytester, run_env):
    pytester.makeconftest("""
        import quack.testing.runner as qp
        _orig = qp.Runner._log
        def _lossy(self, item, reports):
            if "lost" not in item.nodeid:
                _orig(self, item, reports)
        qp.Runner._log = _lossy
    """)
    pytester.makepyfile(
        test_x="""
        def test_fine():
            pass
        def test_lost():
            pass
    """
    )
    r = pytester.runpytest_subprocess("--async-compile=1", "-p", "no:cacheprovider", timeout=300)
    assert r.ret == 1
    out = r.stdout.str()
    assert "INTEGRITY ERROR: 1 collected test(s) produced no report" in out
    assert "test_x.py::test_lost" in out


def test_xdist_workers_pinned_round_robin(pytester, run_env, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.setenv("QUACK_PYTEST_GPU_PIN", "1")
    pytester.makepyfile(
        test_pin="""
        import os
        import pytest
        @pytest.mark.parametrize("i", range(6))
        def test_gpu(i):
            wid = int(os.environ["PYTEST_XDIST_WORKER"][2:])
            assert os.environ["CUDA_VISIBLE_DEVICES"] == ["3", "5"][wid % 2]
            assert os.environ["QUACK_PYTEST_GPU_SHARED"] == ("1" if int(os.environ["PYTEST_XDIST_WORKER_COUNT"]) > 2 else "0")
    """
    )
    r = pytester.runpytest_subprocess("-n", "3", "-p", "no:cacheprovider", timeout=300)
    r.assert_outcomes(passed=6)


def test_deferred_attempt_frees_what_the_test_allocated(pytester, run_env):
    # On the H200 a cold --async-compile run of the kernel tests failed 187 tests with
    # CUDA OOM: each deferred attempt's CompilePending kept its traceback, so its frame
    # and every tensor it had allocated lived until the retry. The retry must find the
    # first attempt's objects gone (gc.collect is what the OOM path does, too).
    pytester.makepyfile(
        test_frames="""
        import gc, weakref
        import toykernels

        class Big:
            pass

        REFS = []

        def test_frees_between_attempts():
            gc.collect()
            assert all(r() is None for r in REFS), "a deferred attempt kept its locals alive"
            big = Big()
            REFS.append(weakref.ref(big))
            assert callable(toykernels.toy_scale("float32", 416, True))
            assert len(REFS) == 2  # deferred once, then passed on the retry
    """
    )
    r = pytester.runpytest_subprocess("--async-compile=1", "-p", "no:cacheprovider", timeout=300)
    r.assert_outcomes(passed=1)
    assert " 1 deferrals" in r.stdout.str()


# A kernel called on a thread the test started, re-raised on the test's thread: what
# torch's autograd does with a backward (it runs on its own device thread for CUDA
# tensors, and relays the backward's exception to the caller of .backward()).
THREADED = r"""
import threading
import toykernels

def call_on_a_thread(fn, swallow=()):
    box = []
    def run():
        try:
            fn()
        except swallow:
            pass
        except BaseException as e:  # relayed like autograd's engine does
            box.append(e)
    t = threading.Thread(target=run)
    t.start()
    t.join(120)
    assert not t.is_alive()
    if box:
        raise box[0]
"""


def test_a_miss_on_autograds_thread_defers_instead_of_waiting(pytester, run_env):
    # On the H200 a cold --async-compile run of the training tests crawled: every miss
    # in a backward (autograd's device thread) saw no deferral scope, so it waited for
    # its compile on the test's thread, one compile at a time (did not end in 210 s).
    pytester.makepyfile(
        threaded=THREADED,
        test_thr="""
        import toykernels
        from threaded import call_on_a_thread
        def test_backward_like():
            call_on_a_thread(lambda: toykernels.toy_scale("float32", 448, True))
        def test_two_threads_one_test():
            call_on_a_thread(lambda: toykernels.toy_scale("float16", 448, True))
            call_on_a_thread(lambda: toykernels.toy_scale("bfloat16", 448, True))
    """,
    )
    r = pytester.runpytest_subprocess("--async-compile=2", "-p", "no:cacheprovider", timeout=300)
    r.assert_outcomes(passed=2)
    out = r.stdout.str()
    # 3 keys, each a deferral (a miss that waited would have been no deferral at all)
    assert "quack: 3 keys submitted" in out and " 3 deferrals" in out, out[-2000:]


def test_strict_mode_sees_a_swallowed_miss_on_another_thread(pytester, run_env, cache_dir, monkeypatch):
    monkeypatch.setenv("QUACK_CACHE_DIR", str(cache_dir))
    pytester.makepyfile(
        threaded=THREADED,
        test_thr="""
        from quack.errors import KernelNotPrebuilt
        import toykernels
        from threaded import call_on_a_thread
        def test_swallowed_on_a_thread():
            call_on_a_thread(lambda: toykernels.toy_scale("float32", 608, True), swallow=KernelNotPrebuilt)
    """,
    )
    r = pytester.runpytest_subprocess("--quack-prebuilt", "-rA", "-p", "no:cacheprovider", timeout=300)
    r.assert_outcomes(failed=1)
    assert "the test asked for a kernel that is not prebuilt (and caught the error)" in r.stdout.str()
