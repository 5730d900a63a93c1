"""The plugin's parts (quack/testing/): strict mode from quack.toml, no side
effects at import, the configured --quack-max-defers in the summary. pytester
subprocesses with real CPU compiles of the toy kernels."""

import json
import os
import subprocess
import sys

import pytest

pytest_plugins = ["pytester"]


@pytest.fixture
def run_env(pytester, tmp_path, monkeypatch):
    monkeypatch.setenv("QUACK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("QUACK_COMPILE_TIMEOUT", "60")
    monkeypatch.delenv("QUACK_MODE", raising=False)
    return tmp_path


def test_quack_toml_prebuilt_mode_turns_on_strict_mode(pytester, run_env):
    # No option, no QUACK_MODE: only [runtime] mode in quack.toml. The test swallows
    # the miss; strict mode must still fail it.
    pytester.makefile(".toml", quack='[runtime]\nmode = "prebuilt"\narch = "sm_90a"\n')
    pytester.makepyfile(
        test_strict="""
        import toykernels

        def test_swallowed_miss():
            try:
                toykernels.toy_scale("float32", 480, False)
            except Exception:  # swallowed on purpose: strict mode must fail the test anyway
                return
    """
    )
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    r.assert_outcomes(failed=1)
    assert "the test asked for a kernel that is not prebuilt" in r.stdout.str()


def test_quack_toml_jit_mode_is_not_strict(pytester, run_env):
    # The same test as under prebuilt mode above, a kernel not in the (empty) cache: in jit
    # mode it is compiled, and the test passes; strict mode would have failed it.
    pytester.makefile(".toml", quack='[runtime]\nmode = "jit"\narch = "sm_90a"\n')
    pytester.makepyfile(
        test_plain="""
        import toykernels

        def test_kernel_not_in_the_cache():
            assert callable(toykernels.toy_scale("float32", 480, False))
    """
    )
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    r.assert_outcomes(passed=1)
    assert "not prebuilt" not in r.stdout.str()


def test_importing_the_plugin_changes_no_environment(tmp_path):
    code = (
        "import os, json; before = dict(os.environ); import quack.testing.plugin; "
        "print(json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))"
    )
    env = dict(
        os.environ,
        PYTEST_XDIST_WORKER="gw1",
        PYTEST_XDIST_WORKER_COUNT="2",
        CUDA_VISIBLE_DEVICES="3,5",
        QUACK_PYTEST_GPU_PIN="1",
    )
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=str(tmp_path)
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {}


def test_summary_prints_the_configured_max_defers(pytester, run_env):
    pytester.makepyfile(
        test_sync="""
        import toykernels

        def test_compiles_synchronously():
            assert callable(toykernels.toy_scale("float32", 352, True))
    """
    )
    r = pytester.runpytest_subprocess(
        "--async-compile=1", "--quack-max-defers=0", "-p", "no:cacheprovider", timeout=300
    )
    r.assert_outcomes(passed=1)
    out = r.stdout.str()
    assert "1 synchronous after 0 deferrals" in out, out
    assert " 0 deferrals" in out


def test_summary_lists_the_compile_errors_the_tests_consumed(pytester, run_env):
    """The session's failed keys are listed in the summary, each with the line that says
    why. The pool forgot each error once a test had raised it (so a later call may
    retry), and the summary, which read them from the pool at the end, listed none."""
    pytester.makepyfile(
        test_fail="""
        import poolkernels

        def test_fails():
            poolkernels.pool_fault("raise", 4242)

        def test_fails_again_on_the_same_key():
            poolkernels.pool_fault("raise", 4242)
    """
    )
    r = pytester.runpytest_subprocess("--async-compile=1", "-p", "no:cacheprovider", timeout=300)
    r.assert_outcomes(failed=2)
    out = r.stdout.str()
    assert "quack: 1 keys submitted (0 compiled" in out and ", 1 failed," in out, out[-3000:]
    lines = [ln.strip() for ln in out.splitlines() if "compile error:" in ln]
    assert lines == [
        "compile error: compiling pool_fault {'mode': 'raise', 'tag': 4242} for sm_90a failed: "
        "ValueError: pool_fault: deliberate compile failure (tag 4242)"
    ], out[-3000:]
