"""Deferral (--async-compile): a test whose kernel misses the session's cache is
deferred while its compile runs in the pool; other tests run meanwhile and it is
retried once its key is done. A deferred attempt's reports are discarded.

Only misses in the session's cache (the default settings' cache directory)
defer; a test that installs its own Settings with another cache (a tmp_path
cache) waits for its compiles instead: its tmp_path, and so its cache, would be
new on every retry. Misses in teardown always wait."""

from __future__ import annotations

import os

import pytest
from _pytest.outcomes import Skipped  # pytest.skip.Exception, spelled so type checkers see it

MAX_DEFERS = 20


def drop_frames(exc: BaseException | None) -> None:
    """A deferred test's CompilePending is kept until its retry; its traceback would
    keep the test's frames alive, and with them every tensor the test had allocated
    (seen on the H200: 138 GiB held by deferred attempts, then CUDA out-of-memory)."""
    if exc is not None:
        exc.__traceback__ = None
        exc.__context__ = None
        exc.__cause__ = None


def cap_workers(n: int | None) -> int | None:
    """--async-compile=N at most one worker per CPU: N=100000 was taken as asked, and
    each compile worker is a process of its own (an interpreter, cutlass's imports)
    competing for the same CPUs. The plugin says so once (the report header)."""
    cpus = os.cpu_count() or 1
    return cpus if n is not None and n > cpus else n


def pool_for_session(config, async_n: int, worker: bool):
    """The default compile pool, sized for this process: N (default: compile_jobs,
    else one per CPU), split over xdist workers. Returns (pool, scope_root)."""
    from quack import settings
    from quack.compile import pool as _pool

    n = async_n or 0
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    scope_root = None
    try:
        s = settings.get()
        if n <= 0:
            n = s.compile_jobs
        scope_root = str(s.cache_dir)
    except Exception:  # noqa: BLE001 - a bad quack.toml: the first miss reports it
        pass
    n = n or (os.cpu_count() or 1)
    jobs = max(1, n // workers) if worker else max(1, n)
    pool = _pool.configure_default(jobs)
    if config.getoption("quack_prewarm", False):
        pool.prewarm()
    return pool, scope_root


def prewarm_sync_pool() -> None:
    """--quack-prewarm without --async-compile: start one worker of the pool a test's miss
    compiles in (the process's default pool; a test waits for its compile), so the first
    miss does not also pay for the worker's start (its cutlass import). One: a test waits
    for one compile at a time. The flag used to start nothing unless --async-compile was
    given, although its help promised workers at session start."""
    from quack.compile import pool as _pool

    try:
        _pool.default_pool().prewarm(1)
    except Exception:  # noqa: BLE001 - a bad quack.toml or an exiting interpreter: the first miss reports it
        pass


class Deferred(Skipped):
    """Setup hit a pending compile: end setup (the body must not run on half-built
    fixtures). The attempt's reports are discarded."""


class PendingHooks:
    """Detects CompilePending in each phase of a test."""

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_fixture_setup(self, fixturedef, request):
        # A fixture that hit a pending compile: pytest caches only Exceptions, and
        # CompilePending is a BaseException, so leave the fixture clean (finalizers
        # run, nothing cached) for the retry.
        from quack.errors import CompilePending

        try:
            return (yield)
        except CompilePending:
            fins = getattr(fixturedef, "_finalizers", None)
            if fixturedef.cached_result is None and fins:
                todo = list(fins)
                fins.clear()
                for fin in reversed(todo):
                    try:
                        fin()
                    except Exception:  # noqa: BLE001 - the retry reports its own errors
                        pass
            raise

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item):
        from quack.errors import CompilePending

        try:
            return (yield)
        except CompilePending as e:
            item._quack_pending = e
            raise Deferred(f"deferred: {e}") from None

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_call(self, item):
        from quack.errors import CompilePending

        try:
            return (yield)
        except CompilePending as e:
            # A pass, cheaply (no traceback formatting): the report is discarded.
            item._quack_pending = e
            return None

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item, nextitem):
        # Teardown never defers: a miss there waits for its compile.
        from quack.compile.scope import suppress_pool

        with suppress_pool():
            return (yield)


def worker_drain_hook(runner):
    """Wraps xdist's own runtestloop and protocol calls (a separate object: the
    runner's own hooks are a different kind of implementation) to retry the deferred
    tests between xdist's tests and at the end."""

    class _W:
        draining = False

        @pytest.hookimpl(wrapper=True, tryfirst=True)
        def pytest_runtest_protocol(self, item, nextitem):
            # The outermost wrapper (tryfirst, registered after the builtins and
            # pytest-timeout): the retries run before this test's timeout, faulthandler
            # and warnings wrappers start, each through the hook with its own. Draining
            # inside them let one test's timer be replaced and cancelled by a retry's.
            if runner.deferred and not self.draining:
                self.draining = True
                try:
                    runner.drain(nextitem=item)
                finally:
                    self.draining = False
            res = yield
            if not self.draining:  # xdist's own call (a retry's caller takes its own)
                pending, item._quack_deferred = getattr(item, "_quack_deferred", None), None
                if pending is not None:
                    runner.deferred.append((item, pending))
            return res

        @pytest.hookimpl(wrapper=True)
        def pytest_runtestloop(self, session):
            res = yield
            self.draining = True  # the retries' own protocol calls must not drain again
            try:
                runner.drain_all(session)
            finally:
                self.draining = False
            return res

    return _W()
