"""The default executor: quack's compile pool (GPU-blind workers forked from a warm
forkserver on this host). Each worker publishes its own entry under the key's lock.

A key whose lock another process holds (another build, a test run compiling it) is
awaited, not compiled (``awaited`` STARTED event); if that process lets go without
publishing it, the pool has the key as new again and it is submitted once more, here.
A key whose worker was killed by a signal (the OOM killer's SIGKILL, a segfault) is
tried once more on a fresh worker, with a note; a second death fails it."""

from __future__ import annotations

import time
from typing import Any

from quack.errors import WorkerDied
from quack_build.build.executors.base import DONE, FAILED, NOTE, STARTED, Event, WorkItem

#: Attempts after the first for a key whose worker a signal killed (the Ray executor's
#: actors are retried too). One: a kernel whose compile itself crashes the worker, or
#: needs more memory than the host has, fails on its second death instead of looping.
DEATH_RETRIES = 1


class LocalExecutor:
    name = "local"

    def __init__(self, jobs: int, *, settings):
        self.jobs = max(1, jobs)
        self.settings = settings
        self.start_s = 0.0  # the pool starts on the first submit; the scheduler measures it
        self.preload_s = 0.0  # [build] preload import time of the workers' forkserver (reports)
        self._pool: Any = None  # a quack.compile.pool.CompilePool, from start()
        self._gen = 0
        self._items: dict[str, WorkItem] = {}
        self._started: set[str] = set()
        self._retries: dict[str, int] = {}  # key -> retries after a worker's death
        self._root = str(settings.cache_dir)

    def start(self, max_jobs: int) -> None:
        from quack.compile import pool as qpool

        self.jobs = max(1, min(self.jobs, max_jobs))
        self._pool = qpool.CompilePool(self.jobs, settings=self.settings)
        self._gen = self._pool.generation

    def submit(self, item: WorkItem) -> None:
        self._items[item.key] = item
        self._submit(item)

    def _submit(self, item: WorkItem) -> None:
        self._pool.submit(
            item.spec, item.bound, item.arch, item.key, settings=self.settings, force=item.force
        )

    def _task_record(self, key: str):
        """The pool's TaskInfo of a key (start time, worker pid); None if it has none."""
        return self._pool.task_info(key, self._root)

    def poll(self, timeout: float) -> list[Event]:
        from quack.compile import tasks as qpool  # the per-key states

        self._gen = self._pool.wait_change(self._gen, timeout=timeout)
        now_w, now_m = time.time(), time.monotonic()
        out: list[Event] = []
        for key in list(self._items):
            st, err = self._pool.poll(key, self._root)
            if st == qpool.NEW:
                # Awaited, and the other process let go of the lock without publishing (its
                # build failed or was killed): ours to compile now. Left alone, the key was
                # in flight for ever (NEW gives no event) and the build never ended.
                self._started.discard(key)
                self._submit(self._items[key])
                st, err = self._pool.poll(key, self._root)
            if key not in self._started:
                pt = self._task_record(key)
                if pt is not None and pt.started is not None:
                    self._started.add(key)
                    out.append(
                        Event(
                            STARTED,
                            key,
                            lane="",
                            pid=pt.pid or 0,
                            t_start=now_w - (now_m - pt.started),
                            awaited=pt.external,
                        )
                    )
            if st == qpool.DONE:
                r = self._pool.report(key, self._root) or {}
                self.preload_s = max(self.preload_s, float(r.get("preload_s") or 0.0))
                del self._items[key]
                self._started.discard(key)
                out.append(
                    Event(
                        DONE,
                        key,
                        pid=r.get("pid", 0) or 0,
                        compiled=bool(r.get("compiled")),
                        compile_s=float(r.get("compile_s") or 0.0),
                        wall_s=float(r.get("wall_s") or 0.0),
                    )
                )
            elif st == qpool.FAILED:
                self._started.discard(key)
                if self._retry_after_death(key, err, out):
                    continue
                del self._items[key]
                out.append(Event(FAILED, key, error=err))
        return out

    def _retry_after_death(self, key: str, err, out: list[Event]) -> bool:
        """Submit a key again whose worker a signal killed (not one whose compile failed,
        timed out or whose worker exited), at most DEATH_RETRIES times, with a note."""
        if not isinstance(err, WorkerDied) or not err.signal:
            return False
        n = self._retries.get(key, 0)
        if n >= DEATH_RETRIES:
            return False
        self._retries[key] = n + 1
        item = self._items[key]
        out.append(
            Event(
                NOTE,
                key,
                text=f"retrying {item.kernel} key {key[:16]}: its compile worker pid {err.pid} "
                f"was killed by {err.signal} (out of memory?); trying once more on a new worker",
            )
        )
        self._pool.forget(key, self._root)  # reported; the pool may take the key again
        self._submit(item)
        return True

    def worker_pid(self, key: str) -> int:
        pt = self._task_record(key)
        return (pt.pid or 0) if pt is not None else 0

    def worker_pids(self) -> list[int]:
        """Every compile worker this executor's pool started: after ``cancel`` each is
        killed (or ended), so a temp file named for one of them has no writer."""
        return self._pool.worker_pids() if self._pool is not None else []

    def stats(self) -> dict:
        """Retries of keys whose worker was killed (the Ray executor's ``retries`` too)."""
        return {"retries": sum(self._retries.values())} if self._retries else {}

    def cancel(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            # The build is being stopped: a forkserver still in its preload would outlive
            # it (holding its stdout) until the preload ends. After shutdown() no new one
            # starts (quack.compile.worker.ensure_forkserver runs under the pool's lock).
            from quack.compile import worker

            worker.stop_forkserver()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
