"""The coordinator's pool of warm BuildWorker actors for ``quack build --executor ray``:
starting them, admitting or refusing each one when it reports in, and killing them.

An actor reports (``hello``) its toolchain stamp and the kernels' source fingerprints
once its constructor has imported the compiler and done the warm-up compile. One whose
stamp (or a fingerprint) differs from the coordinator's is refused, naming both: it
would build objects that are not what the key promises. Which key an actor compiles,
retries and time-outs are the executor's (quack_build.build.executors.ray.executor); the
actor's own code is quack_build.build.executors.ray.worker, which the nodes import from the
shipped packages. Nothing here imports ray: the executor hands the module in."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from quack.errors import ExecutorError, ToolchainMismatch
from quack_build.build.executors.base import NOTE, Event
from quack_build.build.executors.ray.cluster import first_line

log = logging.getLogger("quack")


@dataclasses.dataclass(eq=False)
class Actor:
    """One actor as the coordinator sees it; ``label`` names it in the display and trace."""

    handle: Any
    index: int
    label: str = ""
    pid: int = 0
    node: str = ""
    node_id: str = ""


def vet_hello(info: dict, want: str, label: str, address: str) -> ToolchainMismatch | None:
    """Why the actor that sent ``info`` (its ``hello``) must be refused, or None to admit it.
    ``want``: the coordinator's toolchain stamp."""
    got = str(info.get("stamp") or "")
    if got != want:
        return ToolchainMismatch(
            f"refusing Ray {label}: its toolchain stamp is {got!r} but this coordinator's is "
            f"{want!r}; install the same Python, nvidia-cutlass-dsl and apache-tvm-ffi on every "
            f"node (its objects would not match their keys)",
            worker_stamp=got,
            coordinator_stamp=want,
            worker=label,
            executor="ray",
            address=address,
        )
    from quack import registry

    theirs = info.get("srcfps") or {}
    for name, spec in registry.all_specs().items():
        if name in theirs and spec.shippable:
            mine = spec.source_fingerprint()
            if theirs[name] != mine:
                return ToolchainMismatch(
                    f"refusing Ray {label}: it sees kernel {name} with source fingerprint "
                    f"{theirs[name]} but this checkout has {mine} (another version of "
                    f"{spec.module} shadows the shipped one on that node)",
                    worker_stamp=theirs[name],
                    coordinator_stamp=mine,
                    worker=label,
                    executor="ray",
                    address=address,
                )
    return None


class ActorPool:
    """The actors of one build. ``warming``: hello ObjectRef -> Actor not yet admitted;
    ``idle``: admitted actors with no key (the executor takes them and gives them back).
    ``attach`` before ``spawn``."""

    def __init__(self, packages: list[str], arch: str, stamp_override: str | None):
        self.packages = packages
        self.arch = arch
        self.stamp_override = stamp_override
        self.preload: tuple = ()  # [build] preload, and where it was set: each actor imports it
        self.preload_source = ""
        self.preload_s = 0.0  # the longest an admitted actor spent importing them (the summary's)
        self.ray: Any = None  # the ray module, from attach()
        self.want = ""  # the coordinator's toolchain stamp
        self.address = ""
        self.actors: list[Actor] = []
        self.idle: list[Actor] = []
        self.warming: dict = {}  # ObjectRef -> Actor (warming up)
        self.spawned = 0
        self.refused: list[ToolchainMismatch] = []
        self.start_errors: list[str] = []
        self.counts: dict[str, Any] = {"actors_started": 0, "actors_refused": 0, "warm_s": [], "nodes": set()}

    def attach(self, ray, *, want: str, address: str) -> None:
        """Connected: the ray module, the stamp an actor must report, the cluster's address."""
        self.ray, self.want, self.address = ray, want, address

    def spawn(self) -> None:
        from quack_build.build.executors.ray.worker import BuildWorker

        cls = self.ray.remote(BuildWorker)
        handle = cls.options(
            num_cpus=1, num_gpus=0, max_restarts=0, max_task_retries=0, scheduling_strategy="SPREAD"
        ).remote(list(self.packages), self.arch, self.stamp_override, list(self.preload), self.preload_source)
        self.spawned += 1
        a = Actor(handle, self.spawned, label=f"actor {self.spawned}")
        self.actors.append(a)
        self.warming[handle.hello.remote()] = a
        self.counts["actors_started"] += 1

    def on_hello(self, ref) -> list[Event]:
        """``ref``, one of ``warming``, is ready: admit its actor to ``idle`` or refuse it."""
        a = self.warming.pop(ref)
        try:
            info = self.ray.get(ref)
        except Exception as e:  # noqa: BLE001 - the actor's constructor failed or it died
            self.drop(a)
            self.start_errors.append(f"{a.label}: {first_line(e)}")
            log.warning("quack: Ray %s failed to start: %s", a.label, first_line(e))
            return [Event(NOTE, text=f"warning: Ray {a.label} failed to start: {first_line(e)}")]
        a.pid, a.node = int(info.get("pid") or 0), str(info.get("node") or info.get("host") or "?")
        a.node_id = str(info.get("node_id") or "")
        a.label = f"actor {a.index} ({a.node} pid {a.pid})"
        self.counts["warm_s"].append(info.get("warm_s"))
        self.preload_s = max(self.preload_s, float(info.get("preload_s") or 0.0))
        err = vet_hello(info, self.want, a.label, self.address)
        if err is not None:
            return self._refuse(a, err)
        self.idle.append(a)
        self.counts["nodes"].add(a.node_id)
        log.info("quack: Ray %s ready (warm-up %.1fs)", a.label, info.get("warm_s") or 0.0)
        return []

    def _refuse(self, a: Actor, err: ToolchainMismatch) -> list[Event]:
        self.drop(a)
        self.refused.append(err)
        self.counts["actors_refused"] += 1
        log.warning("quack: %s", err)
        return [Event(NOTE, text=f"warning: {err}")]

    def drop(self, a: Actor) -> None:
        """Forget ``a`` and kill it (Ray cancels its task with it)."""
        if a in self.actors:
            self.actors.remove(a)
        if a in self.idle:
            self.idle.remove(a)
        try:
            self.ray.kill(a.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def drop_all(self) -> None:
        for a in list(self.actors):
            self.drop(a)
        self.warming.clear()
        self.idle.clear()

    def no_actor_error(self, waited_s: float) -> ExecutorError:
        """Why the build has no actor to run on (none admitted, none warming, or none
        ready within ``waited_s``, the start's time-out)."""
        if self.refused and not self.start_errors:
            e = self.refused[0]
            return ToolchainMismatch(
                f"{e} (every actor refused: nothing built)",
                worker_stamp=e.worker_stamp,
                coordinator_stamp=e.coordinator_stamp,
                worker=e.worker,
                executor="ray",
                address=self.address,
            )
        if self.start_errors or self.refused:
            why = "; ".join(self.start_errors[:3] + [str(r) for r in self.refused[:1]])
            return ExecutorError(
                f"no Ray actor could start on {self.address}: {why}", executor="ray", address=self.address
            )
        return ExecutorError(
            f"no Ray actor became ready on {self.address} within {waited_s:.0f} s; "
            f"does the cluster have free CPUs?",
            executor="ray",
            address=self.address,
        )
