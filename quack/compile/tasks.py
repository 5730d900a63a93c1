"""The compile pool's bookkeeping of keys: each key's state (new -> pending -> done |
failed), its task record, its outcome (the worker's report, or the error to raise once),
the pool's counters, the session's record of failed keys (one line each, kept after a
key is forgotten: the pytest plugin's summary lists them), and the errors that report a
task the pool could not finish (its worker died, the pool shut down, no worker could start).

A :class:`TaskBook` is not thread-safe on its own: the pool holds its lock around every
call, and wakes its waiters when a call says the state changed."""

from __future__ import annotations

import dataclasses
import logging
import time

from quack.compile import claims
from quack.compile.diagnostics import first_error_line
from quack.compile.worker import WorkerRequest
from quack.errors import CompileError, WorkerDied

NEW, PENDING, DONE, FAILED = "new", "pending", "done", "failed"
#: How many failed keys' errors a pool keeps for its session's report (``stats()['errors']``).
MAX_SESSION_ERRORS = 50
log = logging.getLogger("quack.pool")


@dataclasses.dataclass(frozen=True)
class TaskInfo:
    """The pool's public view of one key's task (``CompilePool.task_info``).

    ``started``: time.monotonic() when a worker took it (or, for a key another
    process is compiling, when the pool began awaiting it); None while queued.
    ``pid``: the worker's pid once started; None for queued or external keys."""

    kernel: str
    key: str
    arch: str
    submitted: float
    started: float | None
    pid: int | None
    external: bool


class Task:
    """One key's compile as the pool tracks it; ``ident`` is (cache root, key)."""

    __slots__ = (
        "ident",
        "key",
        "root",
        "kernel",
        "params",
        "arch",
        "request",
        "timeout",
        "submitted",
        "started",
        "pid",
        "external_lock",
        "obj_meta",
        "claim_fd",
        "stale_retried",
        "wait_setting",
        "unstored_fallback",
        "unstored_why",
    )

    def __init__(self, ident, key, root, kernel, params, arch, request: WorkerRequest, timeout):
        self.ident, self.key, self.root = ident, key, root
        self.kernel, self.params, self.arch, self.request, self.timeout = (
            kernel,
            params,
            arch,
            request,
            timeout,
        )
        self.submitted = time.monotonic()
        self.started: float | None = None
        self.pid: int | None = None
        self.external_lock: str | None = None  # lock path, for a key another process is compiling
        self.obj_meta: str | None = None  # its metadata path (written last by a publish)
        # the key's lock, held here until the worker has its copy (quack.compile.claims)
        self.claim_fd: int | None = None
        # asked again once after a worker found the kernel's source changed since its
        # forkserver imported it (quack.errors.SourceChanged): workers forked afresh then
        self.stale_retried = False
        # a key another process is compiling: the setting that bounds this pool's wait for
        # it ("lock_timeout", or "compile_timeout" where that is the smaller)
        self.wait_setting = "lock_timeout"
        # a caller that can load an object unpublished (a runtime miss): a key whose lock
        # another process held past lock_timeout is compiled by a worker into a private
        # file instead of failing (quack.compile.dispatch), its bytes in the report
        self.unstored_fallback = False
        self.unstored_why = ""  # why it was compiled unstored (the report's "why")

    def release_claim(self) -> None:
        """Let go of this process's copy of the key's lock (sent, or the task ended)."""
        fd, self.claim_fd = self.claim_fd, None
        if fd is not None:
            claims.release(fd)

    def info(self) -> TaskInfo:
        return TaskInfo(
            self.kernel,
            self.key,
            self.arch,
            self.submitted,
            self.started,
            self.pid,
            self.external_lock is not None,
        )


# -- a task the pool could not finish ----------------------------------------------------------
def worker_died_error(task: Task, exitcode) -> WorkerDied:
    return WorkerDied(task.kernel, task.params, task.arch, task.key, task.pid, exitcode)


def cancelled_error(task: Task) -> CompileError:
    return CompileError(
        task.kernel, task.params, task.arch, "compile cancelled (pool shut down)", transient=True
    )


def cannot_start_error(task: Task, exc: BaseException) -> CompileError:
    return CompileError(
        task.kernel,
        task.params,
        task.arch,
        f"cannot start a compile worker: {exc!r}",
        transient=True,
    )


def dispatcher_error(task: Task, exc: BaseException) -> CompileError:
    return CompileError(
        task.kernel,
        task.params,
        task.arch,
        f"the compile pool's dispatcher failed: {exc!r}",
        transient=True,
    )


def error_line(err: BaseException) -> str:
    """A failed key's error in one line, as the session's record keeps it: its message's
    first line (the kernel, its parameters and arch) and, where the message goes on (a
    compiler's output, a traceback), the compiler's first error or the exception the
    traceback ends with: the line that says why."""
    text = str(err).strip()
    head = text.splitlines()[0] if text else type(err).__name__
    if "\n" not in text:
        return head
    cause = first_error_line(getattr(err, "detail", None) or text, limit=200)
    return head if cause in head else f"{head} {cause}"


# -- the book ---------------------------------------------------------------------------------
class TaskBook:
    """Per (cache root, key): state, current task, error, report; and the pool's counters."""

    def __init__(self) -> None:
        self._state: dict[tuple, str] = {}
        self._errors: dict[tuple, BaseException] = {}
        self._tasks: dict[tuple, Task] = {}
        self._reports: dict[tuple, dict] = {}
        # Every key's failure this session, as text: forget() (a reported failure, so the
        # key may be retried) drops the key's error, not this record, which the pytest
        # plugin's summary lists after the tests consumed the errors. Bounded.
        self._session_errors: dict[tuple, str] = {}
        self.counts = {
            "submitted": 0,
            "done": 0,
            "failed": 0,
            "compiled": 0,
            "compile_s": 0.0,
            "awaited_external": 0,
            "timeouts": 0,
            "worker_deaths": 0,
            "workers_started": 0,
            "stale_restarts": 0,  # workers restarted: a kernel's source changed after their import
            # keys a worker compiled unstored: another process held their lock past
            # lock_timeout, or the cache can't take the object (read-only, full)
            "unstored": 0,
        }

    def state(self, ident: tuple) -> str:
        return self._state.get(ident, NEW)

    def poll(self, ident: tuple) -> tuple[str, BaseException | None]:
        return self._state.get(ident, NEW), self._errors.get(ident)

    def error(self, ident: tuple) -> BaseException | None:
        return self._errors.get(ident)

    def report(self, ident: tuple) -> dict | None:
        return self._reports.get(ident)

    def task(self, ident: tuple) -> Task | None:
        return self._tasks.get(ident)

    def begin(self, task: Task) -> None:
        """The key is pending with this task; an earlier outcome is dropped."""
        ident = task.ident
        self._errors.pop(ident, None)
        self._reports.pop(ident, None)
        self._tasks[ident] = task
        self._state[ident] = PENDING

    def finish(self, task: Task, ok: bool, payload) -> bool:
        """Record a task's outcome (the worker's report, or the error). Returns False,
        recording nothing, when the key has moved on to another task."""
        ident = task.ident
        task.release_claim()  # ended: a lock still held here (never sent) goes now
        if self._tasks.get(ident) is not task:
            return False
        if ok:
            self._state[ident] = DONE
            self._reports[ident] = payload
            self.counts["done"] += 1
            if payload.get("compiled"):
                self.counts["compiled"] += 1
                self.counts["compile_s"] += payload.get("compile_s", 0.0)
        else:
            self._state[ident] = FAILED
            self._errors[ident] = payload
            self.counts["failed"] += 1
            if ident in self._session_errors or len(self._session_errors) < MAX_SESSION_ERRORS:
                self._session_errors[ident] = error_line(payload)
            log.info(
                "pool: %s %s failed: %s",
                task.kernel,
                task.key[:16],
                str(payload).strip().splitlines()[-1][:200] if str(payload).strip() else "",
            )
        return True

    def cancel(self, task: Task) -> None:
        """The pool shut down: a pending key fails as cancelled (not counted as failed)."""
        task.release_claim()
        if self._state.get(task.ident) == PENDING:
            self._state[task.ident] = FAILED
            self._errors[task.ident] = cancelled_error(task)

    def renew(self, ident: tuple) -> None:
        """New again (another process let go of the key without publishing it)."""
        self._tasks.pop(ident, None)
        self._state.pop(ident, None)

    def forget(self, ident: tuple) -> None:
        """Drop a key's state; a pending key is kept (forgetting would let a second
        compile start)."""
        if self._state.get(ident) == PENDING:
            return
        self._state.pop(ident, None)
        self._errors.pop(ident, None)
        self._tasks.pop(ident, None)
        self._reports.pop(ident, None)

    def pending(self) -> int:
        return sum(1 for s in self._state.values() if s == PENDING)

    def error_texts(self) -> dict[str, str]:
        """Each key that failed this session (the first MAX_SESSION_ERRORS of them), its
        last error as text, forgotten keys too (the pool's ``stats()['errors']``)."""
        return {k[1]: e for k, e in self._session_errors.items()}
