"""The command line's option values and argument errors: each is checked before any work
(a bad ``--trace``, ``--table`` or ``--out`` used to fail after a whole build or GPU run, in
a traceback), named with its option and what it allows, with exit 2 for a usage error and
1 for a problem; ``quack bundle inspect`` refuses a FIFO or a device at once; the settings'
number fields say what they allow. Real CLI subprocesses (each bounded by a time-out) and
typer's runner; counts and messages are asserted, never durations."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from reliability_support import env, run_quack, write_toy_project
from typer.testing import CliRunner

from quack import settings
from quack.errors import BundleError, SettingsError
from quack_build.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
SOFTMAX = '[[kernel]]\nname = "softmax_fwd"\n[kernel.params]\ndtype = "float32"\nn = 4096\n'


def _cli(args, cwd: Path, timeout: float = 120, **extra):
    """``quack ARGS`` in ``cwd``; (exit status, stdout + stderr). Never a traceback."""
    r = run_quack(args, cwd=cwd, timeout=timeout, env_=env(QUACK_CACHE_DIR=cwd / "cache", **extra))
    out = r.stdout + r.stderr
    assert "Traceback" not in out, out[-3000:]
    return r.returncode, out


def _objects(cache: Path) -> list:
    return list(cache.glob("v1/*/*/*/*.o")) if cache.exists() else []


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """A toy project (tests/toykernels.py) as the working directory, with its own cache."""
    m = write_toy_project(tmp_path / "proj")
    monkeypatch.chdir(m.parent)
    monkeypatch.setenv("QUACK_CACHE_DIR", str(tmp_path / "cache"))
    saved = settings.installed()
    yield m
    settings.set_current(saved)


def test_trace_path_is_checked_before_building(toy, tmp_path, monkeypatch):
    for bad, why in (
        (tmp_path / "nonexistent" / "t.json", "does not exist: create it first"),
        (tmp_path, "is a directory; give the path of a file to write"),
    ):
        r = runner.invoke(app, ["build", "--trace", str(bad)])
        assert r.exit_code == 2 and f"error: --trace {bad}: " in r.output and why in r.output, r.output
        assert "quack build summary" not in r.output and not _objects(tmp_path / "cache")
    r = runner.invoke(app, ["build", "--dry-run", "--trace", str(tmp_path / "t.json")])
    assert r.exit_code == 2 and "--trace records a build and --dry-run builds nothing" in r.output

    # A trace that cannot be written at the end (its directory gone since the check): an
    # error line after the summary, exit 1, no traceback; the build itself is done.
    from quack_build.build import trace as tracing

    real, gone = tracing.write_trace, tmp_path / "gone"
    gone.mkdir()

    def write_after_rmdir(path, res, t0):
        gone.rmdir()
        real(path, res, t0)

    monkeypatch.setattr(tracing, "write_trace", write_after_rmdir)
    r = runner.invoke(app, ["build", "--trace", str(gone / "t.json")])
    assert r.exit_code == 1 and "quack build summary" in r.output, r.output
    assert f"error: --trace {gone / 't.json'}: cannot write the trace (No such file" in r.output
    assert len(_objects(tmp_path / "cache")) == 1


def test_bundle_inspect_refuses_fifos_devices_and_directories_at_once(tmp_path):
    from quack_build.bundle.inspect import inspect_wheel

    fifo = tmp_path / "f.whl"
    os.mkfifo(fifo)
    for path, kind in (
        (fifo, "a FIFO"),
        (Path("/dev/zero"), "a character device"),
        (tmp_path, "a directory"),
    ):
        rc, out = _cli(["bundle", "inspect", path], tmp_path, timeout=30)  # it hung / ate GBs
        assert rc == 1 and f"error: {path}: is {kind}" in out and "not a wheel file" in out, out
        with pytest.raises(BundleError) as ei:
            inspect_wheel(path)
        assert ei.value.path == str(path)


def test_tune_executor_and_float_options_are_checked_at_parsing(tmp_path):
    m = tmp_path / "m.toml"
    m.write_text(SOFTMAX)
    for extra in (["--dry-run"], ["--compile-only"]):
        rc, out = _cli(["tune", m, *extra, "--executor", "bogus"], ROOT)
        assert rc == 2 and "Invalid value for '--executor': expected 'local', 'ray', 'auto'" in out, out
    for bad in ("nan", "inf", "-inf"):
        r = runner.invoke(app, ["tune", str(m), "--dry-run", "--min-gain", bad])
        assert r.exit_code == 2 and "Invalid value for '--min-gain'" in r.output, r.output
    for bad in ("nan", "inf", "infs"):
        r = runner.invoke(app, ["tune", str(m), "--dry-run", "--budget", bad])
        assert r.exit_code == 2 and f"--budget {bad!r}" in r.output, r.output
    assert not _objects(ROOT / "cache")


def test_tune_table_is_checked_and_read_before_anything_is_done(tmp_path):
    m = tmp_path / "m.toml"
    m.write_text(SOFTMAX)
    bad = tmp_path / "bad.toml"
    bad.write_text("garbage = [\n")
    for table, rc_want, why in (
        (tmp_path, 2, "is a directory; give the path of a file to write"),
        (tmp_path / "no" / "t.toml", 2, "does not exist: create it first"),
        (bad, 1, "cannot read it: " + str(bad) + ": TOML syntax error"),
    ):
        rc, out = _cli(["tune", m, "--dry-run", "--table", table], ROOT)
        assert rc == rc_want and f"error: --table {table}: " in out and why in out, out
        assert "candidates" not in out  # refused before the problems were listed
    rc, out = _cli(["tune", m, "--dry-run", "--table", bad, "--from-empty"], ROOT)
    assert rc == 0 and "softmax_fwd(" in out, out  # --from-empty replaces it: not read

    from quack import registry
    from quack.tuning import Row, Table
    from quack_build.cli.tune_measure import check_tables

    registry.load_packages(settings.get().kernel_packages)  # as the CLI has: rows are checked against it
    good = tmp_path / "good.toml"
    Table("sm_90a", "H200", [Row("softmax_fwd", "H200", "small", (1, 8), {"online": True})]).write(good)
    loaded = check_tables([good, tmp_path / "new.toml"], given=True, from_empty=False)
    assert len(loaded[good].rows) == 1 and loaded[tmp_path / "new.toml"] is None


def test_a_table_that_cannot_be_written_keeps_the_winners(tmp_path, monkeypatch, capsys):
    """Written elsewhere, said in an error line and in each problem's result (it was a
    traceback after all the measuring, the winners lost)."""
    import dataclasses

    from quack_kernels._configs import GemmConfig
    from rich.console import Console

    from quack import registry
    from quack.compile import autotune as at
    from quack.compile import pool as qpool
    from quack.tuning import Table
    from quack_build.cli.tune import _label, problems
    from quack_build.cli.tune_measure import measure_and_write

    s = dataclasses.replace(settings.get(), tune_gpu="H200")
    registry.load_packages(s.kernel_packages)
    m = tmp_path / "m.toml"
    m.write_text(
        '[defaults]\narchs = ["sm_90a"]\n[[kernel]]\nname = "gemm"\nproblems = [[1024, 1024, 1024]]\n'
        '[kernel.params]\ndtype = "bfloat16"\n'
    )
    probs = problems(s, [m], None, 10_000)
    win = GemmConfig(tile_m=256, tile_n=128, cluster_m=1, cluster_n=2, schedule="coop")

    class NoPool:
        def __init__(self, *a, **k):
            """Starts nothing: the engine is faked."""

        def shutdown(self):
            """Nothing to stop."""

    class Measurer:
        broken = ""

        def close(self):
            """No process to end."""

    monkeypatch.setattr(
        at,
        "autotune",
        lambda *a, **k: at.TuneResult({"config": win}, 1e-3, [({"config": win}, 1e-3)], [], 0, 0.0),
    )
    monkeypatch.setattr(qpool, "CompilePool", NoPool)
    monkeypatch.chdir(tmp_path)
    dest = tmp_path / "gone" / "t.toml"  # its directory is missing at the end
    _gpu, results, tables = measure_and_write(
        s, Console(file=None), probs, None, None, dest, True, _label, measurer=Measurer()
    )
    (r,) = results
    assert r["new"] == win.label() and r["written"]
    other = Path(r["table"])
    assert tables == [other] and other.parent == tmp_path and other.name.startswith("quack-tune-t-")
    assert [row.config for row in Table.load(other).rows] == [win.knobs()]
    err = capsys.readouterr().err
    assert err.count("error: ") == 1 and r["table_error"] in err
    assert f"error: --table {dest}: cannot write it (No such file or directory)" in err
    assert f"this run's winners were written to {other} instead: move it there" in err


def test_pull_without_trusted_keys_is_refused(tmp_path):
    write_toy_project(tmp_path)
    remote = tmp_path / "remote"
    remote.mkdir()
    rc, out = _cli(["cache", "pull"], tmp_path, QUACK_REMOTE=f"file://{remote}")
    assert rc == 1 and "error: pull needs trusted keys: set QUACK_TRUSTED_KEYS" in out, out
    assert "not available" not in out


def test_a_bad_config_field_is_named_with_what_it_allows(tmp_path):
    m = tmp_path / "m.toml"
    m.write_text(SOFTMAX + "config = { fwd_min_blocks = 99 }\n")
    rc, out = _cli(["build", "--dry-run", m], ROOT)
    assert rc == 1 and "expected a SoftmaxFwdConfig (a table with fields" in out, out
    assert "parameter 'fwd_min_blocks': 99 is not allowed; expected an integer in [0, 32]" in out
    m.write_text(SOFTMAX + "config = { fwd_min_blockz = 9 }\n")
    rc, out = _cli(["build", "--dry-run", m], ROOT)
    assert rc == 1 and "(unknown fields ['fwd_min_blockz']; fields are [" in out, out


@pytest.mark.parametrize(
    "var, value, want",
    [
        ("QUACK_COMPILE_JOBS", "abc", "expected an integer >= 0"),
        ("QUACK_COMPILE_TIMEOUT", "abc", "expected a number of seconds > 0"),
        ("QUACK_COMPILE_TIMEOUT", "inf", "expected a finite number of seconds > 0"),
        ("QUACK_LOCK_TIMEOUT", "soon", "expected a number of seconds > 0"),
        ("QUACK_REMOTE_TIMEOUT", "x", "expected seconds > 0 and <= 5"),
        ("QUACK_PYTEST_GPU_PIN", "maybe", "expected 'auto' or one of 1/0, true/false"),
    ],
)
def test_settings_values_say_what_is_allowed(var, value, want):
    with pytest.raises(SettingsError) as ei:
        settings.resolve(env={var: value})
    assert f"environment variable {var}={value!r} is invalid: {want}" in str(ei.value)
    assert "invalid literal" not in str(ei.value) and "could not convert" not in str(ei.value)


def test_executor_port_must_be_1_to_65535(tmp_path):
    from quack.settings import check_executor

    assert check_executor("ray://h:65535") == "ray://h:65535" and check_executor("h:1") == "h:1"
    for bad in ("ray://h:99999", "h:0", "h:65536"):
        with pytest.raises(ValueError, match="is not 1-65535"):
            check_executor(bad)
    write_toy_project(tmp_path)
    rc, out = _cli(["build", "-n", "--executor", "ray://h:99999"], tmp_path)
    assert rc == 2 and "Invalid value for '--executor': port 99999 is not 1-65535" in out, out


def test_arch_is_a_usage_error_of_the_flag(toy, tmp_path):
    for cmd in (["build"], ["verify"], ["bundle", "--name", "x"], ["cache", "pull"], ["cache", "push"]):
        r = runner.invoke(app, [*cmd, "--arch", "sm_xx"])
        assert r.exit_code == 2 and "Invalid value for '--arch': 'sm_xx': expected a CUDA arch" in r.output
        assert "in the manifests" not in r.output, (cmd, r.output)
    assert not _objects(tmp_path / "cache")


def test_manifest_errors_say_what_each_command_did_not_do(tmp_path):
    bad = write_toy_project(tmp_path, '[[kernel]]\nname = "toy_scale"\nparams = { dtype = "int3" }\n')
    remote = tmp_path / "remote"
    remote.mkdir()
    from quack import signing

    _key, pub = signing.write_keypair("r", tmp_path / "keys")
    for cmd, outcome in (
        (["verify"], "nothing was verified"),
        (["tune", "--dry-run"], "nothing was tuned"),
        (["bundle", "--name", "x", "-o", tmp_path / "dist"], "no bundle written"),
        (["cache", "pull"], "nothing was pulled"),
    ):
        rc, out = _cli([*cmd, bad], tmp_path, QUACK_REMOTE=f"file://{remote}", QUACK_TRUSTED_KEYS=pub)
        assert rc == 1 and f"1 problem in the manifests; {outcome}" in out, (cmd, out)
        assert "nothing was built" not in out, (cmd, out)


def test_tune_kernel_says_unknown_untunable_or_absent(tmp_path):
    m = tmp_path / "m.toml"
    m.write_text(SOFTMAX)
    rc, out = _cli(["tune", m, "--dry-run", "--kernel", "nope"], ROOT)
    assert rc == 1 and "--kernel nope: no kernel of that name is registered" in out, out
    assert "the kernels with a search space: " in out and "softmax_fwd" in out
    rc, out = _cli(["tune", m, "--dry-run", "--kernel", "rmsnorm_fwd"], ROOT)
    assert rc == 1 and "--kernel rmsnorm_fwd: not in the manifests given" in out, out
    write_toy_project(tmp_path / "toy")
    rc, out = _cli(["tune", "--dry-run", "--kernel", "toy_scale"], tmp_path / "toy")
    assert rc == 1 and "--kernel toy_scale: declares no search space" in out, out


def test_out_dirs_and_sizes_name_their_option(toy, tmp_path):
    r = runner.invoke(app, ["cache", "clean", "--max-size", "5X"])
    assert r.exit_code == 2 and "Invalid value for '--max-size': '5X' is not a size" in r.output
    r = runner.invoke(app, ["cache", "clean", "--older-than", "soon"])
    assert r.exit_code == 2 and "Invalid value for '--older-than': 'soon' is not an age" in r.output
    afile = tmp_path / "afile"
    afile.write_text("x")
    r = runner.invoke(app, ["keygen", "k", "-o", str(afile)])
    assert r.exit_code == 2 and f"error: --out-dir {afile}: is a file, not a directory" in r.output
    assert "Errno" not in r.output
    r = runner.invoke(app, ["bundle", "--name", "x", "-o", str(afile)])
    assert r.exit_code == 2 and f"error: --out {afile}: is a file, not a directory" in r.output
    assert not _objects(tmp_path / "cache"), "checked before the build"
    r = runner.invoke(app, ["keygen", "k", "-o", str(afile / "sub")])
    assert r.exit_code == 2 and f"{afile} is not a directory, so it cannot be created" in r.output


@pytest.mark.parametrize(
    "args, named",
    [
        (["m.toml"], "no manifests"),
        (["m.toml", "--arch", "sm_80"], "no manifests or --arch"),
        (["--max-configs", "5"], "no --max-configs"),
        (["m.toml", "--arch", "sm_80", "--max-configs", "10000"], "no manifests, --arch or --max-configs"),
    ],
)
def test_verify_bundles_refuses_the_manifest_options_it_would_ignore(tmp_path, args, named):
    """`verify --bundles m1.toml --arch sm_80` checked the bundles and silently ignored
    the manifests, --arch and --max-configs."""
    r = runner.invoke(app, ["verify", "--bundles", "--json", *args])
    assert r.exit_code == 2, r.output
    assert f"error: --bundles checks the installed bundles, which take {named} " in r.stderr, r.stderr
    assert r.stdout == ""


def test_json_output_of_a_refused_option_is_empty(tmp_path):
    """--json keeps stdout for the result document: an argument error writes nothing there."""
    write_toy_project(tmp_path)
    r = run_quack(["build", "--json", "--trace", tmp_path], cwd=tmp_path, timeout=60, env_=env())
    assert r.returncode == 2 and r.stdout == "" and "error: --trace" in r.stderr
