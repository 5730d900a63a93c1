"""The compile pool across its process's life: a forked child (its own pool, never a wait
for the parent's thread), a killed parent (its forkserver and workers end with it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from reliability_support import env, run_py

TESTS = os.path.dirname(__file__)


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (procfs: Linux only, as the lifeline)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _gone_within(pids, timeout: float) -> list[int]:
    """The pids still alive after ``timeout`` seconds (bounded polling of /proc)."""
    end = time.monotonic() + timeout
    left = [p for p in pids if _alive(p)]
    while left and time.monotonic() < end:
        time.sleep(0.05)
        left = [p for p in left if _alive(p)]
    return left


def _last_json(code: str, *, timeout: float, **envextra) -> tuple[dict, str]:
    """Run ``code`` in a fresh interpreter (reliability_support.run_py: bounded, the test
    directories on its path, a non-zero exit fails with its output) and return the JSON
    object its last line of stdout holds, and its stderr (for the assertions' messages)."""
    r = run_py(code, timeout=timeout, **envextra)
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


_FORK = """
import json, os, sys
import toykernels
from quack.compile import pool as qpool
toykernels.toy_scale("float32", 64, False)          # the parent's pool starts
parent_pool = qpool.default_pool()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    import faulthandler
    faulthandler.dump_traceback_later(90, exit=True)  # a regression fails, never hangs
    os.close(r)
    toykernels.toy_scale("float32", 96, False)      # a cold key, in the child
    p = qpool.default_pool()
    out = {"own_pool": p is not parent_pool, "compiled": p.stats()["compiled"]}
    os.write(w, json.dumps(out).encode())
    os._exit(0)
os.close(w)
data = os.read(r, 4096)
_, status = os.waitpid(pid, 0)
print(json.dumps({"status": status, "child": json.loads(data or b"null")}))
"""


def test_forked_child_compiles_a_cold_key_with_a_pool_of_its_own(tmp_path):
    """The child inherited the parent's started pool but not its dispatcher thread: its
    cold call waited for ever. Now the child starts its own pool and compiles."""
    out, err = _last_json(
        _FORK, timeout=240, QUACK_CACHE_DIR=tmp_path / "cache", QUACK_MODE="jit", QUACK_COMPILE_JOBS=1
    )
    assert out == {"status": 0, "child": {"own_pool": True, "compiled": 1}}, (out, err)


def test_a_wait_on_a_pool_whose_dispatcher_is_gone_fails_instead_of_hanging(quack_settings):
    """Every wait is bounded: a key pending on a dispatcher thread that no longer exists
    fails (transient CompileError) instead of blocking its caller for ever."""
    import toykernels

    from quack.compile import pool as qpool
    from quack.compile import tasks as qtasks

    p = qpool.CompilePool(1)
    try:
        spec = toykernels.toy_scale.spec
        params = {"dtype": "float32", "block": 160, "bias": False}
        key = spec.key(params, "sm_90a")
        # The state a forked child inherits: pending, "started", no thread behind it.
        with p._lock:
            p._dispatcher._thread = _DeadThread()
            assert p.submit(spec, params, "sm_90a", key, force=True) == qtasks.PENDING
        st, err = p.wait(key, timeout=60)
        assert st == qtasks.FAILED and "dispatcher thread is gone" in str(err), (st, err)
        assert getattr(err, "transient", False)
    finally:
        p.shutdown()


class _DeadThread:
    def is_alive(self) -> bool:
        return False


_KILLED = """
import os, sys, time
import relkernels
from quack.compile import pool as qpool
from multiprocessing import forkserver
p = qpool.default_pool()
from quack.compile import scope
from quack.errors import CompilePending
with scope.pool_scope(p):
    try:
        relkernels.rel_copy(7)                 # a compile that takes QUACK_TEST_COMPILE_SLEEP
    except CompilePending:                     # queued on the pool: what this child is for
        pass
# Wait until the worker runs the compile function (its line in QUACK_TEST_COUNTER), not
# only until the pool handed it the task (task_info's pid, set at dispatch): a worker
# killed in between, still in its recv, is idle and ends at once, which failed the SIGTERM
# test's "still alive" on a loaded machine (README command 2 under -n auto on 16 cores).
counter = os.environ["QUACK_TEST_COUNTER"]
end = time.monotonic() + 120
line = ""
while time.monotonic() < end:
    if os.path.exists(counter):
        with open(counter) as f:
            line = f.readline()
        if line.endswith("\\n"):
            break
    time.sleep(0.05)
print(forkserver._forkserver._forkserver_pid, line.split()[0], flush=True)
time.sleep(600)
"""


def test_killed_process_takes_its_forkserver_and_busy_worker_with_it(tmp_path):
    """SIGKILL (what `timeout -s KILL`, the OOM killer or a CI cancel do) runs no atexit:
    the forkserver and a worker mid-compile used to run on, re-parented to init, the
    worker for as long as its (here wedged: 600 s) compile took. The forkserver ends at
    once; the worker within what is left of its compile time-out (5 s here), the bound
    the dead parent's pool would have enforced."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=TESTS,
        env=env(
            QUACK_CACHE_DIR=tmp_path / "cache",
            QUACK_MODE="jit",
            QUACK_COMPILE_JOBS=1,
            QUACK_COMPILE_TIMEOUT=5,
            QUACK_TEST_COMPILE_SLEEP=600,
            QUACK_TEST_OBJ="/nonexistent",
            QUACK_TEST_COUNTER=tmp_path / "compiles",
        ),
    )
    try:
        line = proc.stdout.readline()  # bounded: the script gives up after 120 s
        forkserver_pid, worker_pid = (int(x) for x in line.split())
        assert _alive(forkserver_pid) and _alive(worker_pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        assert _gone_within([forkserver_pid], 30) == []
        assert _gone_within([worker_pid], 60) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_sigterm_to_the_group_of_a_process_using_the_pool_still_ends_its_processes(tmp_path):
    """Workers and the forkserver ignore a SIGTERM sent to the whole process group (a
    `quack build` ends them itself, then sweeps their temp files). A process that does
    not handle SIGTERM (pytest under `timeout`) dies of it and ends them no more: the
    forkserver still ends at once (its clients are gone), the busy worker within what
    is left of its compile time-out (10 s here), as after a SIGKILL of the process."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=TESTS,
        start_new_session=True,  # its own group: the signal goes to it, not to pytest
        env=env(
            QUACK_CACHE_DIR=tmp_path / "cache",
            QUACK_MODE="jit",
            QUACK_COMPILE_JOBS=1,
            QUACK_COMPILE_TIMEOUT=10,
            QUACK_TEST_COMPILE_SLEEP=600,
            QUACK_TEST_OBJ="/nonexistent",
            QUACK_TEST_COUNTER=tmp_path / "compiles",
        ),
    )
    try:
        line = proc.stdout.readline()  # bounded: the script gives up after 120 s
        forkserver_pid, worker_pid = (int(x) for x in line.split())
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == -signal.SIGTERM
        # the worker mid-compile ignored it: its time-out, not the signal, ends it
        assert _alive(worker_pid)
        assert _gone_within([forkserver_pid], 30) == []
        assert _gone_within([worker_pid], 60) == []
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the group ended on its own (the assertions above expect it to)
        proc.wait(30)


_IN_PRELOAD = """
import os, time
from multiprocessing import forkserver
from quack.compile import worker
worker.ensure_forkserver("forkserver")
marker = os.environ["QUACK_TEST_PRELOAD_MARKER"]
end = time.monotonic() + 120
while not os.path.exists(marker) and time.monotonic() < end:  # the slow preload module began
    time.sleep(0.05)
print(forkserver._forkserver._forkserver_pid, os.path.exists(marker), flush=True)
time.sleep(600)
"""


def test_killed_process_takes_its_forkserver_with_it_during_the_preload(tmp_path):
    """A forkserver still in its preload (a `[build] preload` module, or cutlass's import,
    minutes on a loaded machine) is not yet in the main loop that watches its clients:
    only the lifeline ends it. Stopped at the end of the preload (the main loop then owns
    the pipe and exits cleanly: tests/test_preload.py)."""
    (tmp_path / "slowpre.py").write_text(
        "import os, time\nopen(os.environ['QUACK_TEST_PRELOAD_MARKER'], 'w').close()\ntime.sleep(600)\n"
    )
    marker = tmp_path / "preloading"
    proc = subprocess.Popen(
        [sys.executable, "-c", _IN_PRELOAD],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=TESTS,
        env=env(
            QUACK_CACHE_DIR=tmp_path / "cache",
            QUACK_PRELOAD="slowpre",
            QUACK_TEST_PRELOAD_MARKER=marker,
            PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        ),
    )
    try:
        pid, began = proc.stdout.readline().split()  # bounded: the script waits at most 120 s
        assert began == "True", proc.stderr.read() if proc.poll() is not None else began
        assert _alive(int(pid))
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        assert _gone_within([int(pid)], 30) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


_THREADS = """
import json, os, threading, time
import relkernels
from quack.compile import pool as qpool
gate, counter = os.environ["QUACK_TEST_FAIL_GATE"], os.environ["QUACK_TEST_FAIL_COUNTER"]
open(gate, "a").close()
relkernels.rel_fail(1)                      # a loaded key
os.unlink(gate)                             # from here every compile waits for the gate
results = {}
def call(name, *a, **kw):
    results[name] = callable(relkernels.rel_fail(*a, **kw))
threads = [threading.Thread(target=call, args=(f"k{i}", i)) for i in (2, 3, 4)]
threads += [threading.Thread(target=call, args=(f"same{j}", 5)) for j in range(4)]
for t in threads:
    t.start()
p = qpool.default_pool()
peak, end = 0, time.monotonic() + 120
while peak < 4 and time.monotonic() < end:  # keys 2, 3, 4, 5 pending at once
    peak = max(peak, p.stats()["pending"])
    time.sleep(0.02)
# the loaded key, spelled anew (not in the hot path's memo), while the compiles wait
warm = threading.Thread(target=call, args=("warm",), kwargs={"i": 1})
warm.start()
warm.join(60)
warm_done = not warm.is_alive()
open(gate, "a").close()
for t in threads + [warm]:
    t.join(120)
with open(counter) as f:
    attempts = [line.split()[1] for line in f]
print(json.dumps({"peak": peak, "warm_while_busy": warm_done, "ok": sorted(k for k, v in results.items() if v),
                  "attempts": {i: attempts.count(i) for i in sorted(set(attempts))}}))
"""


def test_threads_on_one_kernel_compile_cold_keys_at_once_and_one_key_once(tmp_path, tmp_path_factory):
    """The kernel's lock was held across a whole compile: threads on distinct cold keys
    took turns (never more than one pending in the pool) and a loaded key waited behind
    another thread's compile. Four threads on one cold key still compile it once."""
    from reliability_support import session_objects

    obj = session_objects(tmp_path_factory)["float32"]["path"]
    out, err = _last_json(
        _THREADS,
        timeout=400,
        QUACK_CACHE_DIR=tmp_path / "cache",
        QUACK_MODE="jit",
        QUACK_COMPILE_JOBS=4,
        QUACK_TEST_OBJ=obj,
        QUACK_TEST_FAIL_GATE=tmp_path / "gate",
        QUACK_TEST_FAIL_COUNTER=tmp_path / "attempts",
    )
    assert out["peak"] == 4 and out["warm_while_busy"], out
    assert out["ok"] == sorted(["k2", "k3", "k4", "warm"] + [f"same{j}" for j in range(4)]), out
    assert out["attempts"] == {"1": 1, "2": 1, "3": 1, "4": 1, "5": 1}, out


_AT_EXIT = """
import atexit, json
import toykernels
from quack.errors import CompileError
def late():                                  # runs after the pool's own atexit shutdown
    try:
        toykernels.toy_scale("float32", 224, False)
        print(json.dumps({"ok": True}), flush=True)
    except CompileError as e:
        print(json.dumps({"error": str(e), "transient": e.transient}), flush=True)
atexit.register(late)
toykernels.toy_scale("float32", 64, False)  # the pool starts (its atexit hook registered)
"""


def test_a_cold_call_at_interpreter_exit_says_the_interpreter_is_shutting_down(tmp_path):
    """A cold call from an atexit hook that runs after the pool's shutdown started a new
    pool and failed with "cannot start a compile worker: FileNotFoundError(2, ...)"."""
    out, err = _last_json(
        _AT_EXIT, timeout=240, QUACK_CACHE_DIR=tmp_path / "cache", QUACK_MODE="jit", QUACK_COMPILE_JOBS=1
    )
    assert "interpreter is shutting down" in out.get("error", ""), (out, err)
    assert "quack build" in out["error"] and "FileNotFoundError" not in out["error"]
    assert out["transient"] is True
