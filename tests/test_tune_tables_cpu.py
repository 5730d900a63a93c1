"""Tuning tables as data that ``quack tune`` writes and every bind reads (docs/tuning.md):
what a table that loads must be (writable back unchanged, no two rows that tie, no row a
lookup can never reach), and what a run that writes one must never lose (another run's
rows written meanwhile, the winners measured before an interrupt, the file's mode).

Each test here failed before its fix: a note with a newline was written raw and the table
no longer parsed (every kernel call failed); ``time_us = inf`` loaded, then crashed the
write after all the measuring; two runs writing one table kept only the last one's rows;
Ctrl-C on the last problem lost every finished winner; a class typo was silently never
used; ``--budget`` did not bound measuring; a NaN time won."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import threading

import pytest
from typer.testing import CliRunner

from quack import registry, settings
from quack.errors import TuningTableError
from quack.tuning import Row, Table

A = "sm_90a"
SOFTMAX_4096 = '[[kernel]]\nname = "softmax_fwd"\n[kernel.params]\ndtype = "bfloat16"\nn = 4096\n'


def _cli(args):
    """``quack ARGS`` in this process (typer's runner); the settings it installs are put back."""
    from quack_build.cli.app import app

    saved = settings.installed()
    try:
        return CliRunner().invoke(app, args)
    finally:
        settings.set_current(saved)


def _row(cls="small", n=(4096, 4096), dtype=("bfloat16",), config=None, kernel="softmax_fwd", **kw):
    return Row(kernel, "H200", cls, tuple(n), config or {"online": True}, tuple(dtype), **kw)


# ---------------------------------------------------------------- the file's values


@pytest.mark.parametrize("note", ["two\nlines", "a\rb", "del\x7f", "tab\there", 'q"uote\\', "\x01\x1f"])
def test_a_table_that_loads_is_written_back_unchanged(tmp_path, note):
    path = tmp_path / "t.toml"
    Table(A, "H200", [_row(note=note, time_us=1.5, shape="1x4096")]).write(path)
    (r,) = Table.load(path).rows
    assert r.note == note and r.time_us == 1.5
    text = path.read_text()
    Table.load(path).write(path)
    assert path.read_text() == text


@pytest.mark.parametrize(
    "line, field",
    [
        ("time_us = inf", "time_us"),
        ("time_us = nan", "time_us"),
        ("config = { online = 2026-01-01 }", "config"),
        ('config = { "a b" = 1 }', "config"),
        ("config = { online = [1] }", "config"),
        ("config = { online = inf }", "config"),
    ],
)
def test_a_value_the_writer_cannot_print_is_refused_on_load(tmp_path, line, field):
    """Refused where it is read, naming the row and field: not after a run's measuring,
    when the write raised and the winners went nowhere."""
    path = tmp_path / "t.toml"
    base = '[table]\narch = "sm_90a"\ndefault_gpu = "H200"\n[[row]]\nkernel = "softmax_fwd"\ngpu = "H200"\n'
    body = 'class = "small"\nn = [1, 8]\n'
    if not line.startswith("config"):
        body += "config = {}\n"
    path.write_text(base + body + line + "\n")
    with pytest.raises(TuningTableError) as e:
        Table.load(path)
    assert e.value.row == 1 and e.value.field == field, str(e.value)


def test_write_keeps_the_files_mode_and_writes_through_a_link(tmp_path):
    real = tmp_path / "real.toml"
    Table(A, "H200", [_row()]).write(real)
    real.chmod(0o644)
    link = tmp_path / "link.toml"
    link.symlink_to(real)
    t = Table.load(link)
    t.put(_row(n=(8192, 8192)))
    t.write(link)
    assert link.is_symlink() and stat.S_IMODE(real.stat().st_mode) == 0o644
    assert len(Table.load(real).rows) == 2
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# ---------------------------------------------------------------- which row applies


def test_the_row_with_fewer_dtypes_wins_whatever_the_file_order():
    hand = _row(dtype=("float16", "bfloat16"), config={"online": False})
    tuned = _row(dtype=("float16",), config={"online": True})
    for rows in ([hand, tuned], [tuned, hand]):
        t = Table(A, "H200", rows)
        assert t.lookup("softmax_fwd", "H200", "small", "float16", 4096).config == {"online": True}
        assert t.lookup("softmax_fwd", "H200", "small", "bfloat16", 4096).config == {"online": False}
    # one dtype set, whatever its spelling: a duplicate, not a second row
    with pytest.raises(TuningTableError, match="duplicate"):
        Table(A, "H200", [hand, _row(dtype=("bfloat16", "float16", "float16"))])


def test_rows_that_could_tie_are_refused(tmp_path):
    """Equal-width overlapping N ranges (and dtype sets as large that share a dtype): the
    answer depended on the rows' order, and ``write`` re-sorts them."""
    a = _row(n=(33, 96), dtype=(), config={"online": True})
    b = _row(n=(1, 64), dtype=(), config={"online": False})
    with pytest.raises(TuningTableError, match="ties with row"):
        Table(A, "H200", [a, b])
    path = tmp_path / "t.toml"
    Table(A, "H200", [a]).write(path)
    text = path.read_text().replace("[33, 96]", "[1, 64]")
    path.write_text(text + text[text.index("[[row]]") :].replace("[1, 64]", "[33, 96]"))
    with pytest.raises(TuningTableError, match="ties with row") as e:
        Table.load(path)
    assert e.value.row == 2
    # no tie: narrower, or disjoint dtypes, or one listing fewer dtypes
    Table(A, "H200", [a, _row(n=(1, 63), dtype=())])
    Table(A, "H200", [_row(n=(33, 96)), _row(n=(1, 64), dtype=("float16",))])
    Table(A, "H200", [_row(n=(33, 96), dtype=("float16", "bfloat16")), _row(n=(1, 64))])


def test_a_row_no_lookup_can_reach_is_named(tmp_path):
    """A class the kernel's classifier never produces, an unknown dtype, a GPU name not in
    its normalised form: refused by the kernel's derivation (every bind) and by quack tune's
    check of the table (with an unregistered kernel name too)."""
    from quack_kernels import _tuning, softmax

    from quack.tuning import use_table
    from quack_build.cli.tune_measure import check_rows

    registry.load_packages(["quack_kernels"])
    for bad, field in (
        (_row(cls="Small"), "class"),
        (_row(dtype=("bf16",)), "dtype"),
        (dataclasses.replace(_row(), gpu="h200"), "gpu"),
    ):
        t = Table(A, "H200", [bad], path=str(tmp_path / "t.toml"))
        with use_table(t), pytest.raises(TuningTableError) as e:
            softmax.compile_softmax_fwd.spec.bind(("bfloat16", 4096), {}, arch=A)
        assert e.value.field == field and e.value.row == 1, str(e.value)
        with pytest.raises(TuningTableError):
            check_rows(t)
    with pytest.raises(TuningTableError, match="'softmax_fw' is not a registered kernel") as e:
        check_rows(Table(A, "H200", [_row(kernel="softmax_fw")], path="t.toml"))
    assert e.value.field == "kernel"
    _tuning.reload()
    check_rows(_tuning.table(A))  # the checked-in table passes


# ---------------------------------------------------------------- quack tune's writes


def test_two_runs_writing_one_table_keep_each_others_rows(tmp_path):
    """Each run's winners are merged into the table as it is on disk at the end: the one
    written by another run since this one started stays (it was overwritten)."""
    from quack_build.cli.tune_measure import write_winners

    path = tmp_path / "t.toml"
    Table(A, "H200", [_row(n=(1, 1))]).write(path)
    write_winners(path, [_row(n=(2, 2))], A, "H200", from_empty=False)
    write_winners(path, [_row(n=(3, 3)), _row(n=(1, 1), config={"online": False})], A, "H200", False)
    rows = {r.n: r.config for r in Table.load(path).rows}
    assert rows == {(1, 1): {"online": False}, (2, 2): {"online": True}, (3, 3): {"online": True}}
    write_winners(path, [_row(n=(4, 4))], A, "H200", from_empty=True)
    assert [r.n for r in Table.load(path).rows] == [(4, 4)]


def test_a_table_locked_by_another_run_is_waited_for_then_written_elsewhere(tmp_path, monkeypatch, capsys):
    import filelock

    from quack_build.cli import tune_measure as tm

    path = tmp_path / "t.toml"
    Table(A, "H200", [_row(n=(1, 1))]).write(path)
    monkeypatch.setattr(tm, "TABLE_LOCK_TIMEOUT", 0.05)
    monkeypatch.chdir(tmp_path)
    results = [dict(table=str(path))]
    held = filelock.FileLock(str(tmp_path / ".t.toml.lock"))
    with held:  # another run writing it: this one's write waits, then gives up
        got = threading.Event()
        out: list = []

        def run():
            out.append(
                tm.write_tables(_Con(), {path: (A, "H200", {1: _row(n=(2, 2))})}, results, path, False)
            )
            got.set()

        th = threading.Thread(target=run)
        th.start()
        assert got.wait(60)
        th.join()
    (other,) = out[0]
    assert other != path and [r.n for r in Table.load(other).rows] == [(2, 2)]
    assert [r.n for r in Table.load(path).rows] == [(1, 1)]
    err = capsys.readouterr().err
    assert "another quack tune held its lock" in err and str(other) in err
    assert results[0]["table"] == str(other) and results[0]["table_error"]


class _Con:
    def __init__(self):
        self.lines: list = []

    def print(self, text, markup=False):
        self.lines.append(text)


def test_an_interrupt_mid_tune_writes_the_winners_measured_before_it(tmp_path, monkeypatch):
    from quack_kernels._configs import GemmConfig

    from quack.compile import autotune as at
    from quack.compile import pool as qpool
    from quack_build.cli.tune import _label, problems
    from quack_build.cli.tune_measure import measure_and_write

    s = dataclasses.replace(settings.get(), tune_gpu="H200")
    registry.load_packages(s.kernel_packages)
    m = tmp_path / "m.toml"
    m.write_text(
        '[defaults]\narchs = ["sm_90a"]\n[[kernel]]\nname = "gemm"\n'
        "problems = [[1024, 1024, 1024], [4096, 4096, 4096], [8192, 8192, 8192]]\n"
        '[kernel.params]\ndtype = "bfloat16"\n'
    )
    probs = problems(s, [m], None, 10_000)
    win = GemmConfig(tile_m=256, tile_n=128, cluster_m=1, cluster_n=2, schedule="coop")
    calls = []

    def fake_autotune(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return at.TuneResult({"config": win}, 1e-3, [({"config": win}, 1e-3)], [], 0, 0.0)

    class NoPool:
        def __init__(self, *a, **k):
            """Starts nothing: the engine is faked."""

        def shutdown(self):
            """Nothing to stop."""

    class Measurer:
        broken = ""
        killed = False

        def kill(self):
            self.killed = True

    monkeypatch.setattr(at, "autotune", fake_autotune)
    monkeypatch.setattr(qpool, "CompilePool", NoPool)
    path = tmp_path / "t.toml"
    con = _Con()
    meas = Measurer()
    with pytest.raises(KeyboardInterrupt):
        measure_and_write(s, con, probs, None, None, path, False, _label, measurer=meas)
    assert meas.killed
    rows = Table.load(path).rows
    assert sorted(r.shape for r in rows) == ["1024x1024x1024", "4096x4096x4096"]
    assert f"wrote {path}" in con.lines


def test_a_stopped_run_still_prints_its_json(tmp_path, monkeypatch):
    """The measuring process could not start again: the rows were written, and --json's
    stdout was empty. Now the results so far and the error."""
    import torch

    from quack_build.cli import tune_measure as tm

    m = tmp_path / "m.toml"
    m.write_text(SOFTMAX_4096)
    entry = dict(problem="softmax_fwd(...)", old="a", new="b", old_us=2.0, new_us=1.0, speedup=2.0)
    entry.update(refused=[], failed=[], written=True, table=str(tmp_path / "t.toml"))

    def stopped(*a, **k):
        raise tm.TuneStopped("error: quack tune: no CUDA GPU", "H200", [entry], [tmp_path / "t.toml"])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tm, "measure_and_write", stopped)
    monkeypatch.setenv("QUACK_CACHE_DIR", str(tmp_path / "cache"))
    r = _cli(["tune", str(m), "--json", "--table", str(tmp_path / "t.toml")])
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout[r.stdout.index("{") :])
    assert doc["error"] == "error: quack tune: no CUDA GPU" and doc["problems"][0]["new"] == "b"
    assert doc["tables"] == [str(tmp_path / "t.toml")]


@pytest.mark.parametrize("how", ["strict pytest", "quack.toml"])
def test_tune_compiles_its_candidates_whatever_the_runtime_mode(tmp_path, monkeypatch, how):
    """Inside a strict pytest session (QUACK_PYTEST_PREBUILT_CACHE reaches the processes a test
    starts) or under a server's ``[runtime] mode = "prebuilt"``, `quack tune` ran in prebuilt
    mode: every candidate was refused as not prebuilt and the tune failed (the GPU tier's
    test_tune_writes_a_winner_on_the_gpu on an H100, session 21). Its candidates are
    compiled on purpose: it measures in jit mode."""
    import torch

    from quack.settings import PREBUILT_CACHE_ENV
    from quack_build.cli import tune_measure as tm

    m = tmp_path / "m.toml"
    m.write_text(SOFTMAX_4096)
    cache = tmp_path / "cache"
    monkeypatch.setenv("QUACK_CACHE_DIR", str(cache))
    if how == "strict pytest":
        monkeypatch.setenv(PREBUILT_CACHE_ENV, str(cache))
    else:
        monkeypatch.chdir(tmp_path)
        (tmp_path / "quack.toml").write_text('[runtime]\nmode = "prebuilt"\n')
    assert settings.resolve(cwd=tmp_path).mode == "prebuilt"  # what any other command runs in
    modes = []

    def measured(s, *a, **k):
        modes.append((s.mode, settings.get().mode))
        return "H200", [], []

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tm, "measure_and_write", measured)
    r = _cli(["tune", str(m), "--json", "--table", str(tmp_path / "t.toml")])
    assert r.exit_code == 0, r.output
    assert modes == [("jit", "jit")]


def test_a_broken_kernels_table_is_one_error_line_and_from_empty_replaces_it(tmp_path, monkeypatch):
    """Every command binding a configuration read the broken table deep in a bind: an
    80-line traceback; ``--from-empty``, which the error advises, failed alike."""
    from quack_kernels import _tuning

    from quack_build.cli.app import app

    shutil_copy = (_tuning.TABLE_DIR / "sm_90a.toml").read_text()
    tuned = tmp_path / "tuned"
    tuned.mkdir()
    (tuned / "sm_90a.toml").write_text(shutil_copy + '\n[[row]]\nkernel = "softmax_fwd"\nspeed = 1\n')
    monkeypatch.setattr(_tuning, "TABLE_DIR", tuned)
    _tuning.reload()
    m = tmp_path / "m.toml"
    m.write_text(SOFTMAX_4096)
    monkeypatch.setenv("QUACK_CACHE_DIR", str(tmp_path / "cache"))
    saved = settings.installed()
    try:
        for args in (["build", "-n", str(m)], ["tune", "-n", str(m)]):
            r = CliRunner().invoke(app, args)
            assert r.exit_code == 1 and "Traceback" not in r.output, r.output
            assert "(speed): unknown field" in r.output and "--from-empty" in r.output, r.output
            assert r.output.count("\n") <= 3, r.output
        r = CliRunner().invoke(app, ["tune", "-n", "--from-empty", str(m)])
        assert r.exit_code == 0 and "softmax_fwd(" in r.output, r.output
    finally:
        settings.set_current(saved)
        _tuning.reload()


# ---------------------------------------------------------------- the autotune engine


class _Clock:
    """time.perf_counter for autotune: each benchmark takes 0.5 "seconds"."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _ready(**kw):
    return lambda **cfg: object()


def test_the_budget_bounds_measuring_too(monkeypatch):
    """With every candidate built already (--compile-only first), a budget of 1 s measured
    all eight 0.5 s candidates (8.5 s)."""
    from quack.compile import autotune as at

    clock = _Clock()
    monkeypatch.setattr(at.time, "perf_counter", clock)

    def bench(fn, cfg):
        clock.t += 0.5
        return 1e-3 * (cfg["c"] + 1)

    res = at.autotune(_ready(), [{"c": i} for i in range(8)], bench, timeout=1.0, pool=_NoPool())
    assert len(res.times) == 3 and res.best == {"c": 0}, res.table()
    assert [c["c"] for c, e in res.errors] == [3, 4, 5, 6, 7]
    assert all("budget spent: not measured" in e for _c, e in res.errors)


def test_a_time_that_is_not_positive_and_finite_is_an_error_never_a_winner():
    from quack.compile.autotune import autotune

    times = {0: float("nan"), 1: -1.0, 2: 0.0, 3: 2e-3, 4: float("inf")}
    res = autotune(_ready(), [{"c": i} for i in times], lambda fn, cfg: times[cfg["c"]], pool=_NoPool())
    assert res.best == {"c": 3}
    assert sorted(c["c"] for c, _ in res.errors) == [0, 1, 2, 4]
    assert all("a time must be positive and finite" in e for _c, e in res.errors)


class _NoPool:
    """The compile pool's stand-in: every candidate is "loaded" at once (``_ready``)."""

    generation = 0

    def wait_change(self, gen, timeout):
        return gen

    def shutdown(self):
        """Nothing to stop: no worker was started."""


def test_the_no_rows_warning_names_a_real_way_to_tune():
    """It advised ``quack tune --gpu B200``: no such option."""
    import warnings

    from quack_kernels import _tuning, softmax

    saved = settings.installed()
    settings.set_current(dataclasses.replace(settings.get(), tune_gpu="B200"))
    _tuning.reload()
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            softmax.compile_softmax_fwd.spec.bind(("bfloat16", 4096), {}, arch=A)
        (msg,) = [str(x.message) for x in w if "no tuning-table rows" in str(x.message)]
        assert "--gpu" not in msg and "QUACK_TUNE_GPU" in msg and "quack tune" in msg
    finally:
        settings.set_current(saved)
        _tuning.reload()


def test_table_files_keep_no_temporary_files_after_a_failed_write(tmp_path, monkeypatch):
    path = tmp_path / "t.toml"
    Table(A, "H200", [_row()]).write(path)
    t = Table.load(path)

    def boom(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError):
        t.write(path)
    assert [p.name for p in tmp_path.iterdir()] == ["t.toml"]
    assert Table.load(path).rows == t.rows
