"""Build on a Ray cluster: ``quack build --executor ray | auto | ray://HOST:PORT | HOST:PORT``.

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
  at most ``MAX_RETRIES`` times, and is replaced. ``cancel`` kills every actor:
  nothing it was doing can reach the cache.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import importlib
import logging
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from quack.errors import CompileError, ExecutorError, LinkError, ToolchainMismatch
from quack_build.executors import DONE, FAILED, NOTE, RAY_INSTALL_HINT, STARTED, Event, WorkItem

log = logging.getLogger("quack")

MAX_RETRIES = 2          # a key whose actor died is tried at most 1 + MAX_RETRIES times
CONNECT_TIMEOUT_S = 5.0  # reaching a cluster's address; an unreachable one fails fast
# Publishing (verify, lock, write, fsync x2, .so) is I/O-bound: threads overlap the fsyncs,
# so the one coordinator keeps up with many nodes (see benchmarks/bench_ray.py).
PUBLISH_THREADS = 8
# How long start() waits for the first warm, accepted actor (a cluster may be scaling up).
START_TIMEOUT_S = 600.0
# Test hook: a stamp every actor of this process's next builds reports instead of its own
# (how the tests fake a node with another toolchain). None in normal use.
TEST_ACTOR_STAMP: str | None = None


def import_ray():
    """``ray``, or ExecutorError with the install line."""
    try:
        import ray
    except ImportError:
        raise ExecutorError(RAY_INSTALL_HINT, executor="ray") from None
    return ray


# --- the actor (runs on the cluster's nodes) ------------------------------------------------

class BuildWorker:
    """The body of a Ray actor: a warm, GPU-blind compile worker that never writes to a
    cache. Constructed once per actor (compiler import + warm-up compile)."""

    def __init__(self, packages: list[str], arch: str, stamp_override: str | None = None):
        t0 = time.perf_counter()
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")
        os.environ["CUTE_DSL_ARCH"] = arch
        # tvm_ffi imports torch when it can (seconds a compile never needs): hide it
        # while the compiler imports, as the local forkserver does.
        hidden = "torch" not in sys.modules
        if hidden:
            sys.modules["torch"] = None  # type: ignore[assignment]
        try:
            import cutlass.cute  # noqa: F401
            import tvm_ffi  # noqa: F401
        finally:
            if hidden and sys.modules.get("torch", 0) is None:
                del sys.modules["torch"]
        from quack import registry
        from quack.compile._warmup import warm_up

        registry.load_packages(packages)
        warm_up()
        self.arch = arch
        self.stamp_override = stamp_override
        self.warm_s = time.perf_counter() - t0

    def hello(self) -> dict:
        from quack import registry
        from quack.cache import keys

        srcfps = {}
        for name, spec in registry.all_specs().items():
            try:
                srcfps[name] = spec.source_fingerprint()
            except Exception:  # noqa: BLE001 - reported per key if it is built
                pass
        return {"pid": os.getpid(), "host": socket.gethostname(), "node": _node_ip(), "node_id": _node_id(),
                "stamp": self.stamp(self.arch), "toolchain": keys.toolchain(), "srcfps": srcfps,
                "warm_s": round(self.warm_s, 3)}

    def stamp(self, arch: str) -> str:
        from quack.cache import keys

        return self.stamp_override or keys.toolchain_stamp(arch)

    def build(self, item: dict) -> dict:
        """Compile one key into a temp directory; return its bytes and checksums, or
        {"error": CompileError} with the compiler's text. Never raises for a compile."""
        from quack import registry
        from quack.compile import builder
        from quack.runtime import loader

        t_start = time.time()
        p0 = time.perf_counter()
        kernel, params, arch = item["kernel"], item["params"], item["arch"]
        try:
            spec = registry.import_spec(item["module"], kernel)
            bound = spec.bind((), params)
            key = spec.key(bound, arch)
            srcfp = spec.source_fingerprint()
            with tempfile.TemporaryDirectory(prefix="quack-ray-") as d:
                obj = Path(d) / "k.o"
                seconds = builder.compile_to(spec, bound, arch, obj)
                data = obj.read_bytes()
                so = None
                if loader.can_link():
                    try:
                        loader.link(obj, Path(d) / "k.so")
                        so = (Path(d) / "k.so").read_bytes()
                    except (LinkError, OSError):
                        so = None  # the coordinator links it (or the loader, on first use)
        except CompileError as e:
            return {"error": e, "pid": os.getpid()}
        except BaseException as e:  # noqa: BLE001 - everything goes back as text
            detail = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            return {"error": CompileError(kernel, params, arch, detail), "pid": os.getpid()}
        return {"key": key, "srcfp": srcfp, "stamp": self.stamp(arch), "obj": data,
                "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "so": so,
                "so_sha256": hashlib.sha256(so).hexdigest() if so is not None else "",
                "compile_s": round(seconds, 4), "wall_s": time.perf_counter() - p0, "t_start": t_start,
                "pid": os.getpid(), "host": socket.gethostname()}

    def pid(self) -> int:
        return os.getpid()


def _node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001
        return ""


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001
        return socket.gethostname()


# --- the coordinator ----------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class _Actor:
    handle: object
    index: int
    label: str = ""
    pid: int = 0
    node: str = ""
    node_id: str = ""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:300]


def probe(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """A TCP connect to the cluster's HOST:PORT, so an unreachable address fails in
    seconds with a clear message (Ray's own connect retries for a minute or more)."""
    hostport = address[len("ray://"):] if address.startswith("ray://") else address
    host, _, port = hostport.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except (OSError, ValueError) as e:
        why = "timed out" if isinstance(e, socket.timeout) else (getattr(e, "strerror", None) or str(e))
        raise ExecutorError(
            f"cannot reach the Ray cluster at {address}: {why} (within {timeout:.0f} s). Is it running "
            f"(`ray start --head` on that host; Ray Client listens on 10001, the GCS on 6379) and is "
            f"the port open from here? To build on this host instead: --executor local",
            executor="ray", address=address) from None


class RayExecutor:
    """Drives warm BuildWorker actors; see the module docstring. Implements
    quack_build.executors.Executor."""

    name = "ray"

    def __init__(self, target: str, *, jobs: int | None, settings, store, max_retries: int = MAX_RETRIES,
                 stamp_override: str | None = None, connect_timeout: float = CONNECT_TIMEOUT_S):
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
        self._ray = None
        self._owned = False
        self._closed = False
        self._arch = settings.arch
        self._want = ""
        self._renv: dict = {}
        self._stage = ""
        self._actors: list[_Actor] = []
        self._idle: list[_Actor] = []
        self._hellos: dict = {}      # ObjectRef -> _Actor (warming up)
        self._busy: dict = {}        # ObjectRef -> (_Actor, WorkItem, attempt)
        self._queue: collections.deque = collections.deque()
        self._refused: list[ToolchainMismatch] = []
        self._start_errors: list[str] = []
        self._spawned = 0
        self._pending_notes: list[Event] = []
        self.counts = {"actors_started": 0, "actors_refused": 0, "actor_deaths": 0, "retries": 0,
                       "dispatched": 0, "published": 0, "actor_compile_wall_s": 0.0,
                       "roundtrip_s": 0.0, "publish_s": 0.0, "warm_s": [], "nodes": set()}
        self._dispatched_at: dict = {}
        self._publisher = None          # ThreadPoolExecutor, from start()
        self._publishing: set = set()   # its futures, each giving a list of events
        self._counts_lock = threading.Lock()
        self._cpu_ready = 0.0

    # -- start-up -------------------------------------------------------------------------
    def _connect(self) -> None:
        ray = self._ray
        if ray.is_initialized():
            # Code ships with the job's runtime_env, which only ray.init sets: a process
            # already connected can't give its actors our packages.
            raise ExecutorError("this process is already connected to Ray; quack build connects by "
                                "itself (call ray.shutdown() first, or run `quack build` in its own "
                                "process)", executor="ray")
        target = self.target
        # RAY_ADDRESS is Ray's own setting: `--executor ray` honours it like ray.init() does.
        env_addr = os.environ.get("RAY_ADDRESS", "")
        address = None if target == "ray" and not env_addr else (env_addr if target == "ray" else target)
        if address and address != "auto":
            probe(address, self.connect_timeout)
        self._renv = self._runtime_env()
        kw = dict(log_to_driver=False, logging_level=logging.WARNING, runtime_env=self._renv)
        try:
            if address is None:
                ray.init(address="local", num_cpus=self.requested or os.cpu_count() or 1,
                         _node_ip_address="127.0.0.1",
                         include_dashboard=False, **kw)
            else:
                ray.init(address=address, **kw)
        except ExecutorError:
            raise
        except Exception as e:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ...
            where = address or "a new local instance"
            raise ExecutorError(f"cannot start Ray ({where}): {_first_line(e)}", executor="ray",
                                address=address or "") from None
        self._owned = True
        try:
            self.address = address if address and address != "auto" else \
                ray.get_runtime_context().gcs_address
        except Exception:  # noqa: BLE001 - Ray Client has no GCS address to show
            self.address = address or "?"

    def _runtime_env(self) -> dict:
        """Ship quack, quack_build and the kernel packages as Ray py_modules. Each is
        copied under its import name first: Ray names a shipped module after its
        directory, and an installed package may live in a folder of another name
        (kernels/ installs as quack_kernels)."""
        import shutil

        self._stage = tempfile.mkdtemp(prefix="quack-ray-ship-")
        mods = []
        for name in ("quack", "quack_build", *self.settings.kernel_packages):
            try:
                mod = importlib.import_module(name)
                paths = list(getattr(mod, "__path__", None) or [mod.__file__])
                if len(paths) != 1 or not paths[0]:
                    raise ValueError(f"a namespace package spread over {len(paths)} directories")
                src = Path(paths[0])
                if src.is_dir():
                    dst = Path(self._stage) / name.replace(".", "/")
                    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so",
                                                                            "*.o"))
                else:
                    dst = Path(self._stage) / f"{name}.py"
                    shutil.copyfile(src, dst)
            except Exception as e:  # noqa: BLE001
                raise ExecutorError(f"cannot ship the package {name!r} ([build] kernel_packages) to the "
                                    f"Ray actors: {_first_line(e)}", executor="ray") from None
            mods.append(str(dst))
        return {"py_modules": mods,
                "env_vars": {"CUDA_VISIBLE_DEVICES": "", "CUTE_DSL_DISABLE_FILE_CACHING": "1",
                             "QUACK_NO_PRELOAD": "1"}}

    def _spawn(self) -> None:
        ray = self._ray
        cls = ray.remote(BuildWorker)
        handle = cls.options(num_cpus=1, num_gpus=0, max_restarts=0, max_task_retries=0,
                             scheduling_strategy="SPREAD").remote(
            list(self.settings.kernel_packages), self._arch, self.stamp_override)
        self._spawned += 1
        a = _Actor(handle, self._spawned, label=f"actor {self._spawned}")
        self._actors.append(a)
        self._hellos[handle.hello.remote()] = a
        self.counts["actors_started"] += 1

    def start(self, max_jobs: int) -> None:
        from quack.cache import keys

        t0 = time.monotonic()
        self._ray = import_ray()
        self._connect()
        try:
            self._want = keys.toolchain_stamp(self._arch)
            from concurrent.futures import ThreadPoolExecutor

            self._publisher = ThreadPoolExecutor(PUBLISH_THREADS, thread_name_prefix="quack-publish")
            cpus = int(self._ray.cluster_resources().get("CPU", 0))
            n = self.requested or cpus or 1
            if cpus and n > cpus:
                self._pending_notes.append(Event(NOTE, text=f"the Ray cluster has {cpus} CPUs: "
                                                 f"{cpus} actors instead of {n}"))
                n = cpus
            self.jobs = max(1, min(n, max_jobs))
            for _ in range(self.jobs):
                self._spawn()
            deadline = time.monotonic() + START_TIMEOUT_S
            # Dispatch starts with the first warm, accepted actor; the others join as they come.
            while not self._idle and self._hellos and time.monotonic() < deadline:
                self._pending_notes += self._handle(self._wait(min(1.0, max(0.0, deadline - time.monotonic()))))
            if not self._idle:
                raise self._no_actor_error()
        except BaseException:
            self.close()
            raise
        self.start_s = time.monotonic() - t0
        self._cpu_ready = time.process_time()

    def _no_actor_error(self) -> ExecutorError:
        if self._refused and not self._start_errors:
            e = self._refused[0]
            return ToolchainMismatch(f"{e} (every actor refused: nothing built)",
                                     worker_stamp=e.worker_stamp, coordinator_stamp=e.coordinator_stamp,
                                     worker=e.worker, executor="ray", address=self.address)
        if self._start_errors or self._refused:
            why = "; ".join(self._start_errors[:3] + [str(r) for r in self._refused[:1]])
            return ExecutorError(f"no Ray actor could start on {self.address}: {why}", executor="ray",
                                 address=self.address)
        return ExecutorError(f"no Ray actor became ready on {self.address} within {START_TIMEOUT_S:.0f} s; "
                             f"does the cluster have free CPUs?", executor="ray", address=self.address)

    # -- work -------------------------------------------------------------------------------
    def submit(self, item: WorkItem) -> None:
        if self._closed:
            raise ExecutorError("the Ray executor is closed", executor="ray")
        self._queue.append((item, 0))

    def _dispatch(self) -> list[Event]:
        out = []
        while self._queue and self._idle:
            item, attempt = self._queue.popleft()
            a = self._idle.pop()
            payload = {"key": item.key, "kernel": item.kernel, "module": item.module, "params": item.params,
                       "arch": item.arch}
            ref = a.handle.build.remote(payload)
            self._busy[ref] = (a, item, attempt)
            self._dispatched_at[ref] = time.perf_counter()
            self.counts["dispatched"] += 1
            out.append(Event(STARTED, item.key, lane=a.label, pid=a.pid, t_start=time.time()))
        return out

    def _wait(self, timeout: float) -> list:
        refs = list(self._busy) + list(self._hellos)
        if not refs:
            time.sleep(min(timeout, 0.05))
            return []
        ready, _ = self._ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:  # and whatever else is ready now
            ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0)
        return ready

    def _published(self) -> list[Event]:
        out: list[Event] = []
        for f in [f for f in self._publishing if f.done()]:
            self._publishing.discard(f)
            out += f.result()  # _finish never raises: a failure is a FAILED event
        return out

    def poll(self, timeout: float) -> list[Event]:
        out = self._pending_notes + self._dispatch() + self._published()
        self._pending_notes = []
        if self._closed:
            return out
        if self._publishing:  # come back soon for what the publisher threads finish
            timeout = min(timeout, 0.02)
        out += self._handle(self._wait(0 if out else timeout))
        out += self._check_deadlines()
        out += self._dispatch() + self._published()
        if self._queue and not self._idle and not self._busy and not self._hellos:
            raise self._no_actor_error()
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
            self._drop(a)
            self.counts["timeouts"] = self.counts.get("timeouts", 0) + 1
            if self._spawned < 2 * self.jobs + 2 * self.max_retries + 2:
                self._spawn()
            out.append(Event(FAILED, item.key, lane=a.label, pid=a.pid,
                             error=CompileTimeout(item.kernel, item.key, now - t0)))
        return out

    def _handle(self, ready: list) -> list[Event]:
        out: list[Event] = []
        done = []
        for ref in ready:
            if ref in self._hellos:
                out += self._on_hello(ref, self._hellos.pop(ref))
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
            self._publishing.add(self._publisher.submit(self._finish, item, res, a))
        return out + started

    def _on_hello(self, ref, a: _Actor) -> list[Event]:
        ray = self._ray
        try:
            info = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - the actor's constructor failed or it died
            self._drop(a)
            self._start_errors.append(f"{a.label}: {_first_line(e)}")
            log.warning("quack: Ray %s failed to start: %s", a.label, _first_line(e))
            return [Event(NOTE, text=f"warning: Ray {a.label} failed to start: {_first_line(e)}")]
        a.pid, a.node = int(info.get("pid") or 0), str(info.get("node") or info.get("host") or "?")
        a.node_id = str(info.get("node_id") or "")
        a.label = f"actor {a.index} ({a.node} pid {a.pid})"
        self.counts["warm_s"].append(info.get("warm_s"))
        got, want = str(info.get("stamp") or ""), self._want
        if got != want:
            return self._refuse(a, ToolchainMismatch(
                f"refusing Ray {a.label}: its toolchain stamp is {got!r} but this coordinator's is "
                f"{want!r}; install the same Python, nvidia-cutlass-dsl and apache-tvm-ffi on every "
                f"node (its objects would not match their keys)",
                worker_stamp=got, coordinator_stamp=want, worker=a.label, executor="ray",
                address=self.address))
        from quack import registry

        theirs = info.get("srcfps") or {}
        for name, spec in registry.all_specs().items():
            if name in theirs and spec.shippable:
                mine = spec.source_fingerprint()
                if theirs[name] != mine:
                    return self._refuse(a, ToolchainMismatch(
                        f"refusing Ray {a.label}: it sees kernel {name} with source fingerprint "
                        f"{theirs[name]} but this checkout has {mine} (another version of "
                        f"{spec.module} shadows the shipped one on that node)",
                        worker_stamp=theirs[name], coordinator_stamp=mine, worker=a.label,
                        executor="ray", address=self.address))
        self._idle.append(a)
        self.counts["nodes"].add(a.node_id)
        log.info("quack: Ray %s ready (warm-up %.1fs)", a.label, info.get("warm_s") or 0.0)
        return []

    def _refuse(self, a: _Actor, err: ToolchainMismatch) -> list[Event]:
        self._drop(a)
        self._refused.append(err)
        self.counts["actors_refused"] += 1
        log.warning("quack: %s", err)
        return [Event(NOTE, text=f"warning: {err}")]

    def _drop(self, a: _Actor) -> None:
        if a in self._actors:
            self._actors.remove(a)
        if a in self._idle:
            self._idle.remove(a)
        try:
            self._ray.kill(a.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def _collect(self, ref, a: _Actor, item: WorkItem, attempt: int):
        """A finished task: (item, result, actor) to publish, or the events it gives."""
        ray = self._ray
        t_disp = self._dispatched_at.pop(ref, time.perf_counter())
        try:
            res = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
                ray.exceptions.ObjectLostError, ray.exceptions.NodeDiedError) as e:
            return self._on_actor_death(a, item, attempt, e)
        except Exception as e:  # noqa: BLE001 - a Ray-level failure of this task: report it
            self._idle.append(a)
            return [Event(FAILED, item.key, lane=a.label, pid=a.pid, error=ExecutorError(
                f"Ray task for {item.kernel} key {item.key[:16]} on {a.label} failed: {_first_line(e)}",
                executor="ray", address=self.address))]
        self._idle.append(a)
        self.counts["roundtrip_s"] += time.perf_counter() - t_disp
        if res.get("error") is not None:
            return [Event(FAILED, item.key, lane=a.label, pid=a.pid, error=res["error"])]
        self.counts["actor_compile_wall_s"] += float(res.get("wall_s") or 0.0)
        return item, res, a

    def _finish(self, item: WorkItem, res: dict, a: _Actor) -> list[Event]:
        """In a publisher thread: publish one result; the events for it (never raises)."""
        p0 = time.perf_counter()
        try:
            compiled = self._publish(item, res, a)
        except Exception as e:  # noqa: BLE001 - ExecutorError, CacheError, OSError, LockTimeout
            return [Event(FAILED, item.key, lane=a.label, pid=a.pid, error=e)]
        finally:
            with self._counts_lock:
                self.counts["publish_s"] += time.perf_counter() - p0
        return [Event(DONE, item.key, lane=a.label, pid=a.pid, compiled=compiled,
                      compile_s=float(res.get("compile_s") or 0.0) if compiled else 0.0)]

    def _on_actor_death(self, a: _Actor, item: WorkItem, attempt: int, e: BaseException) -> list[Event]:
        self._drop(a)
        self.counts["actor_deaths"] += 1
        why = _first_line(e)
        out: list[Event] = []
        if not self._closed and self._spawned < 2 * self.jobs + 2 * self.max_retries + 2:
            self._spawn()  # keep the worker count; bounded, so a crashing node can't loop forever
        if attempt < self.max_retries:
            self.counts["retries"] += 1
            self._queue.appendleft((item, attempt + 1))
            out.append(Event(NOTE, text=f"Ray {a.label} died while compiling {item.kernel} key "
                                        f"{item.key[:16]} ({why}); retrying on another actor "
                                        f"(retry {attempt + 1} of {self.max_retries})"))
            log.warning("quack: Ray %s died compiling key %s; retry %d", a.label, item.key[:16], attempt + 1)
            return out
        out.append(Event(FAILED, item.key, lane=a.label, pid=a.pid, error=CompileError(
            item.kernel, item.params, item.arch,
            f"the Ray actors compiling it died {attempt + 1} times (last: {a.label}: {why}); "
            f"not retried again (crash, out of memory, or a lost node)")))
        return out

    # -- publishing (the coordinator is the only writer) -------------------------------------
    def _publish(self, item: WorkItem, res: dict, a: _Actor) -> bool:
        """Check what the actor sent and publish it; True if published here, False if
        another process published the key first. Raises ExecutorError for a result
        that does not match (key, fingerprint, stamp, size, checksum)."""
        from quack.cache import fsutil
        from quack.compile import builder
        from quack.runtime import loader

        ref = builder.entry_ref(item.spec, item.bound, item.arch)
        data = res.get("obj") or b""
        problem = ""
        if res.get("key") != item.key:
            problem = f"it computed key {str(res.get('key'))[:16]}, the coordinator {item.key[:16]}"
        elif res.get("srcfp") != ref.srcfp:
            problem = (f"it compiled sources with fingerprint {res.get('srcfp')}, this checkout has "
                       f"{ref.srcfp}")
        elif res.get("stamp") != ref.stamp:
            problem = f"its toolchain stamp is {res.get('stamp')!r}, the coordinator's {ref.stamp!r}"
        elif len(data) != res.get("size"):
            problem = f"received {len(data)} bytes, it sent {res.get('size')} (truncated in transit)"
        elif hashlib.sha256(data).hexdigest() != res.get("sha256"):
            problem = "the object's SHA-256 does not match what it sent (corrupted in transit)"
        if problem:
            raise ExecutorError(f"refusing the object for {item.kernel} key {item.key[:16]} from Ray "
                                f"{a.label}: {problem}; nothing was published", executor="ray",
                                address=self.address)
        store = self.store
        if not item.force and store.lookup(ref) is not None:
            return False
        with store.lock(ref):
            if not item.force and store.lookup(ref) is not None:
                return False
            tmp = store.tmp_obj(ref)
            try:
                _write_into(tmp, data)
                meta = {"params": item.params, "compile_s": res.get("compile_s", 0.0),
                        "host": res.get("host", ""), "pid": res.get("pid", 0), "created": time.time(),
                        "executor": "ray"}
                entry = store.publish(ref, tmp, meta)
            finally:
                if os.path.lexists(tmp):
                    os.unlink(tmp)
            so = res.get("so")
            if so is not None and hashlib.sha256(so).hexdigest() == res.get("so_sha256"):
                tmp_so = fsutil.reserve_tmp(store.paths(ref)["so"])
                try:
                    _write_into(tmp_so, so)
                    store.write_so(entry, tmp_so)
                except OSError:
                    pass  # a derived file: the loader links the .o on first use
                finally:
                    if os.path.lexists(tmp_so):
                        os.unlink(tmp_so)
            else:
                loader.link_entry(store, entry)
        with self._counts_lock:
            self.counts["published"] += 1
        return True

    def worker_pid(self, key: str) -> int:
        for a, item, _ in self._busy.values():
            if item.key == key:
                return a.pid
        return 0

    # -- stopping ---------------------------------------------------------------------------
    def cancel(self) -> None:
        """Kill every actor (Ray cancels their tasks with them) and let the publishes in
        progress finish (each is atomic; queued ones are dropped): nothing more is
        published once this returns."""
        self._closed = True
        self._queue.clear()
        for a in list(self._actors):
            self._drop(a)
        self._busy.clear()
        self._hellos.clear()
        self._idle.clear()
        if self._publisher is not None:
            self._publisher.shutdown(wait=True, cancel_futures=True)
            self._publisher = None

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
        if self._owned:
            self._owned = False
            try:
                self._ray.shutdown()
            except Exception:  # noqa: BLE001
                pass

    def stats(self) -> dict:
        d = dict(self.counts)
        d["nodes"] = sorted(d["nodes"])
        d["jobs"] = self.jobs
        d["publish_threads"] = PUBLISH_THREADS
        d["start_s"] = round(self.start_s, 3)
        d["address"] = self.address
        return d


def _write_into(tmp: Path, data: bytes) -> None:
    """Fill a temp file the store reserved (O_EXCL, ours): no symlink is followed."""
    fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
