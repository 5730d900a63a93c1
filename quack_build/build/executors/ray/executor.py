"""Build on a Ray cluster: ``quack build --executor ray | auto | ray://HOST:PORT | HOST:PORT``.

This module is the coordinator's side: it connects, hands keys to warm actors, collects
their results, retries a key whose actor died and kills a wedged one. Its neighbours:
cluster (importing ray, connecting, shipping the code), actors (the pool of
actors: start, admit or refuse, kill), worker (the actor itself, run on the nodes)
and ../publish (checking and publishing what an actor returns).

Ray does the placement, the transport and the failure detection; quack keeps its
own scheduler (longest first, fail-fast, display, trace) and its cache rules:

* **Warm actors.** One actor per worker (``--jobs``; default: the cluster's CPUs,
  capped by the number of keys), ``num_cpus=1, num_gpus=0``, GPU-blind
  (``CUDA_VISIBLE_DEVICES=""``). Each imports the compiler once and does the
  throwaway warm-up compile in its constructor, then reports its toolchain stamp
  and the source fingerprints it sees. An actor whose stamp (or fingerprint)
  differs from the coordinator's is refused, naming both: it would build objects
  that are not what the key promises.
* **Code shipping.** quack, quack_build and the ``[build] kernel_packages`` reach
  the actors through ``runtime_env.py_modules``: a node needs the toolchain
  (Python, nvidia-cutlass-dsl, apache-tvm-ffi), not the checkout.
* **Only the coordinator writes.** An actor compiles into its own temp directory
  and returns the ``.o`` bytes (and the ``.so`` it linked, when it could) with
  their size and SHA-256; the coordinator checks them, the key and the source
  fingerprint, and publishes through the store's atomic publish under the key's
  lock (check, lock, check again).
* **Failures.** A compile error comes back as the compiler's own CompileError. An
  actor that dies (killed, OOM, node lost) has its key retried on another actor,
  at most ``MAX_RETRIES`` times, and is replaced, within a budget (``_may_replace``): once
  it is spent and no actor is left, the keys still queued fail as WorkersLost (not
  built), and the build ends with its summary. ``cancel`` kills every actor:
  nothing it was doing can reach the cache.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from typing import Any

from quack.errors import CompileError, ExecutorError
from quack_build.build.executors.base import (
    FAILED,
    NOTE,
    RAY_INSTALL_HINT,
    STARTED,
    Event,
    WorkersLost,
    WorkItem,
)
from quack_build.build.executors.publish import PUBLISH_THREADS, Publisher
from quack_build.build.executors.ray.actors import Actor, ActorPool
from quack_build.build.executors.ray.cluster import (
    ACTOR_ENV,
    CONNECT_TIMEOUT_S,
    connect,
    first_line,
    import_ray,
    stage_packages,
)

log = logging.getLogger("quack")

# How long start() waits for the first warm, accepted actor (a cluster may be scaling up);
# the error when none came names it (ActorPool.no_actor_error).
START_TIMEOUT_S = 600.0

MAX_RETRIES = 2  # a key whose actor died is tried at most 1 + MAX_RETRIES times
# Test hook: a stamp every actor of this process's next builds reports instead of its own
# (how the tests fake a node with another toolchain). None in normal use.
TEST_ACTOR_STAMP: str | None = None
# The order of stats()'s counters (``--json``'s executor_stats); the pool and the publisher keep some.
_STATS_ORDER = (
    "actors_started",
    "actors_refused",
    "actor_deaths",
    "retries",
    "dispatched",
    "published",
    "timeouts",
    "actor_compile_wall_s",
    "roundtrip_s",
    "publish_s",
    "warm_s",
    "nodes",
    "coordinator_cpu_s",
)


class RayExecutor:
    """Drives warm BuildWorker actors; see the module docstring. Implements
    quack_build.build.executors.base.Executor."""

    name = "ray"

    def __init__(
        self,
        target: str,
        *,
        jobs: int | None,
        settings,
        store,
        max_retries: int = MAX_RETRIES,
        stamp_override: str | None = None,
        connect_timeout: float = CONNECT_TIMEOUT_S,
    ):
        import importlib.util

        if importlib.util.find_spec("ray") is None:  # fail before planning, not after
            raise ExecutorError(RAY_INSTALL_HINT, executor="ray")
        self.target = target
        self.requested = jobs
        self.settings = settings
        self.store = store
        self.max_retries = max_retries
        self.stamp_override = stamp_override if stamp_override is not None else TEST_ACTOR_STAMP
        self.connect_timeout = connect_timeout
        self.jobs = jobs or 1
        self.start_s = 0.0
        self.address = ""
        self._ray: Any = None  # the ray module, from start()
        self._owned = False
        self._closed = False
        self._arch = settings.arch
        self._stage = ""
        self._pool = ActorPool(list(settings.kernel_packages), self._arch, self.stamp_override)
        self._pool.preload = tuple(settings.preload)
        self._pool.preload_source = settings.sources.get("preload", "")
        self._busy: dict = {}  # ObjectRef -> (Actor, WorkItem, attempt)
        self._queue: collections.deque = collections.deque()
        self._pending_notes: list[Event] = []
        # The pool counts actors_started, actors_refused, warm_s and nodes, the publisher
        # published and publish_s (see stats()).
        self.counts: dict[str, Any] = {
            "actor_deaths": 0,
            "retries": 0,
            "dispatched": 0,
            "timeouts": 0,
            "actor_compile_wall_s": 0.0,
            "roundtrip_s": 0.0,
        }
        self._dispatched_at: dict = {}
        # The last actor lost (died or killed past compile_timeout), and whether a lost actor
        # found the replacement budget (_may_replace) spent: then, once no actor is left, the
        # keys still queued fail naming both (_fail_queued) instead of the build aborting.
        self._last_lost = ""
        self._budget_spent = False
        self._publisher = Publisher(store)  # its threads start in start()
        self._cpu_ready = 0.0

    # -- start-up -------------------------------------------------------------------------
    def start(self, max_jobs: int) -> None:
        from quack.cache import keys

        t0 = time.monotonic()
        self._ray = import_ray(local_only=self.target == "ray" and not os.environ.get("RAY_ADDRESS"))
        try:
            self._stage, mods = stage_packages(("quack", "quack_build", *self.settings.kernel_packages))
            self.address = connect(
                self._ray,
                self.target,
                num_cpus=self.requested,
                runtime_env={"py_modules": mods, "env_vars": dict(ACTOR_ENV)},
                connect_timeout=self.connect_timeout,
            )
            self._owned = True
            self._pool.attach(self._ray, want=keys.toolchain_stamp(self._arch), address=self.address)
            self._publisher.open(self.address)
            cpus = int(self._ray.cluster_resources().get("CPU", 0))
            n = self.requested or cpus or 1
            if cpus and n > cpus:
                self._pending_notes.append(
                    Event(NOTE, text=f"the Ray cluster has {cpus} CPUs: {cpus} actors instead of {n}")
                )
                n = cpus
            self.jobs = max(1, min(n, max_jobs))
            for _ in range(self.jobs):
                self._pool.spawn()
            deadline = time.monotonic() + START_TIMEOUT_S
            # Dispatch starts with the first warm, accepted actor; the others join as they come.
            while not self._pool.idle and self._pool.warming and time.monotonic() < deadline:
                self._pending_notes += self._handle(
                    self._wait(min(1.0, max(0.0, deadline - time.monotonic())))
                )
            if not self._pool.idle:
                raise self._pool.no_actor_error(START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        self.start_s = time.monotonic() - t0
        self._cpu_ready = time.process_time()

    # -- work -------------------------------------------------------------------------------
    def submit(self, item: WorkItem) -> None:
        if self._closed:
            raise ExecutorError("the Ray executor is closed", executor="ray")
        self._queue.append((item, 0))

    def _dispatch(self) -> list[Event]:
        out = []
        while self._queue and self._pool.idle:
            item, attempt = self._queue.popleft()
            a = self._pool.idle.pop()
            payload = {
                "key": item.key,
                "kernel": item.kernel,
                "module": item.module,
                "params": item.params,
                "arch": item.arch,
            }
            ref = a.handle.build.remote(payload)
            self._busy[ref] = (a, item, attempt)
            self._dispatched_at[ref] = time.perf_counter()
            self.counts["dispatched"] += 1
            out.append(Event(STARTED, item.key, lane=a.label, pid=a.pid, t_start=time.time()))
        return out

    def _wait(self, timeout: float) -> list:
        refs = list(self._busy) + list(self._pool.warming)
        if not refs:
            time.sleep(min(timeout, 0.05))
            return []
        ready, _ = self._ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:  # and whatever else is ready now
            ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0)
        return ready

    def poll(self, timeout: float) -> list[Event]:
        out = self._pending_notes + self._dispatch() + self._publisher.done()
        self._pending_notes = []
        if self._closed:
            return out
        if self._publisher.pending:  # come back soon for what the publisher threads finish
            timeout = min(timeout, 0.02)
        out += self._handle(self._wait(0 if out else timeout))
        out += self._check_deadlines()
        out += self._dispatch() + self._publisher.done()
        if self._queue and not self._pool.idle and not self._busy and not self._pool.warming:
            if not self._budget_spent:
                raise self._pool.no_actor_error(START_TIMEOUT_S)
            out += self._fail_queued()
        return out

    def _replace(self, a: Actor, why: str) -> None:
        """``a`` is lost (dead, or killed for a time-out): start another, within the budget."""
        self._last_lost = f"{a.label}: {why}"
        if self._closed:
            return
        if self._may_replace():
            self._pool.spawn()  # keep the worker count
        else:
            self._budget_spent = True

    def _fail_queued(self) -> list[Event]:
        """No actor is left and the replacement budget is spent: every key still queued
        fails, not built (the scheduler reports them: the summary, --keep-going's rest)."""
        lost = self.counts["actor_deaths"] + self.counts["timeouts"]
        err = WorkersLost(
            f"no Ray actor left: the replacement budget is exhausted after {lost} actor "
            f"deaths (last: {self._last_lost}); a kernel that crashes its compile process, "
            f"or nodes out of memory?",
            executor="ray",
            address=self.address,
        )
        out = [Event(FAILED, item.key, error=err) for item, _attempt in self._queue]
        self._queue.clear()
        return out

    def _check_deadlines(self) -> list[Event]:
        """A compile running past compile_timeout (a wedged actor): kill the actor, fail
        the key with CompileTimeout, start a replacement."""
        from quack.errors import CompileTimeout

        out: list[Event] = []
        now = time.perf_counter()
        limit = self.settings.compile_timeout
        for ref, (a, item, _attempt) in list(self._busy.items()):
            t0 = self._dispatched_at.get(ref)
            if t0 is None or now - t0 <= limit:
                continue
            del self._busy[ref]
            self._dispatched_at.pop(ref, None)
            self._pool.drop(a)
            self.counts["timeouts"] += 1
            self._replace(a, f"killed after {limit:.0f} s compiling {item.kernel} (compile_timeout)")
            out.append(
                Event(
                    FAILED,
                    item.key,
                    lane=a.label,
                    pid=a.pid,
                    error=CompileTimeout(item.kernel, item.key, now - t0),
                )
            )
        return out

    def _handle(self, ready: list) -> list[Event]:
        out: list[Event] = []
        done = []
        for ref in ready:
            if ref in self._pool.warming:
                out += self._pool.on_hello(ref)
            elif ref in self._busy:
                got = self._collect(ref, *self._busy.pop(ref))
                if isinstance(got, list):
                    out += got
                else:
                    done.append(got)
        # Actors get their next key before the coordinator verifies and publishes (lock,
        # write, fsync): publishing stays off the actors' critical path.
        started = self._dispatch()
        for item, res, a in done:
            self._publisher.submit(item, res, worker=f"Ray {a.label}", lane=a.label, pid=a.pid)
        return out + started

    def _may_replace(self) -> bool:
        """Whether a lost actor may be replaced: bounded, so a crashing node can't loop forever."""
        return self._pool.spawned < 2 * self.jobs + 2 * self.max_retries + 2

    def _collect(self, ref, a: Actor, item: WorkItem, attempt: int):
        """A finished task: (item, result, actor) to publish, or the events it gives."""
        ray = self._ray
        t_disp = self._dispatched_at.pop(ref, time.perf_counter())
        try:
            res = ray.get(ref)
        except (
            ray.exceptions.RayActorError,
            ray.exceptions.WorkerCrashedError,
            ray.exceptions.ObjectLostError,
            ray.exceptions.NodeDiedError,
        ) as e:
            return self._on_actor_death(a, item, attempt, e)
        except Exception as e:  # noqa: BLE001 - a Ray-level failure of this task: report it
            self._pool.idle.append(a)
            return [
                Event(
                    FAILED,
                    item.key,
                    lane=a.label,
                    pid=a.pid,
                    error=ExecutorError(
                        f"Ray task for {item.kernel} key {item.key[:16]} on {a.label} failed: {first_line(e)}",
                        executor="ray",
                        address=self.address,
                    ),
                )
            ]
        self._pool.idle.append(a)
        self.counts["roundtrip_s"] += time.perf_counter() - t_disp
        if res.get("error") is not None:
            return [Event(FAILED, item.key, lane=a.label, pid=a.pid, error=res["error"])]
        self.counts["actor_compile_wall_s"] += float(res.get("wall_s") or 0.0)
        return item, res, a

    def _on_actor_death(self, a: Actor, item: WorkItem, attempt: int, e: BaseException) -> list[Event]:
        self._pool.drop(a)
        self.counts["actor_deaths"] += 1
        why = first_line(e)
        out: list[Event] = []
        self._replace(a, why)
        if attempt < self.max_retries:
            self.counts["retries"] += 1
            self._queue.appendleft((item, attempt + 1))
            out.append(
                Event(
                    NOTE,
                    text=f"Ray {a.label} died while compiling {item.kernel} key "
                    f"{item.key[:16]} ({why}); retrying on another actor "
                    f"(retry {attempt + 1} of {self.max_retries})",
                )
            )
            log.warning("quack: Ray %s died compiling key %s; retry %d", a.label, item.key[:16], attempt + 1)
            return out
        out.append(
            Event(
                FAILED,
                item.key,
                lane=a.label,
                pid=a.pid,
                error=CompileError(
                    item.kernel,
                    item.params,
                    item.arch,
                    f"the Ray actors compiling it died {attempt + 1} times (last: {a.label}: {why}); "
                    f"not retried again (crash, out of memory, or a lost node)",
                ),
            )
        )
        return out

    # -- the scheduler's question: who compiles this key ------------------------------------
    def worker_pid(self, key: str) -> int:
        for a, item, _ in self._busy.values():
            if item.key == key:
                return a.pid
        return 0

    # -- stopping ---------------------------------------------------------------------------
    def cancel(self) -> None:
        """Kill every actor (Ray cancels their tasks with them), shut Ray down (the
        instance this build started goes with it), and let the publishes in progress
        finish (each is atomic; those queued or still waiting for a key's lock that
        another process holds are dropped): nothing more is published once this
        returns, and no wait here is longer than a write."""
        self._closed = True
        self._queue.clear()
        self._publisher.cancel()
        self._pool.drop_all()
        self._busy.clear()
        self._disconnect()
        self._publisher.shutdown()

    def _disconnect(self) -> None:
        if self._owned:
            self._owned = False
            try:
                self._ray.shutdown()
            except Exception:  # noqa: BLE001
                pass

    def close(self) -> None:
        if self._stage:
            import shutil

            shutil.rmtree(self._stage, ignore_errors=True)
            self._stage = ""
        if self._ray is None:
            return
        if self._cpu_ready and not self.counts.get("coordinator_cpu_s"):
            self.counts["coordinator_cpu_s"] = round(time.process_time() - self._cpu_ready, 3)
        self.cancel()

    @property
    def preload_s(self) -> float:
        """[build] preload: the longest an actor spent importing it (the build summary's
        start-up line, ``--json``'s preload_s), as the local pool reports its forkserver's."""
        return self._pool.preload_s

    def describe(self) -> str:
        ready = len(self._pool.idle) + len(self._busy)
        return (
            f"Ray {self.address}: {self.jobs} actor{'s' if self.jobs != 1 else ''} (1 CPU each, "
            f"GPU-blind), {ready} warm after {self.start_s:.1f}s"
        )

    def stats(self) -> dict:
        got = {**self._pool.counts, **self._publisher.counts, **self.counts}
        d = {k: got[k] for k in _STATS_ORDER if k in got}
        d.update((k, v) for k, v in got.items() if k not in d)  # a counter not listed: last, not lost
        d["nodes"] = sorted(d["nodes"])
        d["jobs"] = self.jobs
        d["publish_threads"] = PUBLISH_THREADS
        d["start_s"] = round(self.start_s, 3)
        d["address"] = self.address
        return d
