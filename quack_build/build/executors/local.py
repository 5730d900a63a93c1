"""The default executor: quack's compile pool (GPU-blind workers forked from a warm
forkserver on this host). Each worker publishes its own entry under the key's lock."""

from __future__ import annotations

import time
from typing import Any

from quack_build.build.executors.base import DONE, FAILED, STARTED, Event, WorkItem


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
        self._root = str(settings.cache_dir)

    def start(self, max_jobs: int) -> None:
        from quack.compile import pool as qpool

        self.jobs = max(1, min(self.jobs, max_jobs))
        self._pool = qpool.CompilePool(self.jobs, settings=self.settings)
        self._gen = self._pool.generation

    def submit(self, item: WorkItem) -> None:
        self._items[item.key] = item
        self._pool.submit(
            item.spec, item.bound, item.arch, item.key, settings=self.settings, force=item.force
        )

    def _task_record(self, key: str):
        """The pool's TaskInfo of a key (start time, worker pid); None if it has none."""
        return self._pool.task_info(key, self._root)

    def poll(self, timeout: float) -> list[Event]:
        from quack.compile import pool as qpool

        self._gen = self._pool.wait_change(self._gen, timeout=timeout)
        now_w, now_m = time.time(), time.monotonic()
        out: list[Event] = []
        for key in list(self._items):
            st, err = self._pool.poll(key, self._root)
            if key not in self._started:
                pt = self._task_record(key)
                if pt is not None and pt.started is not None:
                    self._started.add(key)
                    out.append(
                        Event(STARTED, key, lane="", pid=pt.pid or 0, t_start=now_w - (now_m - pt.started))
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
                del self._items[key]
                self._started.discard(key)
                out.append(Event(FAILED, key, error=err))
        return out

    def worker_pid(self, key: str) -> int:
        pt = self._task_record(key)
        return (pt.pid or 0) if pt is not None else 0

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
