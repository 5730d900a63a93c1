"""`quack build`'s compile workers and the locks of other processes: a worker killed by a
signal (its key tried once more), a build killed under its workers (they end quietly,
publishing what they finished), and keys another process holds the lock of (shown as
waiting, bounded by lock_timeout, compiled here when that process lets go unpublished).

Real builds as subprocesses (tests/relkernels.py: compiles that copy a real object), each
bounded: a regression fails on a time-out instead of stalling the suite. Counts and
messages are asserted, never durations."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import relkernels  # noqa: F401 - registers rel_copy and rel_fail
from interrupt_support import wait_for
from reliability_support import PY, QUACK, TESTS, env, run_quack, session_objects

from quack import registry
from quack.cache.store import DiskStore
from quack.compile import builder


@pytest.fixture(scope="module")
def obj(tmp_path_factory) -> str:
    return session_objects(tmp_path_factory)["float32"]["path"]


def _project(d: Path, kernel: str, n: int) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "quack.toml").write_text(
        '[runtime]\narch = "sm_90a"\n[build]\nkernel_packages = ["relkernels"]\nmanifests = ["m.toml"]\n'
    )
    (d / "m.toml").write_text(f'[[kernel]]\nname = "{kernel}"\nparams = {{ i = {list(range(n))} }}\n')
    return d


def _attempts(counter: Path) -> list[tuple[int, int]]:
    """(pid, i) of each compile attempt (relkernels' counter files)."""
    if not counter.exists():
        return []
    return [tuple(map(int, ln.split())) for ln in counter.read_text().splitlines()]


def _by_i(res: dict) -> dict[int, dict]:
    return {k["params"]["i"]: k for k in res["keys"]}


# -- a worker killed by a signal --------------------------------------------------------------
def _selfkill_build(tmp_path, obj, times: int) -> tuple[subprocess.CompletedProcess, list]:
    proj = _project(tmp_path / "proj", "rel_fail", 4)
    counter = tmp_path / "attempts"
    r = run_quack(
        ["build", "--json", "--keep-going", "--jobs", "2", "--cache-dir", tmp_path / "cache"],
        cwd=proj,
        timeout=180,
        env_=env(
            QUACK_TEST_OBJ=obj,
            QUACK_TEST_FAIL="2",  # a compile error: never retried
            QUACK_TEST_FAIL_COUNTER=counter,
            QUACK_TEST_SELFKILL="1",
            QUACK_TEST_SELFKILL_TIMES=times,
        ),
    )
    return r, _attempts(counter)


def test_worker_killed_once_is_retried_and_the_key_compiles(tmp_path, obj):
    r, attempts = _selfkill_build(tmp_path, obj, times=1)
    assert r.returncode == 1, r.stdout + r.stderr  # i=2 does not compile
    keys = _by_i(json.loads(r.stdout))
    assert keys[1]["status"] == "compiled", keys[1]
    assert {i: k["status"] for i, k in keys.items() if i != 1} == {0: "compiled", 2: "failed", 3: "compiled"}
    tries = [pid for pid, i in attempts if i == 1]
    assert len(tries) == 2 and tries[0] != tries[1], attempts  # the second on a new worker
    assert [i for _, i in attempts].count(2) == 1, attempts  # a compile error is not retried
    assert r.stderr.count("retrying rel_fail key") == 1, r.stderr
    assert "was killed by SIGKILL (out of memory?); trying once more" in r.stderr
    assert json.loads(r.stdout)["executor_stats"] == {"retries": 1}


def test_worker_killed_twice_fails_the_key_naming_the_signal(tmp_path, obj):
    r, attempts = _selfkill_build(tmp_path, obj, times=2)
    assert r.returncode == 1, r.stdout + r.stderr
    keys = _by_i(json.loads(r.stdout))
    assert keys[1]["status"] == "failed" and "killed by SIGKILL" in keys[1]["error"], keys[1]
    assert keys[0]["status"] == keys[3]["status"] == "compiled"
    assert [i for _, i in attempts].count(1) == 2, attempts  # retried once, not more
    assert r.stderr.count("retrying rel_fail key") == 1, r.stderr
    assert "1 configuration failed to compile" in r.stderr or "2 configurations failed to compile" in r.stderr


# -- the build killed under its workers -------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_workers_of_a_killed_build_end_quietly_and_publish_what_they_built(tmp_path, obj):
    proj = _project(tmp_path / "proj", "rel_copy", 6)
    counter, cache = tmp_path / "compiles", tmp_path / "cache"
    out, err = open(tmp_path / "out", "w"), open(tmp_path / "err", "w")
    p = subprocess.Popen(
        [*QUACK, "build", "--jobs", "2", "--cache-dir", str(cache)],
        cwd=str(proj),
        env=env(QUACK_TEST_OBJ=obj, QUACK_TEST_COUNTER=counter, QUACK_TEST_COMPILE_SLEEP=2),
        stdout=out,
        stderr=err,
        start_new_session=True,
    )
    try:
        assert wait_for(lambda: len(_attempts(counter)) >= 2, 120), "the workers never started compiling"
        os.kill(p.pid, signal.SIGKILL)  # the build only: its workers are mid-compile
        p.wait(30)
        busy = _attempts(counter)
        assert wait_for(lambda: not any(_alive(pid) for pid, _ in busy), 120), "the workers never ended"
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out.close()
        err.close()
    text = (tmp_path / "err").read_text()
    assert "Traceback" not in text and "BrokenPipe" not in text, text
    # What the workers had when their build died is published whole (under the key's lock).
    spec = registry.get("rel_copy")
    store = DiskStore(cache)
    for _, i in busy:
        assert store.lookup(builder.entry_ref(spec, spec.bind((), {"i": i}), "sm_90a")) is not None, i


# -- keys another process holds the lock of ---------------------------------------------------
_LOCKER = r"""
import contextlib, sys
from pathlib import Path
import relkernels
from quack import registry
from quack.cache.store import DiskStore
from quack.compile import builder
root, ids = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
spec = registry.get("rel_copy")
store = DiskStore(Path(root))
with contextlib.ExitStack() as held:
    for i in ids:
        held.enter_context(store.lock(builder.entry_ref(spec, spec.bind((), {"i": i}), "sm_90a")))
    print("locked", flush=True)
    sys.stdin.read()  # until the test closes our stdin (or ends): then let go, unpublished
"""


def _locker(cache: Path, ids) -> subprocess.Popen:
    p = subprocess.Popen(
        [PY, "-c", _LOCKER, str(cache), ",".join(map(str, ids))],
        env=env(),
        cwd=str(TESTS),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "locked"
    return p


def test_keys_locked_elsewhere_are_shown_waiting_and_bounded_by_lock_timeout(tmp_path, obj):
    proj = _project(tmp_path / "proj", "rel_copy", 3)
    cache = tmp_path / "cache"
    holder = _locker(cache, [0, 1])
    try:
        r = run_quack(
            ["build", "--json", "--keep-going", "--jobs", "1", "--cache-dir", cache],
            cwd=proj,
            timeout=120,  # compile_timeout is 900 s: only lock_timeout ends this wait
            env_=env(QUACK_TEST_OBJ=obj, QUACK_LOCK_TIMEOUT=2),
        )
    finally:
        holder.stdin.close()
        holder.wait(60)
    assert r.returncode == 1, r.stdout + r.stderr
    res = json.loads(r.stdout)
    keys = _by_i(res)
    for i in (0, 1):
        assert (keys[i]["status"], keys[i].get("failure"), keys[i].get("awaited")) == ("failed", "lock", True)
        assert "past lock_timeout: QUACK_LOCK_TIMEOUT" in keys[i]["error"], keys[i]
    assert keys[2]["status"] == "compiled" and "awaited" not in keys[2]
    assert r.stderr.count("waiting   rel_copy(") == 2, r.stderr
    assert r.stderr.count("another process holds its lock") == 2, r.stderr
    assert "2 configurations not built: another process held the lock past lock_timeout" in r.stderr
    assert "failed to compile" not in r.stderr
    # Waiting took no worker's time: two keys awaited at once on one worker made 200 %.
    assert res["efficiency"] is None or res["efficiency"] <= 1.0, res["efficiency"]


def test_key_released_unpublished_by_another_process_is_compiled_here(tmp_path, obj):
    proj = _project(tmp_path / "proj", "rel_copy", 2)
    cache, counter, log = tmp_path / "cache", tmp_path / "compiles", tmp_path / "err"
    holder = _locker(cache, [0])
    out, err = open(tmp_path / "out", "w"), open(log, "w")
    p = subprocess.Popen(
        [*QUACK, "build", "--json", "--jobs", "1", "--cache-dir", str(cache)],
        cwd=str(proj),
        env=env(QUACK_TEST_OBJ=obj, QUACK_TEST_COUNTER=counter),
        stdout=out,
        stderr=err,
        start_new_session=True,
    )
    try:
        assert wait_for(lambda: "another process holds its lock" in log.read_text(), 120), log.read_text()
        holder.stdin.close()  # it lets go without publishing (its build failed, or was killed)
        holder.wait(60)
        try:
            rc = p.wait(120)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the build never ended:\n{log.read_text()}") from None
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out.close()
        err.close()
    assert rc == 0, log.read_text()
    keys = _by_i(json.loads((tmp_path / "out").read_text()))
    assert keys[0]["status"] == keys[1]["status"] == "compiled", keys
    assert sorted(i for _, i in _attempts(counter)) == [0, 1]  # each compiled once, here
