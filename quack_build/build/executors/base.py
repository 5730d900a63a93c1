"""The executor contract: what the scheduler (quack_build.build.scheduler) hands an
executor (``WorkItem``), what it gets back (``Event``), and the ``Executor`` protocol
that the local pool (quack_build.build.executors.local) and the Ray coordinator
(quack_build.build.executors.ray.executor) implement. Kept apart from the factory
(``quack_build.build.executors.create``) so that the executors import the contract
without importing the module that imports them."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from quack.errors import ExecutorError

STARTED, DONE, FAILED, NOTE = "started", "done", "failed", "note"


class WorkersLost(ExecutorError):
    """The error of a key never compiled because the executor lost every worker (killed
    by what they compiled, out of memory, lost nodes) and may start no more: the build
    reports it not built (``failure: "no_worker"``), not as a compile failure."""


@dataclasses.dataclass(frozen=True)
class WorkItem:
    """One key to build. ``spec`` is the coordinator's KernelSpec (local use only:
    it is not sent anywhere); remote executors send module/kernel/params/arch."""

    key: str
    kernel: str
    module: str
    params: dict  # plain (JSON-able) parameters, as in a manifest
    arch: str
    force: bool = False
    spec: Any = dataclasses.field(default=None, compare=False, repr=False)
    bound: Any = dataclasses.field(default=None, compare=False, repr=False)  # canonical params


@dataclasses.dataclass
class Event:
    """What happened to a key (or, for NOTE, a line for the display).

    STARTED: a worker took the key (``lane`` names the worker for the display and the
    trace, ``pid`` its process id, ``t_start`` wall-clock seconds); ``awaited``: no
    worker took it, another process holds its lock and the executor waits for that
    process's entry (no worker of this build is busy with it). A key awaited and then
    released unpublished is compiled here after all: a second STARTED, not awaited.
    DONE: the entry is published in the cache; ``compiled`` False when another
    process published it first. FAILED: ``error`` is the real error (a CompileError
    with the compiler's text, a CompileTimeout, an ExecutorError)."""

    kind: str
    key: str = ""
    lane: str = ""
    pid: int = 0
    t_start: float = 0.0
    t_end: float = 0.0
    compiled: bool = False
    compile_s: float = 0.0
    wall_s: float = 0.0  # the worker's own measure of the key (0: unknown)
    error: BaseException | None = None
    text: str = ""
    awaited: bool = False


class Executor(Protocol):
    """The contract the scheduler drives: ``start`` once, then ``submit`` and ``poll``
    until every submitted key has a DONE or FAILED event, then ``close``. On Ctrl-C
    the scheduler calls ``cancel`` and then ``close``.

    name: "local" or "ray". jobs: parallel workers (known after ``start``).
    start_s: seconds ``start`` took (cluster connection, actor warm-up).
    """

    name: str
    jobs: int
    start_s: float

    def start(self, max_jobs: int) -> None:
        """Get workers ready; use at most ``max_jobs`` of them (the number of keys).
        Raises ExecutorError (package missing, cluster unreachable, every worker
        refused for a toolchain mismatch: ToolchainMismatch)."""

    def submit(self, item: WorkItem) -> None:
        """Queue a key; never blocks. Raises ExecutorError after ``cancel``/``close``."""

    def poll(self, timeout: float) -> list[Event]:
        """Wait up to ``timeout`` seconds for events and return them (maybe none).
        A key's failure is a FAILED event, never raised; KeyboardInterrupt passes
        through. Workers lost one after the other until no more may be started fail
        the keys left (FAILED, WorkersLost). Raises ExecutorError only when the executor
        itself is lost (every worker gone and none could start)."""

    def cancel(self) -> None:
        """Stop every outstanding compile now (kill its worker). Idempotent. Once it
        returns nothing more is published by this executor."""

    def close(self) -> None:
        """Release workers and connections. Idempotent; never waits for a compile."""


RAY_INSTALL_HINT = "--executor ray needs Ray, which is not installed: pip install 'quack-cache[ray]'"
