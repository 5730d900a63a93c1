"""Build executors: where ``quack build`` runs its compiles. The scheduler
(quack_build.build.scheduler) plans, orders, displays and summarizes; an executor only
runs the keys it is given and reports what happened to each.

* ``local`` (default): the forkserver pool of warm, GPU-blind worker processes
  on this host (quack_build.build.executors.local).
* ``ray``, ``auto``, ``ray://HOST:PORT``, ``HOST:PORT``: warm Ray actors on a
  cluster (quack_build.build.executors.ray.executor); the coordinator (this process)
  is the only writer of the cache.

Nothing here imports torch, cutlass or ray: ``quack build`` stays light."""

from __future__ import annotations

from quack_build.build.executors.base import Executor


def create(settings, *, jobs: int | None, store, executor: str | None = None) -> Executor:
    """The executor the settings (or ``executor``) name. ``jobs``: the explicit worker
    count (None: local = one per CPU; Ray = the cluster's CPUs).
    Raises ExecutorError when Ray is named but not installed."""
    which = executor or getattr(settings, "executor", "local") or "local"
    if which == "local":
        from quack_build.build.executors.local import LocalExecutor

        return LocalExecutor(settings.effective_jobs(jobs), settings=settings)
    from quack_build.build.executors.ray.executor import RayExecutor

    return RayExecutor(which, jobs=jobs, settings=settings, store=store)
