"""The plugin's options and settings refuse bad values once, at start-up, with a usage
error that names the option or variable and what is allowed (pytester subprocesses)."""

import os

import pytest

pytest_plugins = ["pytester"]


@pytest.fixture
def run_env(pytester, tmp_path, monkeypatch):
    monkeypatch.setenv("QUACK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("QUACK_MODE", raising=False)
    pytester.mkdir("tests_dir")
    pytester.path.joinpath("tests_dir", "test_a.py").write_text("def test_a():\n    pass\n")
    return tmp_path


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["--async-compile", "tests_dir"],
            "argument --async-compile: expected a number of compile workers, got 'tests_dir': "
            "write --async-compile=N (N >= 0, 0 = one per CPU), or put the test paths before a bare --async-compile",
        ),
        (
            ["--async-compile=-3", "tests_dir"],
            "argument --async-compile: expected a number of compile workers >= 0 (0 = one per CPU), got -3",
        ),
        (
            ["--quack-max-defers=-5", "tests_dir"],
            "argument --quack-max-defers: expected an integer >= 0 (the deferrals before a test compiles "
            "synchronously; default 20), got '-5': write --quack-max-defers=K",
        ),
    ],
    ids=["bare-before-a-path", "negative-workers", "negative-defers"],
)
def test_bad_option_values_are_usage_errors(pytester, run_env, args, says):
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args, timeout=120)
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert says in r.stderr.str()
    assert "Traceback" not in r.stderr.str()


@pytest.mark.parametrize(
    "args",
    [["tests_dir", "--async-compile"], ["--async-compile", "-q", "tests_dir"]],
    ids=["last", "before-option"],
)
def test_a_bare_async_compile_still_works(pytester, run_env, args):
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args, timeout=120)
    r.assert_outcomes(passed=1)
    assert "quack: 0 keys submitted" in r.stdout.str()


def test_async_compile_is_capped_at_the_cpu_count(pytester, run_env):
    pytester.path.joinpath("tests_dir", "test_pool.py").write_text(
        "import os\n"
        "from quack.compile import pool\n"
        "def test_pool_size():\n"
        "    assert pool.configure_default().jobs == (os.cpu_count() or 1)\n"
    )
    r = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--async-compile=100000", "tests_dir", timeout=120
    )
    r.assert_outcomes(passed=2)
    cpus = os.cpu_count() or 1
    line = f"quack: --async-compile=100000 capped at {cpus} compile workers (the CPU count)"
    assert r.stdout.str().count(line) == 1


KERNEL_TEST = "import toykernels\ndef test_k():\n    toykernels.toy_scale('float32', 64, False)\n"


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["single", "xdist"])
def test_a_bad_quack_mode_stops_the_session_once(pytester, run_env, monkeypatch, xdist):
    # No quack option: before, every test that called a kernel failed on the SettingsError.
    monkeypatch.setenv("QUACK_MODE", "bogus")
    pytester.path.joinpath("tests_dir", "test_k.py").write_text(KERNEL_TEST)
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider", *xdist, "tests_dir", timeout=120)
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    err = r.stderr.str()
    says = "quack: environment variable QUACK_MODE='bogus' is invalid: expected 'jit' or 'prebuilt' (fix or unset it"
    assert err.count(says) == 1, err
    assert "FAILED" not in r.stdout.str() and "Traceback" not in err


def test_a_malformed_quack_toml_stops_the_session_once(pytester, run_env):
    pytester.makefile(".toml", quack="[runtime]\nmode = 3\n")
    pytester.path.joinpath("tests_dir", "test_k.py").write_text(KERNEL_TEST)
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider", "tests_dir", timeout=120)
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    err = r.stderr.str()
    assert err.count("quack.toml: runtime.mode = 3 is invalid: expected 'jit' or 'prebuilt'") == 1, err
