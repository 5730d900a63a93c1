"""``quack verify``'s fresh processes: each request (``quack_build.verify.child``'s format)
is loaded, and with ``--run`` run against its reference, in a child process of its own
kind, so that a crash is blamed on the entry in progress.

The requests are shared out over ``jobs`` children driven by one thread each (a
request goes to whichever child is free next; the answers come back in request order).
Serially, the ~1,050 configurations of the shipped manifests took 25-50 s on the H200
machine, most of it one process importing, loading and launching one entry after another.

Every wait has an exit: an answer takes at most ``LOAD_TIMEOUT`` (the child is killed
after that, and its entry blamed); a crash restarts that child only; Ctrl-C or SIGTERM
(a KeyboardInterrupt in the main thread, quack_build.build.interrupts) kills every
child at once, also one being started while it came, so that no thread is left waiting
on a loader nobody will hear again."""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Callable

LOAD_TIMEOUT = 300.0
GPU_PROBE_TIMEOUT = 120.0
JOIN_TIMEOUT = 15.0  # a worker whose child was killed returns at once; bounded all the same


class ChildProcess:
    """A Python child process that answers one JSON line per request line on its stdout
    (``python -m <module>``: quack_build.verify.child, or quack tune's measuring process,
    quack_build.tune.child). ``gpu``: the GPU is visible and the child never compiles
    (prebuilt mode), else it is GPU-blind. ``env``: more environment for it. ``role`` names
    it in the errors ("loader", "measuring"). ``torch=False``: no request will hand it a
    torch tensor, so it imports tvm_ffi with torch hidden (``--no-torch``, served by
    quack_build.verify.serve): a static load needs none."""

    def __init__(
        self,
        gpu: bool,
        module: str = "quack_build.verify.child",
        env: dict | None = None,
        role: str = "loader",
        torch: bool = True,
    ):
        env = dict(os.environ, **(env or {}))
        if not gpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
        else:
            env["QUACK_MODE"] = "prebuilt"  # a reference run uses the prebuilt entries, never compiles
        self.role = role
        self.err = tempfile.TemporaryFile()
        self.p = subprocess.Popen(
            # The parent's sys.path goes along as an argument (not through the
            # environment: settings.py is the only reader of that), so the child
            # imports kernel modules from the same places.
            [
                sys.executable,
                "-m",
                module,
                "--sys-path=" + os.pathsep.join(p for p in sys.path if p),  # "=": a path may start with "-"
                *([] if torch else ["--no-torch"]),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            env=env,
        )
        # PIPE: both exist (typed Optional by Popen).
        assert self.p.stdin is not None and self.p.stdout is not None
        self.stdin, self.stdout = self.p.stdin, self.p.stdout

    def ask(self, req: dict, timeout: float = LOAD_TIMEOUT) -> dict | None:
        try:
            self.stdin.write((json.dumps(req) + "\n").encode())
            self.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):  # ValueError: closed by kill_all
            return None
        try:
            r, _, _ = select.select([self.stdout], [], [], timeout)
        except (OSError, ValueError):
            return None
        if not r:
            self.p.kill()
            what = "loading" if self.role == "loader" else "the request"
            return {"ok": False, "error": f"{what} took over {timeout:.0f} s (killed)", "timed_out": True}
        line = self.stdout.readline()
        if not line:
            return None
        try:
            return json.loads(line)
        except ValueError:
            return {"ok": False, "error": f"bad answer from the loader: {line[:200]!r}"}

    def death(self) -> str:
        try:
            rc = self.p.wait(5)
        except subprocess.TimeoutExpired:
            self.p.kill()
            rc = self.p.wait()
        self.err.seek(0)
        tail = self.err.read()[-600:].decode("utf-8", "replace").strip()
        why = f"signal {-rc}" if rc < 0 else f"exit status {rc}"
        by = ""
        if rc < 0:
            try:
                by = f" by {signal.Signals(-rc).name}"
            except ValueError:
                pass
        return f"the {self.role} process died ({why}){by}" + (f": {tail}" if tail else "")

    def kill(self) -> None:
        try:
            self.p.kill()
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.stdin.close()
            self.p.wait(10)
        except Exception:  # noqa: BLE001
            self.p.kill()
            self.p.wait()
        self.err.close()


class _Stopped(Exception):
    """The pool was stopped (interrupt, or another worker failed): this worker ends."""


class _Pool:
    """The live children, under a lock, so that ``kill_all`` reaches every one of them,
    including one a worker starts (after a crash) while the interrupt comes."""

    def __init__(self, gpu: bool):
        self.gpu = gpu
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._live: set[ChildProcess] = set()

    def spawn(self) -> ChildProcess:
        # Without the GPU (no --run) a loader only loads: no tensor ever reaches tvm_ffi.
        c = ChildProcess(self.gpu, torch=self.gpu)
        with self._lock:
            if not self.stop.is_set():
                self._live.add(c)
                return c
        c.kill()
        c.close()
        raise _Stopped

    def retire(self, c: ChildProcess) -> None:
        with self._lock:
            self._live.discard(c)
        c.close()

    def kill_all(self) -> None:
        self.stop.set()
        with self._lock:
            for c in self._live:
                c.kill()

    def reap(self) -> None:
        """Close what is left (after kill_all and the workers' joins): no process, no file."""
        with self._lock:
            left, self._live = list(self._live), set()
        for c in left:
            c.kill()
            c.close()


def _drive(
    pool: _Pool, child: ChildProcess, reqs: list[dict], run: bool, take, answers: list, done: queue.Queue
):
    """One worker: take the next request index, ask its child, store the answer, report
    it; a dead child is restarted (its entry blamed). Posts None when it ends, whatever
    the reason, so the main thread's wait always ends."""
    try:
        while not pool.stop.is_set():
            i = take()
            if i is None:
                return
            a = child.ask(dict(reqs[i], run=run and reqs[i].get("run", True)))
            if pool.stop.is_set():
                return  # killed by kill_all: the "crash" is the interrupt, not this entry
            if a is not None and a.get("key", reqs[i].get("key")) != reqs[i].get("key"):
                # Another entry's answer: the stream is out of step; never report it as this one's
                a = {
                    "ok": False,
                    "error": f"the loader answered for another entry ({str(a.get('key'))[:16]})",
                }
                pool.retire(child)
                child = pool.spawn()
            elif a is None:
                a = {"ok": False, "error": child.death()}
                pool.retire(child)
                child = pool.spawn()
            elif a.get("restart") or child.p.poll() is not None:  # poisoned, or killed after a time-out
                pool.retire(child)
                child = pool.spawn()
            answers[i] = a
            done.put(1)
    except _Stopped:
        pass
    except BaseException as e:  # noqa: BLE001 - handed to the main thread, which re-raises it
        done.put(e)
        pool.kill_all()
    finally:
        pool.retire(child)
        done.put(None)


class Loaders:
    """Loader children started before their requests are known (``start_loaders``): each
    imports the runtime as it starts (and torch when it will run kernels: ~3 s on the H200
    host) while the caller runs its own checks. ``load_fresh(started=...)`` takes them
    over; ``close`` ends them when it never does (the caller failed in between, or was
    interrupted)."""

    def __init__(self, jobs: int, run: bool):
        if jobs < 1:
            raise ValueError(f"start_loaders: jobs must be at least 1, not {jobs}")
        self.pool = _Pool(gpu=run)
        self.children: list[ChildProcess] = []
        try:
            for _ in range(jobs):
                self.children.append(self.pool.spawn())
        except BaseException:
            self.close()
            raise

    @property
    def run(self) -> bool:
        """Started for reference runs: GPU-visible, prebuilt-only children."""
        return self.pool.gpu

    def close(self) -> None:
        """Kill and reap every child still here (a no-op after ``load_fresh`` took them)."""
        self.pool.kill_all()
        self.pool.reap()


def start_loaders(jobs: int, run: bool = False) -> Loaders:
    """``jobs`` loader children, started now (the caller closes them unless it hands them
    to ``load_fresh``, which then owns them)."""
    return Loaders(jobs, run)


def load_fresh(
    reqs: list[dict],
    *,
    run: bool = False,
    progress: Callable[[int], None] | None = None,
    jobs: int = 1,
    started: Loaders | None = None,
) -> tuple[list[dict], str]:
    """Load each request's object in a fresh process, over ``jobs`` children at once (at
    most one per request). Returns (one answer per request, in request order; a note
    when ``run`` was asked for and no GPU is visible). ``progress(n)`` is called in this
    thread after each answer, ``n`` counting the answers of every child. ``started``:
    children from ``start_loaders`` (``run`` must match theirs) used instead of starting
    ``jobs`` new ones; the ones more than the requests need are ended at once."""
    if jobs < 1:
        raise ValueError(f"load_fresh: jobs must be at least 1, not {jobs}")
    if started is not None and started.run != run:
        raise ValueError("load_fresh: the started loaders were started for another run mode")
    pool = started.pool if started is not None else _Pool(gpu=run)
    answers: list = [None] * len(reqs)
    note = ""
    threads: list[threading.Thread] = []
    done: queue.Queue = queue.Queue()
    finished = False
    try:
        # Every child starts at once: each imports the runtime, and torch to run kernels (~8 s
        # on the H200 host), and starting the others only after the first had answered the
        # GPU probe doubled that start-up.
        want = max(1, min(jobs, len(reqs)))
        if started is not None:
            children, spare = started.children[:want], started.children[want:]
            started.children = []
            for c in spare:
                pool.retire(c)
        else:
            children = [pool.spawn() for _ in range(want)]
        if run:
            a = children[0].ask({"op": "gpu"}, timeout=GPU_PROBE_TIMEOUT)
            if not a or not a.get("gpu"):
                note = "--run needs a CUDA GPU and none is visible; kernels were not run"
                run = False
        if not reqs:
            finished = True
            for c in children:
                pool.retire(c)
            return [], note
        order = iter(range(len(reqs)))
        lock = threading.Lock()

        def take() -> int | None:
            with lock:
                return next(order, None)

        for c in children:
            t = threading.Thread(
                target=_drive,
                args=(pool, c, reqs, run, take, answers, done),
                name="quack-verify",
                daemon=True,
            )
            t.start()
            threads.append(t)
        ended = got = 0
        while ended < len(threads):
            # An answer takes at most LOAD_TIMEOUT (+ a restart); twice that with no word from
            # any worker means one is stuck where no time-out reaches: fail, don't hang.
            try:
                item = done.get(timeout=2 * LOAD_TIMEOUT + 60)
            except queue.Empty:
                raise RuntimeError(
                    f"quack verify: no loader process answered in {2 * LOAD_TIMEOUT + 60:.0f} s"
                ) from None
            if item is None:
                ended += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                got += 1
                if progress is not None:
                    progress(got)
        finished = True
    finally:
        if not finished:
            pool.kill_all()
        for t in threads:
            t.join(JOIN_TIMEOUT)
        pool.reap()
    return answers, note
