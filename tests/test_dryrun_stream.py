"""``quack build --dry-run`` streams (issue 9, item 6): configurations are listed as
they are expanded, after every manifest is validated and the --max-configs total
counted, never after the whole plan. Streaming is observed by counting: a kernel rule
(consulted once per combination, while expanding) appends a line to a counter file,
and the first listed line must arrive while most combinations are still unexpanded
(the pipe, left unread, holds the process back). Unit tests on ExpansionStream, real
CLI subprocesses under time-outs."""

from __future__ import annotations

import json
import os
import queue
import selectors
import signal
import subprocess
import threading
from pathlib import Path

import pytest
from reliability_support import QUACK, env, run_quack

from quack import registry
from quack.errors import ManifestError
from quack.params import Int, Rule
from quack_build.manifest.read import ExpansionStream, expand

N = 5000  # far more lines than a pipe holds (64 KiB, ~60 bytes a line)

KERNELS = """
import os

from quack import jit_cache
from quack.params import Int, Rule


def _counted(p):
    fd = os.open(os.environ["DRY_COUNTER"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"x\\n")
    finally:
        os.close(fd)
    return p["i"] != 99999


@jit_cache("dry_counted", params={"i": Int(min=0, max=100000)}, rules=[Rule("i", "not 99999", _counted)])
def dry_counted(i: int = 0):
    raise NotImplementedError  # never compiled: these tests only list
"""

# --- unit: ExpansionStream -------------------------------------------------------

CALLS: list[int] = []


def _counted_rule(p: dict) -> bool:
    CALLS.append(p["i"])
    return p["i"] != 999


def _never(i: int = 0):  # never compiled here
    raise NotImplementedError


if "ds_counted" not in registry.all_specs():
    registry.register(
        "ds_counted", _never, {"i": Int(min=0, max=100000)}, rules=[Rule("i", "not 999", _counted_rule)]
    )


def _write(p: Path, text: str) -> Path:
    p.write_text(text)
    return p


def test_stream_yields_before_expanding_the_rest(tmp_path):
    CALLS.clear()
    m = _write(
        tmp_path / "m.toml", f'[[kernel]]\nname = "ds_counted"\nparams = {{ i = {list(range(500))} }}\n'
    )
    it = iter(ExpansionStream([m], archs=["sm_90a"]))
    first = next(it)
    assert first.plain_params == {"i": 0} and len(CALLS) == 1  # one combination bound, not 500
    assert len(list(it)) == 499 and len(CALLS) == 500


def test_stream_refuses_invalid_and_oversized_manifests_before_expanding(tmp_path):
    CALLS.clear()
    ok = f'[[kernel]]\nname = "ds_counted"\nparams = {{ i = {list(range(300))} }}\n'
    m = _write(tmp_path / "m.toml", ok + ok.replace("range(300)", "range(300, 600)"))
    with pytest.raises(ManifestError) as ei:
        next(iter(ExpansionStream([m], archs=["sm_90a"], max_configs=599)))
    assert "[[kernel]] #2" in str(ei.value) and "over the limit of 599" in str(ei.value)
    assert CALLS == []  # the total is counted, nothing expanded

    bad = _write(tmp_path / "bad.toml", ok + '[[kernel]]\nname = "ds_counted"\nparams = { i = -1 }\n')
    with pytest.raises(ManifestError) as ei:
        next(iter(ExpansionStream([bad], archs=["sm_90a"])))
    assert "params.i = -1" in str(ei.value)


def test_stream_reports_expansion_problems_at_the_end_and_expand_still_builds_nothing(tmp_path):
    CALLS.clear()
    m = _write(
        tmp_path / "m.toml",
        f'[[kernel]]\nname = "ds_counted"\nparams = {{ i = {list(range(10))} }}\n'
        '[[kernel]]\nname = "ds_counted"\nparams = { i = [998, 999] }\n',
    )
    got = []
    with pytest.raises(ManifestError) as ei:
        for c in ExpansionStream([m], archs=["sm_90a"]):
            got.append(c.plain_params["i"])
    assert got == [*range(10), 998]  # listed as expanded; the refusal ends the iteration
    assert "ds_counted: i = 999 is not allowed: not 999" in str(ei.value)
    with pytest.raises(ManifestError):
        expand([m], archs=["sm_90a"])  # a build still refuses the whole manifest


def test_invalid_table_still_reports_other_tables_expansion_problems(tmp_path):
    m = _write(
        tmp_path / "m.toml",
        '[[kernel]]\nname = "ds_counted"\nparams = { i = [999] }\n'
        '[[kernel]]\nname = "ds_counted"\nparams = { i = "x" }\n',
    )
    with pytest.raises(ManifestError) as ei:
        expand([m], archs=["sm_90a"])
    assert len(ei.value.problems) == 2, ei.value.problems  # every problem at once


# --- CLI: real subprocesses ------------------------------------------------------


def _project(d: Path, n: int = N) -> tuple[Path, dict]:
    d.mkdir(parents=True, exist_ok=True)
    (d / "drykernels.py").write_text(KERNELS)
    (d / "quack.toml").write_text('[runtime]\narch = "sm_90a"\n[build]\nkernel_packages = ["drykernels"]\n')
    m = d / "m.toml"
    m.write_text(f'[[kernel]]\nname = "dry_counted"\nparams = {{ i = {list(range(n))} }}\n')
    e = env(QUACK_CACHE_DIR=d / "cache", DRY_COUNTER=d / "counter")
    e["PYTHONPATH"] = f"{d}{os.pathsep}{e['PYTHONPATH']}"
    return m, e


def _count(d: Path) -> int:
    try:
        return len((d / "counter").read_bytes().splitlines())
    except FileNotFoundError:
        return 0


def _lines(stream, q: queue.Queue) -> None:
    for line in stream:
        q.put(line)
    q.put(None)


def test_dry_run_prints_its_first_line_before_expanding_the_rest(tmp_path):
    m, e = _project(tmp_path)
    p = subprocess.Popen(
        [*QUACK, "build", "--dry-run", str(m)],
        cwd=tmp_path,
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    q: queue.Queue = queue.Queue()
    reader = threading.Thread(target=_lines, args=(p.stdout, q), daemon=True)
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(p.stdout, selectors.EVENT_READ)
            assert sel.select(timeout=120), "no output within 120 s"
        first = p.stdout.readline()  # Rich writes whole lines: one is there
        seen = _count(tmp_path)
        assert first.startswith("compile  dry_counted(i=0) sm_90a  key "), (first, p.stderr.read())
        # Unread, the pipe fills and the process waits: most combinations are still to come.
        assert 1 <= seen < N // 2, seen
        reader.start()
        lines = [first]
        while (line := q.get(timeout=120)) is not None:
            lines.append(line)
        assert p.wait(timeout=60) == 0, p.stderr.read()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
    assert sum(ln.startswith("compile  ") for ln in lines) == N and _count(tmp_path) == N
    assert lines[-1].strip() == f"{N} configurations (0 duplicates dropped): 0 cached, {N} to compile"


def test_dry_run_over_the_limit_lists_nothing(tmp_path):
    m, e = _project(tmp_path)
    r = run_quack(
        ["build", "--dry-run", "--max-configs", str(N - 1), str(m)], cwd=tmp_path, env_=e, timeout=120
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout == "" and "over the limit of 4999" in r.stderr and "--max-configs" in r.stderr
    assert _count(tmp_path) == 0  # counted, never expanded


def test_dry_run_json_is_one_document_and_lines_go_to_stderr(tmp_path):
    m, e = _project(tmp_path, n=300)
    m.write_text(m.read_text() + '[[kernel]]\nname = "dry_counted"\nparams = { i = [1, 2, 300] }\n')
    r = run_quack(["build", "--dry-run", "--json", str(m)], cwd=tmp_path, env_=e, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["total"], doc["to_compile"], doc["cached"], doc["duplicates"]) == (301, 301, 0, 2)
    assert len(doc["keys"]) == 301 and {k["status"] for k in doc["keys"]} == {"todo"}
    assert sum(ln.startswith("compile  dry_counted(") for ln in r.stderr.splitlines()) == 301


def test_dry_run_expansion_problem_after_listed_lines_exits_1(tmp_path):
    m, e = _project(tmp_path, n=20)
    m.write_text(m.read_text() + '[[kernel]]\nname = "dry_counted"\nparams = { i = [99999] }\n')
    r = run_quack(["build", "--dry-run", str(m)], cwd=tmp_path, env_=e, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert sum(ln.startswith("compile  ") for ln in r.stdout.splitlines()) == 20
    assert f"{m}:4: [[kernel]] #2 (dry_counted): dry_counted: i = 99999 is not allowed: not 99999" in r.stderr
    assert "1 problem in the manifests; nothing was built" in r.stderr
    assert "Traceback" not in r.stderr
