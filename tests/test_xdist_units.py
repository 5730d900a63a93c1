"""The suite's xdist scheduler (tests/xdist_units.py): tests sharing an expensive fixture
run as one unit (the fixture built once, not once per worker), units go out costliest
first, and a renamed test cannot silently leave its unit."""

import xdist_units

pytest_plugins = ["pytester"]

F = "tests/test_x.py"


def test_units_group_gpu_files_and_shared_fixture_tests_only():
    shared = {"cluster": (f"{F}::test_a", "tests/test_y.py")}
    assert xdist_units.unit_of(f"{F}::test_a", 1, shared) == "shared:cluster"
    assert xdist_units.unit_of(f"{F}::test_a[p1-2]", 1, shared) == "shared:cluster"
    assert xdist_units.unit_of("tests/test_y.py::test_q", 1, shared) == "shared:cluster"
    # a name that merely starts like a listed one, and the file's other tests: their own
    assert xdist_units.unit_of(f"{F}::test_ab", 1, shared) == f"{F}::test_ab"
    assert xdist_units.unit_of(f"{F}::test_b", 1, shared) == f"{F}::test_b"
    assert xdist_units.unit_of("tests/kernels/test_k_gpu.py::test_a[x]", 1, shared) == "gpu0"


def test_order_is_gpu_units_then_costliest_first_ties_in_collection_order():
    recorded = {f"{F}::test_slow": 50, "tests/test_y.py": 10, "tests/test_y.py::test_long": 30}
    units = {
        f"{F}::test_fast": {f"{F}::test_fast": False},
        "shared:y": {"tests/test_y.py::test_1": False, "tests/test_y.py::test_2": False},  # 20
        f"{F}::test_slow[1]": {f"{F}::test_slow[1]": False},  # 50
        "tests/test_y.py::test_long": {"tests/test_y.py::test_long": False},  # 30: longest prefix
        f"{F}::test_other": {f"{F}::test_other": False},
        "gpu0": {"tests/test_k_gpu.py::test_a": False},
    }
    assert xdist_units.order(units, recorded) == [
        "gpu0",
        f"{F}::test_slow[1]",
        "tests/test_y.py::test_long",
        "shared:y",
        f"{F}::test_fast",
        f"{F}::test_other",
    ]


def test_the_real_tables_name_defined_tests_only():
    """Every function SHARED_FIXTURE_UNITS names is defined in its file: checked against
    the files themselves, then a rename is caught."""
    from pathlib import Path

    root = Path(__file__).parent.parent
    names = {}
    for ps in xdist_units.SHARED_FIXTURE_UNITS.values():
        for p in ps:
            file = p.split("::", 1)[0]
            # the names a module defines, without importing it (no cutlass, no ray here)
            src = (root / file).read_text()
            names[file] = {ln.split("(", 1)[0][4:] for ln in src.splitlines() if ln.startswith("def ")}
    assert xdist_units.unmatched_prefixes(names) == []
    ray = "tests/test_ray_build.py"
    names[ray] = {n.replace("test_actor_killed", "test_an_actor_killed") for n in names[ray]}
    assert xdist_units.unmatched_prefixes(names) == [
        f"{ray}::test_actor_killed_mid_compile_is_retried_on_another_actor"
    ]
    # a file not collected at all (`pytest tests/test_other.py`) is not a rename
    assert xdist_units.unmatched_prefixes({"tests/test_other.py": set()}) == []


CONFTEST = """
import xdist_units

def pytest_xdist_make_scheduler(config, log):
    return xdist_units.make_scheduler(
        config, log, 0,
        shared={"built": ("test_suite.py::test_uses_built",)},
        recorded={"test_suite.py::test_costly": 9},
    )
"""

SUITE = """
import os
import pytest

def _note(what):
    with open(os.environ["QT_LOG"], "a") as f:
        f.write(what + "\\n")

@pytest.fixture(scope="module")
def built():
    _note("built")

@pytest.mark.parametrize("i", range(4))
def test_uses_built(built, i):
    _note(f"uses {i}")

def test_cheap():
    _note("cheap")

def test_costly():
    _note("costly")
"""


def _suite(pytester, tmp_path, monkeypatch, conftest: str, suite: str):
    """A pytester project (conftest, test_suite.py) whose tests note to the returned log."""
    log = tmp_path / "log"
    monkeypatch.setenv("QT_LOG", str(log))
    pytester.makeconftest(conftest)
    pytester.makepyfile(test_suite=suite)
    return log


def test_a_shared_fixture_is_built_once_and_the_costliest_unit_goes_first(pytester, tmp_path, monkeypatch):
    """Through xdist itself: dealt out one by one, two workers each built the fixture."""
    log = _suite(pytester, tmp_path, monkeypatch, CONFTEST, SUITE)
    r = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider")
    r.assert_outcomes(passed=6)
    lines = log.read_text().split()
    assert lines.count("built") == 1, lines
    # with one worker the queue order is the run order: costly, the shared unit, cheap
    log.unlink()
    r = pytester.runpytest_subprocess("-n", "1", "-p", "no:cacheprovider")
    r.assert_outcomes(passed=6)
    assert log.read_text().split("\n")[:2] == ["costly", "built"], log.read_text()


def test_the_toy_objects_are_compiled_once_for_all_workers(tmp_path, monkeypatch):
    """reliability_support.session_objects: two workers of one run (their temporary roots
    side by side) get the same objects from one compile (each compiled its own before)."""
    import reliability_support

    calls = []

    def fake_compile(dest):
        calls.append(dest)
        dest.mkdir(parents=True)
        return {"float32": {"path": str(dest / "a.o")}}

    class Factory:
        def __init__(self, base):
            self.base = base

        def getbasetemp(self):
            return self.base

    monkeypatch.setattr(reliability_support, "compile_objects", fake_compile)
    got = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        got.append(reliability_support.session_objects(Factory(tmp_path / f"popen-{worker}")))
    assert len(calls) == 1 and got[0] == got[1]


def test_latency_bound_units_go_out_before_costlier_ones(monkeypatch):
    monkeypatch.setattr(xdist_units, "LATENCY_BOUND", ("tests/test_r.py",))
    recorded = {f"{F}::test_slow": 50, "tests/test_r.py": 5}
    units = {
        f"{F}::test_slow": {f"{F}::test_slow": False},
        "shared:r": {"tests/test_r.py::test_1": False, "tests/test_r.py::test_2": False},
        "tests/test_r.py::test_3": {"tests/test_r.py::test_3": False},
        "gpu0": {"tests/test_k_gpu.py::test_a": False},
    }
    assert xdist_units.order(units, recorded) == [
        "gpu0",
        "shared:r",
        "tests/test_r.py::test_3",
        f"{F}::test_slow",
    ]


def test_a_worker_lowers_its_priority_once_before_its_first_other_test(monkeypatch):
    niced = []
    monkeypatch.setattr(xdist_units.os, "nice", niced.append)
    monkeypatch.setattr(xdist_units, "LATENCY_BOUND", ("tests/test_r.py",))
    monkeypatch.setattr(xdist_units, "_lowered", False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert not xdist_units.lower_priority_once(f"{F}::test_a") and niced == []  # not under xdist
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    assert not xdist_units.lower_priority_once("tests/test_r.py::test_1") and niced == []
    assert xdist_units.lower_priority_once(f"{F}::test_a") and niced == [xdist_units.NICE_STEP]
    assert not xdist_units.lower_priority_once(f"{F}::test_b") and niced == [xdist_units.NICE_STEP]


NICE_CONFTEST = """
import xdist_units

xdist_units.LATENCY_BOUND = ("test_suite.py::test_latency",)

def pytest_xdist_make_scheduler(config, log):
    return xdist_units.make_scheduler(config, log, 0, shared={}, recorded={"test_suite.py::test_cpu": 9})

def pytest_runtest_setup(item):
    xdist_units.lower_priority_once(item.nodeid)
"""

NICE_SUITE = """
import os

def _note(what):
    with open(os.environ["QT_LOG"], "a") as f:
        f.write(f"{what} {os.nice(0)}\\n")

def test_cpu():
    _note("cpu")

def test_latency():
    _note("latency")
"""


def test_through_xdist_the_latency_bound_test_runs_first_at_normal_priority(pytester, tmp_path, monkeypatch):
    """One worker: the latency-bound test first (though the other is recorded costlier) at
    the priority the worker started with, the other after, NICE_STEP lower."""
    import os

    log = _suite(pytester, tmp_path, monkeypatch, NICE_CONFTEST, NICE_SUITE)
    r = pytester.runpytest_subprocess("-n", "1", "-p", "no:cacheprovider")
    r.assert_outcomes(passed=2)
    base = os.nice(0)
    want_cpu = min(19, base + xdist_units.NICE_STEP)
    assert log.read_text().split("\n")[:2] == [f"latency {base}", f"cpu {want_cpu}"], log.read_text()
