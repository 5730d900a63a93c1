"""The runner: runs test protocols in a test-running process (single-process
pytest or an xdist worker) so that each test reports exactly one real outcome:
defer-and-retry on pending compiles (deferral), OOM retry (oom), strict mode
(strict), out-of-order set-up repair, and the report relay to xdist."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

import pytest

from quack.testing import deferral, gpus, oom, strict
from quack.testing.deferral import MAX_DEFERS
from quack.testing.strict import StrictMode

if TYPE_CHECKING:
    from quack.compile.pool import CompilePool

log = logging.getLogger("quack.testing")


class Runner:
    """Runs test protocols in a test-running process (single-process pytest or an
    xdist worker): defer-and-retry on pending compiles, OOM retry, strict mode."""

    def __init__(self, config, async_n, prebuilt):
        self.config = config
        self.deferring = async_n is not None
        self.max_defers = int(config.getoption("quack_max_defers", MAX_DEFERS))  # >= 0: checked
        self.worker = hasattr(config, "workerinput")
        self.pool: CompilePool | None = None  # set when deferring (--async-compile)
        self.strict = StrictMode() if prebuilt else None
        self.misses: list | None = None  # the current attempt's prebuilt-mode misses
        self.defers = 0
        self.forced_sync = 0
        self.oom_retried: list[str] = []
        self.oom_saved: list[str] = []
        self.strict_fails: list[str] = []
        self.attempts: dict[str, int] = {}
        self.deferred: list = []  # xdist: [(item, pending)]
        self.predicted = None
        self.interactor = None
        self.setup_errors: list[str] = []
        self.t_first_test = None
        self.scope_root = None
        pin = gpus.current
        self.gpu_lock = gpus.GpuLock(pin.gpu) if pin is not None and pin.shared else None
        self.gpu_name = pin.gpu if pin is not None else "all"
        if self.deferring:
            self.pool, self.scope_root = deferral.pool_for_session(config, async_n, self.worker)
        elif config.getoption("quack_prewarm", False) and not prebuilt:  # prebuilt never compiles
            deferral.prewarm_sync_pool()

    @property
    def prebuilt(self) -> bool:
        return self.strict is not None

    def close(self):
        pass  # the pool's atexit hook kills workers without waiting

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        rep = yield
        if call.excinfo is not None and oom.is_cuda_oom(call.excinfo.value):
            item._quack_oom = True
        if self.strict is not None and self.misses is not None:  # set-up, call and teardown
            if self.strict.check(rep, self.misses):
                self.strict_fails.append(item.nodeid)
        return rep

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector):
        """Strict mode around each collector: a module that met a miss at import (and
        caught it: ``K = None``, ``skipif(K is None)``) fails to collect, naming the
        entry, instead of skipping its tests with exit status 0."""
        if self.strict is None:
            return (yield)
        with self.strict.collecting() as misses:
            rep = yield
        early = strict.early_misses(self.config) if isinstance(collector, pytest.Session) else []
        if self.strict.check_collect(rep, misses, early):
            self.strict_fails.append(rep.nodeid)
        return rep

    # running one attempt ------------------------------------------------------------------------
    def _fix_setupstate(self, item):
        # A deferral runs tests out of the order the last protocol predicted
        # (its nextitem); tear down what the actual item doesn't share.
        if self.predicted is not item:
            ss = item.session._setupstate
            if ss.stack:
                try:
                    ss.teardown_exact(item)
                except Exception as e:  # noqa: BLE001
                    self.setup_errors.append(f"{item.nodeid}: teardown before out-of-order run: {e!r}")
                    ss.stack.clear()

    def _protocol(self, item, nextitem, sync: bool):
        from _pytest.runner import runtestprotocol

        from quack.compile import scope

        self._fix_setupstate(item)
        self.predicted = nextitem
        item._quack_pending = None
        item._quack_oom = False
        log: list = []
        with contextlib.ExitStack() as stack:
            # The attempt's scopes reach autograd's device threads too (a backward's miss
            # defers like a forward's instead of waiting for its compile).
            stack.enter_context(scope.sharing_with_threads())
            if self.strict is not None:
                self.misses = stack.enter_context(self.strict.attempt())
            try:
                if self.deferring and not sync:
                    with scope.pool_scope(self.pool, root=self.scope_root):
                        with scope.recording_pending() as log:  # inside: pool_scope masks it
                            reports = runtestprotocol(item, nextitem=nextitem, log=False)
                else:
                    with scope.suppress_pool():
                        reports = runtestprotocol(item, nextitem=nextitem, log=False)
            finally:
                self.misses = None
        pending = item._quack_pending or (log[0] if log and self.deferring and not sync else None)
        item._quack_pending = None
        for exc in (pending, *log):
            deferral.drop_frames(exc)
        return pending, reports

    def _run_item(self, item, nextitem):
        """One attempt. Returns the pending exception (deferred) or None (reported)."""
        if self.t_first_test is None:
            self.t_first_test = time.time()
        n = self.attempts.get(item.nodeid, 0)
        sync = n >= self.max_defers
        if sync and self.deferring:
            self.forced_sync += 1
        if self.gpu_lock is not None:
            self.gpu_lock.shared()
        t0 = time.perf_counter()
        try:
            pending, reports = self._protocol(item, nextitem, sync)
            if pending is None and getattr(item, "_quack_oom", False):
                pending, reports = self._oom_retry(item, nextitem, sync, reports)
        finally:
            if self.gpu_lock is not None:
                self.gpu_lock.release()
        # One line per attempt (QUACK_LOG=debug): the evidence when a deferred test keeps
        # coming back (each attempt finds one more missing key) or an attempt is slow.
        if log.isEnabledFor(logging.DEBUG):  # no formatting per test when nobody listens
            log.debug(
                "attempt %d of %s: %s in %.2f s",
                n + 1,
                item.nodeid,
                f"deferred ({pending})" if pending is not None else "reported",
                time.perf_counter() - t0,
            )
        if pending is not None:
            self.attempts[item.nodeid] = n + 1
            self.defers += 1
            bad = [r for r in reports if r.when == "teardown" and r.failed]
            if bad:
                item._quack_teardown_error = bad[0]
            return pending
        td_error = getattr(item, "_quack_teardown_error", None)
        if td_error is not None and reports and reports[-1].when == "teardown" and reports[-1].passed:
            reports[-1] = td_error  # a deferred attempt's teardown failed: that is part of the outcome
        self._log(item, reports)
        return None

    def _oom_retry(self, item, nextitem, sync, reports):
        def again():
            self.predicted = item  # the failed attempt tore down to nextitem: same chain
            self._fix_setupstate(item)
            return self._protocol(item, nextitem, sync)

        pending, reports = oom.retry(again, self.gpu_lock, self.gpu_name)
        self.oom_retried.append(item.nodeid)
        if pending is None and reports and all(r.passed for r in reports):
            self.oom_saved.append(item.nodeid)  # the retry turned a CUDA OOM into a pass
        return pending, reports

    def _log(self, item, reports):
        ihook = item.ihook
        interactor = self._interactor(item) if self.worker else None
        saved = None
        if interactor is not None:
            saved = interactor.item_index
            interactor.item_index = item.session.items.index(item)
        try:
            ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
            for rep in reports:
                ihook.pytest_runtest_logreport(report=rep)
            ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        finally:
            if interactor is not None:
                interactor.item_index = saved

    def _interactor(self, item):
        if self.interactor is None:
            for p in item.config.pluginmanager.get_plugins():
                if type(p).__name__ == "WorkerInteractor":
                    self.interactor = p
                    break
        return self.interactor

    def _ready(self, pending) -> bool:
        from quack.compile.tasks import PENDING

        pool = getattr(pending, "pool", None) or self.pool
        assert pool is not None  # a pending compile always has its pool
        return pool.state(pending.key, getattr(pending, "root", None)) != PENDING

    # single process: our own loop ----------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session):
        if self.worker or not self.deferring:
            return None
        if session.testsfailed and not session.config.option.continue_on_collection_errors:
            raise session.Interrupted(
                f"{session.testsfailed} error{'s' if session.testsfailed != 1 else ''} during collection"
            )
        if session.config.option.collectonly:
            return True
        from collections import deque

        pool = self.pool
        assert pool is not None  # deferring
        queue = deque((item, None) for item in session.items)
        blocked = 0
        gen = pool.generation
        while queue:
            item, pending = queue.popleft()
            if (
                pending is not None
                and not self._ready(pending)
                and self.attempts.get(item.nodeid, 0) < self.max_defers
            ):
                queue.append((item, pending))
                blocked += 1
                if blocked >= len(queue):
                    gen = pool.wait_change(gen, 1.0)
                    blocked = 0
                continue
            blocked = 0
            gen = pool.generation
            nextitem = queue[0][0] if queue else None
            pending = self.run_protocol(item, nextitem)
            if pending is not None:
                queue.append((item, pending))
                continue
            if session.shouldfail:
                raise session.Failed(session.shouldfail)
            if session.shouldstop:
                raise session.Interrupted(session.shouldstop)
        return True

    # the protocol: every attempt of every test, whoever runs it -----------------------------------
    def run_protocol(self, item, nextitem):
        """One attempt through the hook, as pytest's own loop calls it, so that the
        other plugins' pytest_runtest_protocol wrappers (pytest-timeout,
        faulthandler_timeout, the warnings summary) wrap every attempt and retry:
        calling _run_item directly ran the tests under --async-compile with no
        timeout and no warnings summary. Returns the pending exception (deferred)
        or None (reported, or run by a plugin that took the protocol over)."""
        item._quack_deferred = None
        item.ihook.pytest_runtest_protocol(item=item, nextitem=nextitem)
        pending, item._quack_deferred = item._quack_deferred, None
        return pending

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        item._quack_deferred = self._run_item(item, nextitem)
        return True

    def drain(self, nextitem, force=False):
        todo, self.deferred = self.deferred, []
        for item, pending in todo:
            if force or self._ready(pending) or self.attempts.get(item.nodeid, 0) >= self.max_defers:
                p = self.run_protocol(item, nextitem)
                if p is not None:
                    self.deferred.append((item, p))
            else:
                self.deferred.append((item, pending))

    def drain_all(self, session):
        """After xdist's loop: run the deferred tests as their compiles finish."""
        if not self.deferred:
            return
        if session.shouldstop or session.shouldfail:
            self.deferred.clear()
            return
        pool = self.pool
        assert pool is not None  # only a deferring runner defers
        gen = pool.generation
        while self.deferred:
            before = [(i.nodeid, self.attempts.get(i.nodeid, 0)) for i, _ in self.deferred]
            self.drain(nextitem=None)
            after = [(i.nodeid, self.attempts.get(i.nodeid, 0)) for i, _ in self.deferred]
            if self.deferred and after == before:
                gen = pool.wait_change(gen, 1.0)
            else:
                gen = pool.generation

    # bookkeeping ----------------------------------------------------------------------------------
    def summary(self) -> dict:
        st = self.pool.stats() if self.pool is not None else {}
        return {
            "submitted": st.get("submitted", 0),
            "failed": st.get("failed", 0),
            "compiled": st.get("compiled", 0),
            "compile_s": st.get("compile_s", 0.0),
            "timeouts": st.get("timeouts", 0),
            "worker_deaths": st.get("worker_deaths", 0),
            "awaited_external": st.get("awaited_external", 0),
            "errors": list(st.get("errors", {}).values())[:5],
            "deferrals": self.defers,
            "forced_sync": self.forced_sync,
            "oom_retried": list(self.oom_retried),
            "oom_saved": list(self.oom_saved),
            "setup_errors": list(self.setup_errors),
            "t_first_test": self.t_first_test,
            "async": self.deferring,
        }

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session):
        if self.worker:
            session.config.workeroutput["quack"] = self.summary()
