"""``quack tune`` survives a candidate that crashes (issue 28). On the H200 ``quack tune
manifests/tuning_gemm.toml`` died with "CUDA error: unspecified launch failure" without
naming the candidate: candidates were measured in the tuning process itself, and a faulting
launch poisons a process's CUDA context for every later launch. Now they are checked and
timed in a measuring child process (quack_build.tune.measure), replaced after a fault, a
death or a hang; the candidate is reported with its configuration and the error.

On the CPU with fakes (tests/tunefakes.py) through the real process machinery: a candidate
whose launch faults and poisons the process, one that aborts the process, one that hangs,
one that is wrong; a problem whose every candidate fails; more problems and candidates than
measuring processes (one)."""

import io

import pytest
import tunefakes
from interrupt_support import scaled

from quack.errors import MeasureError

MANIFEST = """[defaults]
archs = ["sm_90a"]
[[kernel]]
name = "tune_fake"
problems = [[1, 1, 1], [2, 2, 2]]
[kernel.params]
dtype = "bfloat16"
[[kernel]]
name = "tune_fake"
problems = [[3, 3, 3]]
[kernel.params]
dtype = "float16"
"""


class NoPool:
    """The compile pool's stand-in: every fake candidate is "loaded" at once."""

    generation = 0

    def __init__(self, *a, **k):
        pass

    def wait_change(self, gen, timeout):
        return gen

    def shutdown(self):
        pass


def _measurer(**kw):
    from quack_build.tune.measure import Measurer

    opts = dict(device="cpu", timer="tunefakes:timer", gpu=False, timeout=scaled(10))
    return Measurer(**dict(opts, **kw))


def _problem(dtype="bfloat16", n=2):
    return dict(
        kernel="tune_fake",
        module="tunefakes",
        params={"dtype": dtype},
        sizes={"m": n, "n": n, "k": n},
        bench="tunefakes:bench",
        reference="tunefakes:check",
    )


def test_a_poisoned_or_dead_measuring_process_is_replaced():
    """A sticky fault fails its candidate and the next candidate gets a fresh process (in
    the old one every launch would fail); os.abort() is reported with the signal."""
    sticky, fast, abort, wrong = (tunefakes.CANDIDATES[i] for i in (0, 1, 2, 3))
    with _measurer() as m:
        with pytest.raises(MeasureError) as e:
            m.check(_problem(), sticky)
        assert e.value.restarted and "CUDA error: unspecified launch failure" in e.value.reason
        assert "earlier launch" not in e.value.reason and e.value.config == sticky.label()
        m.check(_problem(), fast)  # a fresh process: not poisoned
        assert m.time(_problem(), fast) == pytest.approx(20e-6)
        m.check(_problem(), abort)
        with pytest.raises(MeasureError, match="measuring process died.*SIGABRT"):
            m.time(_problem(), abort)
        with pytest.raises(AssertionError, match="17 elements differ"):  # wrong: no restart
            m.check(_problem(), wrong)
        assert m.time(_problem(), fast) == pytest.approx(20e-6)
        assert m.started == 3  # the first, after the fault, after the abort; none after "wrong"


def test_a_hung_candidate_is_killed_at_its_time_limit():
    hang = tunefakes.CANDIDATES[4]
    with _measurer(timeout=scaled(3)) as m:
        m.check(_problem(n=1), hang)
        with pytest.raises(MeasureError, match="took over .* hung launch"):
            m.time(_problem(n=1), hang)
        assert m.time(_problem(n=2), hang) == pytest.approx(30e-6)  # elsewhere it runs
        assert m.started == 2


def test_a_measuring_process_that_cannot_start_is_not_restarted_forever():
    """No GPU for a "cuda" measurement: two starts, then every request fails at once."""
    m = _measurer(device="cuda", start_timeout=scaled(120))
    with pytest.raises(MeasureError, match="did not start \\(twice\\): no CUDA GPU"):
        m.check(_problem(), tunefakes.CANDIDATES[1])
    with pytest.raises(MeasureError, match="did not start"):
        m.time(_problem(), tunefakes.CANDIDATES[1])
    assert m.started == 2 and m.broken
    m.close()


def test_autotune_lists_a_check_that_could_not_run_as_failed_not_wrong():
    """Before: any exception of the check refused the candidate as a wrong result."""
    from quack.compile.autotune import autotune

    def check(fn, cfg):
        if cfg["c"] == 1:
            raise MeasureError("k", "c=1", "CUDA error: unspecified launch failure")
        if cfg["c"] == 2:
            raise AssertionError("differs")

    res = autotune(
        lambda **kw: object(), [{"c": 0}, {"c": 1}, {"c": 2}], lambda fn, cfg: 1.0, check=check, pool=NoPool()
    )
    assert res.best == {"c": 0}
    assert [(c, "unspecified launch failure" in e) for c, e in res.errors] == [({"c": 1}, True)]
    assert [c for c, _ in res.refused] == [{"c": 2}]


def test_tune_goes_on_past_crashing_candidates_and_keeps_the_old_winner(
    tmp_path, monkeypatch, quack_settings
):
    """Three problems x eight candidates through one measuring process: each fault, abort
    and hang is reported with its configuration and reason as it happens and in the result;
    the others are measured; the problem whose every candidate faults keeps its old row."""
    import dataclasses

    from rich.console import Console

    from quack.compile import pool as qpool
    from quack.runtime import jit
    from quack.tuning import Row, Table
    from quack_build.cli.tune import _label, _print_table, problems
    from quack_build.cli.tune_measure import measure_and_write

    s = dataclasses.replace(quack_settings, tune_gpu="H200")
    man = tmp_path / "m.toml"
    man.write_text(MANIFEST)
    probs = problems(s, [man], None, 10_000)
    assert [(p.base["dtype"], p.sizes["n"], len(p.cands)) for p in probs] == [
        ("bfloat16", 1, 8),
        ("bfloat16", 2, 8),
        ("float16", 3, 8),
    ]
    path = tmp_path / "t.toml"
    old_row = Row("tune_fake", "H200", "m3", (3, 3), tunefakes.OLD.knobs(), ("float16",), 70.0, "3x3x3")
    Table("sm_90a", "H200", [old_row]).write(path)
    monkeypatch.setattr(jit, "kernel", lambda name: lambda **kw: object())  # "compiled and loaded"
    monkeypatch.setattr(qpool, "CompilePool", NoPool)
    out = io.StringIO()
    con = Console(file=out, width=400)
    m = _measurer()
    _gpu, results, tables = measure_and_write(s, con, probs, None, None, path, False, _label, measurer=m)
    assert tables == [path]
    a, b, c = results
    label = {cfg.mode + str(cfg.us): cfg.label() for cfg in tunefakes.CANDIDATES}
    failed = [{f["candidate"]: f["reason"] for f in r["failed"]} for r in results]
    assert set(failed[0]) == {label["sticky1"], label["abort1"], label["hang30"]}
    assert set(failed[1]) == {label["sticky1"], label["abort1"]}  # at n = 2 "hang" runs
    for f in failed[:2]:
        assert (
            f[label["sticky1"]].startswith("check: ") and "unspecified launch failure" in f[label["sticky1"]]
        )
        assert "died" in f[label["abort1"]] and "SIGABRT" in f[label["abort1"]]
    assert "hung launch" in failed[0][label["hang30"]]
    assert not any("earlier launch faulted" in r for f in failed for r in f.values()), "a poisoned process"
    assert a["new"] == b["new"] == label["fast10"] and a["written"] and b["written"]
    assert [x for x, _ in a["refused"]] == [label["wrong1"]]
    # every candidate of the doomed problem failed: the old winner stays, and it is said
    assert c["new"] is None and not c["written"] and c["kept"] == tunefakes.OLD.label()
    assert len(c["failed"]) == 8
    rows = {(r.cls, r.dtype): r for r in Table.load(path).rows}
    assert rows[("m3", ("float16",))] == old_row
    assert (
        rows[("m1", ("bfloat16",))].config == rows[("m2", ("bfloat16",))].config == {"mode": "fast", "us": 10}
    )
    # one process at a time, replaced after each failure but the last (nothing asked after it)
    assert m.started == sum(len(f) for f in failed)
    said = out.getvalue()
    assert f"failed {label['abort1']}: " in said and "keeps " + tunefakes.OLD.label() in said
    out.seek(0)
    out.truncate()
    _print_table(con, results)
    said = out.getvalue()
    assert f"failed: {_label(probs[0])}: {label['hang30']}: " in said
    assert f"kept: {_label(probs[2])}: {tunefakes.OLD.label()}" in said


def test_the_final_table_says_when_the_old_winner_was_held_on_noise():
    from rich.console import Console

    from quack_build.cli.tune import _print_table

    out = io.StringIO()
    entry = dict(problem="gemm(...) sm_90a 8192x28672x8192", old="A", new="A", old_us=5012.0, new_us=5012.0)
    entry.update(speedup=1.0, failed=[], refused=[], written=True)
    entry["held"] = dict(faster="B", gain=0.0098, noise=0.0231)
    _print_table(Console(file=out, width=300), [entry])
    assert (
        "held: gemm(...) sm_90a 8192x28672x8192: keeps A; B measured 0.98 % faster, inside the noise (2.31 %)"
        in (out.getvalue())
    )
    # with the rounds it was compared in (a duel's included)
    out = io.StringIO()
    entry["held"] = dict(faster="B", gain=0.0556, noise=0.0907, rounds=9)
    _print_table(Console(file=out, width=300), [entry])
    assert "B measured 5.56 % faster, inside the noise (9.07 % over 9 rounds)" in out.getvalue()
    # fastest in the first rounds, slower over all of them once the duel's were added
    out = io.StringIO()
    entry["held"] = dict(faster="B", gain=-0.0344, noise=0.1291, rounds=9)
    _print_table(Console(file=out, width=300), [entry])
    said = out.getvalue()
    assert "B the fastest at first, measured 3.44 % slower over 9 rounds (noise 12.91 %)" in said
    assert "-3.44" not in said
    # and the next fastest dueled it too
    out = io.StringIO()
    entry["held"] = dict(faster="B", gain=-0.0344, noise=0.1291, rounds=9, dueled=3)
    _print_table(Console(file=out, width=300), [entry])
    assert "(noise 12.91 %); 2 more contenders dueled it, none faster in every round" in out.getvalue()
