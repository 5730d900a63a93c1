"""quack's pytest plugin (registered through the pytest11 entry point; no conftest line).

Options
  --async-compile[=N]  a test whose kernel misses the cache is deferred while its
                       compile runs in N CPU workers (default: one per CPU, split
                       over xdist workers); other tests run meanwhile and the test is
                       retried once its key is done. A deferred attempt's reports are
                       discarded: each test reports exactly one real outcome.
  --quack-prebuilt     strict mode (also QUACK_MODE=prebuilt): any kernel miss fails
                       the test with the KernelNotPrebuilt message.
  --quack-prewarm      start the compile workers at session start (their imports
                       overlap collection) instead of at the first miss.
  --quack-max-defers=K after K deferrals a test's next attempt compiles synchronously.

Deferral rule: only misses in the session's cache (the default settings' cache
directory) defer. A test that installs its own Settings with another cache (a
tmp_path cache) waits for its compiles in the pool instead: its tmp_path, and so
its cache, would be new on every retry. Misses in teardown always wait.

Strict mode rule: the plugin installs the process's *default* settings with
mode=prebuilt (``quack.settings.set_current``) and re-installs them whenever a
test leaves none installed. A test that installs its own Settings (a private
tmp cache in jit mode, as the project's cache tests do) runs under those and is
unaffected; a test that swallows the KernelNotPrebuilt error still fails.

Engaged when any quack option is given, QUACK_MODE=prebuilt, or a quack.toml is
found from the rootdir up (the project uses quack). Engaged, it also
  * pins each xdist worker to one GPU, round-robin over the visible GPUs
    (CUDA_VISIBLE_DEVICES; QUACK_PYTEST_GPU_PIN=0 turns it off). The pin is
    made when the plugin is imported, before any conftest can initialise CUDA;
  * retries a test that failed with CUDA out-of-memory once, after gc.collect()
    and torch.cuda.empty_cache(), holding the GPU exclusively (a GPU-wide file
    lock that every worker sharing the GPU takes shared around each test);
  * checks at session end that every collected, non-deselected test reported;
  * prints one summary line (keys submitted, failed, deferrals, compile seconds).
Nothing is started until the first miss, and nothing waits for idle workers at exit.
"""
from __future__ import annotations

import os
import re
import sys
import time

import pytest

_PLUGIN = "quack-runner"
_CONTROLLER = "quack-controller"
MAX_DEFERS = 20


# -- GPU pinning of xdist workers (at import: before conftests can touch CUDA) -----------------
def visible_gpus(env=None) -> list[str]:
    """The GPUs a process may use, found without initialising CUDA: the
    CUDA_VISIBLE_DEVICES list if set, else one per /dev/nvidiaN."""
    env = os.environ if env is None else env
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return [g.strip() for g in cvd.split(",") if g.strip() and g.strip() != "-1"]
    try:
        n = sum(1 for f in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", f))
    except OSError:
        n = 0
    return [str(i) for i in range(n)]


def _project_uses_quack() -> bool:
    try:
        from quack.settings import find_config

        return find_config() is not None
    except Exception:  # noqa: BLE001
        return False


def _pin_worker_gpu() -> str | None:
    wid = os.environ.get("PYTEST_XDIST_WORKER")
    flag = os.environ.get("QUACK_PYTEST_GPU_PIN", "")
    if not wid or flag == "0" or os.environ.get("QUACK_PYTEST_GPU") is not None:
        return os.environ.get("QUACK_PYTEST_GPU")
    if flag != "1" and not _project_uses_quack():
        return None
    gpus = visible_gpus()
    if not gpus:
        return None
    m = re.search(r"(\d+)$", wid)
    idx = int(m.group(1)) if m else 0
    gpu = gpus[idx % len(gpus)]
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    os.environ["QUACK_PYTEST_GPU"] = gpu
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    os.environ["QUACK_PYTEST_GPU_SHARED"] = "1" if count > len(gpus) else "0"
    return gpu


_pinned_gpu = _pin_worker_gpu()


# -- options ----------------------------------------------------------------------------------
def pytest_addoption(parser):
    group = parser.getgroup("quack", "quack kernel cache")
    group.addoption("--async-compile", type=int, nargs="?", const=0, default=None, metavar="N",
                    dest="quack_async",
                    help="defer tests whose kernels miss the cache while N CPU workers compile "
                         "them; retry when ready (N default: one per CPU)")
    group.addoption("--quack-prebuilt", action="store_true", default=False,
                    help="fail any test whose kernel is not prebuilt (QUACK_MODE=prebuilt)")
    group.addoption("--quack-prewarm", action="store_true", default=False,
                    help="start compile workers at session start, not at the first miss")
    group.addoption("--quack-max-defers", type=int, default=MAX_DEFERS, metavar="K",
                    help=f"after K deferrals a test compiles synchronously (default {MAX_DEFERS})")


def _is_xdist_controller(config) -> bool:
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None)) \
        and getattr(config.option, "dist", "no") != "no"


def pytest_configure(config):
    async_n = config.getoption("quack_async", None)
    prebuilt = bool(config.getoption("quack_prebuilt", False)) or os.environ.get("QUACK_MODE") == "prebuilt"
    engaged = async_n is not None or prebuilt or config.getoption("quack_prewarm", False) \
        or _project_uses_quack()
    if not engaged:
        return
    if _is_xdist_controller(config):
        config.pluginmanager.register(_Controller(config, async_n is not None), _CONTROLLER)
        return
    runner = _Runner(config, async_n, prebuilt)
    config.pluginmanager.register(runner, _PLUGIN)
    if runner.deferring:
        config.pluginmanager.register(_PendingHooks(), "quack-pending-hooks")
        if runner.worker:
            config.pluginmanager.register(_worker_runtestloop_wrapper(runner), "quack-worker-drain")
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Controller(config, async_n is not None, local=runner),
                                      _CONTROLLER)


def pytest_unconfigure(config):
    runner = config.pluginmanager.get_plugin(_PLUGIN)
    if runner is not None:
        runner.close()


def _drop_frames(exc) -> None:
    """A deferred test's CompilePending is kept until its retry; its traceback would
    keep the test's frames alive, and with them every tensor the test had allocated
    (seen on the H200: 138 GiB held by deferred attempts, then CUDA out-of-memory)."""
    if exc is not None:
        exc.__traceback__ = None
        exc.__context__ = None
        exc.__cause__ = None


# -- detecting CompilePending in the phases -----------------------------------------------------
class _Deferred(pytest.skip.Exception):
    """Setup hit a pending compile: end setup (the body must not run on half-built
    fixtures). The attempt's reports are discarded."""


class _PendingHooks:
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
            raise _Deferred(f"deferred: {e}") from None

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
        from quack.compile.pool import suppress_pool

        with suppress_pool():
            return (yield)


def _is_cuda_oom(exc) -> bool:
    seen = 0
    while exc is not None and seen < 8:
        if type(exc).__name__ == "OutOfMemoryError" and "torch" in type(exc).__module__:
            return True
        msg = str(exc)
        if ("CUDA out of memory" in msg or "CUDA_ERROR_OUT_OF_MEMORY" in msg
                or "cudaErrorMemoryAllocation" in msg or "CUDA error: out of memory" in msg):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


class _GpuLock:
    """Readers (every test on a shared GPU) and one writer (an OOM retry): a gate
    flock gives the writer priority, then the writer waits for running tests."""

    def __init__(self, gpu: str):
        import tempfile

        base = os.path.join(tempfile.gettempdir(), f"quack-gpu-{os.getuid()}-{gpu}")
        self.gate = os.open(base + ".gate", os.O_RDWR | os.O_CREAT, 0o600)
        self.main = os.open(base + ".lock", os.O_RDWR | os.O_CREAT, 0o600)

    def shared(self):
        import fcntl

        fcntl.flock(self.gate, fcntl.LOCK_SH)
        fcntl.flock(self.gate, fcntl.LOCK_UN)
        fcntl.flock(self.main, fcntl.LOCK_SH)

    def exclusive(self):
        import fcntl

        fcntl.flock(self.gate, fcntl.LOCK_EX)
        fcntl.flock(self.main, fcntl.LOCK_UN)  # drop our own shared hold first
        fcntl.flock(self.main, fcntl.LOCK_EX)

    def release(self):
        import fcntl

        fcntl.flock(self.main, fcntl.LOCK_UN)
        fcntl.flock(self.gate, fcntl.LOCK_UN)


def _free_gpu_memory() -> None:
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - best effort
            pass


# -- the runner: one real outcome per test --------------------------------------------------------
class _Runner:
    """Runs test protocols in a test-running process (single-process pytest or an
    xdist worker): defer-and-retry on pending compiles, OOM retry, strict mode."""

    def __init__(self, config, async_n, prebuilt):
        self.config = config
        self.deferring = async_n is not None
        self.max_defers = max(0, int(config.getoption("quack_max_defers", MAX_DEFERS)))
        self.prebuilt = prebuilt
        self.worker = hasattr(config, "workerinput")
        self.pool = None
        self.strict_settings = None
        self.defers = 0
        self.forced_sync = 0
        self.oom_retried: list[str] = []
        self.strict_fails: list[str] = []
        self.attempts: dict[str, int] = {}
        self.deferred: list = []  # xdist: [(item, pending)]
        self.predicted = None
        self.interactor = None
        self.setup_errors: list[str] = []
        self.t_first_test = None
        self.scope_root = None
        gpu = os.environ.get("QUACK_PYTEST_GPU")
        self.gpu_lock = _GpuLock(gpu) if gpu and os.environ.get("QUACK_PYTEST_GPU_SHARED") == "1" else None
        self.gpu_name = gpu or "all"
        if prebuilt:
            self._install_strict()
        if self.deferring:
            from quack.compile import pool as _pool

            n = async_n or 0
            workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
            if n <= 0:
                try:
                    from quack import settings

                    n = settings.get().compile_jobs
                except Exception:  # noqa: BLE001
                    n = 0
                n = n or (os.cpu_count() or 1)
            jobs = max(1, n // workers) if self.worker else max(1, n)
            # Deferral covers misses in the session's cache; a test that installs its
            # own Settings (a private cache) waits for its compiles instead: its
            # tmp_path, and so its cache, would be new on every retry.
            try:
                from quack import settings

                self.scope_root = str(settings.get().cache_dir)
            except Exception:  # noqa: BLE001
                self.scope_root = None
            self.pool = _pool.configure_default(jobs)
            if config.getoption("quack_prewarm", False):
                self.pool.prewarm()

    def close(self):
        pass  # the pool's atexit hook kills workers without waiting

    # strict mode -----------------------------------------------------------------------------
    def _install_strict(self):
        from quack import settings
        from quack.errors import SettingsError

        try:
            self.strict_settings = settings.resolve({"mode": "prebuilt"})
        except SettingsError as e:
            raise pytest.UsageError(f"quack: {e}") from None
        settings.set_current(self.strict_settings)

    def _ensure_strict(self):
        from quack import settings

        if settings._current is None:
            settings.set_current(self.strict_settings)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        rep = yield
        if call.excinfo is not None and _is_cuda_oom(call.excinfo.value):
            item._quack_oom = True
        if self.prebuilt and call.when == "call" and rep.passed:
            from quack.compile import pool as _pool

            misses = [e for e, s in (_pool._miss_log.get() or []) if s is self.strict_settings]
            if misses:
                self.strict_fails.append(item.nodeid)
                rep.outcome = "failed"
                rep.longrepr = ("quack --quack-prebuilt: the test asked for a kernel that is not "
                                "prebuilt (and caught the error):\n" + str(misses[0]))
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

        from quack.compile import pool as _pool

        self._fix_setupstate(item)
        self.predicted = nextitem
        item._quack_pending = None
        item._quack_oom = False
        log = []
        miss_token = _pool._miss_log.set([]) if self.prebuilt else None
        if self.prebuilt:
            self._ensure_strict()
        try:
            if self.deferring and not sync:
                with _pool.pool_scope(self.pool, root=self.scope_root):
                    token = _pool._pending_log.set(log)  # inside: pool_scope masks the log
                    try:
                        reports = runtestprotocol(item, nextitem=nextitem, log=False)
                    finally:
                        _pool._pending_log.reset(token)
            else:
                with _pool.suppress_pool():
                    reports = runtestprotocol(item, nextitem=nextitem, log=False)
        finally:
            if miss_token is not None:
                _pool._miss_log.reset(miss_token)
        pending = item._quack_pending or (log[0] if log and self.deferring and not sync else None)
        item._quack_pending = None
        for exc in (pending, *log):
            _drop_frames(exc)
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
        try:
            pending, reports = self._protocol(item, nextitem, sync)
            if pending is None and getattr(item, "_quack_oom", False):
                pending, reports = self._oom_retry(item, nextitem, sync, reports)
        finally:
            if self.gpu_lock is not None:
                self.gpu_lock.release()
        if pending is not None:
            self.attempts[item.nodeid] = n + 1
            self.defers += 1
            bad = [r for r in reports if r.when == "teardown" and r.failed]
            if bad:
                item._quack_teardown_error = bad[0]
            return pending
        bad = getattr(item, "_quack_teardown_error", None)
        if bad is not None and reports and reports[-1].when == "teardown" and reports[-1].passed:
            reports[-1] = bad  # a deferred attempt's teardown failed: that is part of the outcome
        self._log(item, reports)
        return None

    def _oom_retry(self, item, nextitem, sync, reports):
        _free_gpu_memory()
        lock = self.gpu_lock or _GpuLock(self.gpu_name)
        lock.exclusive()
        try:
            _free_gpu_memory()
            self.predicted = item  # the failed attempt tore down to nextitem: same chain
            self._fix_setupstate(item)
            pending, reports = self._protocol(item, nextitem, sync)
        finally:
            lock.release()
            if self.gpu_lock is not None:
                self.gpu_lock.shared()
        self.oom_retried.append(item.nodeid)
        for r in reports:
            r.sections.append(("quack", "retried once after CUDA out-of-memory "
                                        "(gc + torch.cuda.empty_cache, GPU held exclusively)"))
            r.user_properties.append(("quack_oom_retry", True))
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
        from quack.compile import pool as _pool

        pool = getattr(pending, "pool", None) or self.pool
        return pool.state(pending.key, getattr(pending, "root", None)) != _pool.PENDING

    # single process: our own loop ----------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session):
        if self.worker or not self.deferring:
            return None
        if session.testsfailed and not session.config.option.continue_on_collection_errors:
            raise session.Interrupted(f"{session.testsfailed} error{'s' if session.testsfailed != 1 else ''}"
                                      " during collection")
        if session.config.option.collectonly:
            return True
        from collections import deque

        queue = deque((item, None) for item in session.items)
        blocked = 0
        gen = self.pool.generation
        while queue:
            item, pending = queue.popleft()
            if pending is not None and not self._ready(pending) \
                    and self.attempts.get(item.nodeid, 0) < self.max_defers:
                queue.append((item, pending))
                blocked += 1
                if blocked >= len(queue):
                    gen = self.pool.wait_change(gen, 1.0)
                    blocked = 0
                continue
            blocked = 0
            gen = self.pool.generation
            nextitem = queue[0][0] if queue else None
            pending = self._run_item(item, nextitem)
            if pending is not None:
                queue.append((item, pending))
                continue
            if session.shouldfail:
                raise session.Failed(session.shouldfail)
            if session.shouldstop:
                raise session.Interrupted(session.shouldstop)
        return True

    # the protocol (xdist workers; single process without deferral) ---------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if self.deferred:
            self._drain(nextitem=item)
        pending = self._run_item(item, nextitem)
        if pending is not None:
            self.deferred.append((item, pending))
        return True

    def _drain(self, nextitem, force=False):
        todo, self.deferred = self.deferred, []
        for item, pending in todo:
            if force or self._ready(pending) or self.attempts.get(item.nodeid, 0) >= self.max_defers:
                p = self._run_item(item, nextitem)
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
        gen = self.pool.generation if self.pool else 0
        while self.deferred:
            before = [(i.nodeid, self.attempts.get(i.nodeid, 0)) for i, _ in self.deferred]
            self._drain(nextitem=None)
            after = [(i.nodeid, self.attempts.get(i.nodeid, 0)) for i, _ in self.deferred]
            if self.deferred and after == before:
                gen = self.pool.wait_change(gen, 1.0)
            else:
                gen = self.pool.generation

    # bookkeeping ----------------------------------------------------------------------------------
    def summary(self) -> dict:
        st = self.pool.stats() if self.pool is not None else {}
        return {"submitted": st.get("submitted", 0), "failed": st.get("failed", 0),
                "compiled": st.get("compiled", 0), "compile_s": st.get("compile_s", 0.0),
                "timeouts": st.get("timeouts", 0), "worker_deaths": st.get("worker_deaths", 0),
                "awaited_external": st.get("awaited_external", 0),
                "errors": list(st.get("errors", {}).values())[:5],
                "deferrals": self.defers, "forced_sync": self.forced_sync,
                "oom_retried": list(self.oom_retried), "setup_errors": list(self.setup_errors),
                "t_first_test": self.t_first_test, "async": self.deferring}

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session):
        if self.worker:
            session.config.workeroutput["quack"] = self.summary()


def _worker_runtestloop_wrapper(runner):
    """Wraps xdist's own runtestloop (a separate object: the runner's loop hook is a
    different kind of implementation)."""

    class _W:
        @pytest.hookimpl(wrapper=True)
        def pytest_runtestloop(self, session):
            res = yield
            runner.drain_all(session)
            return res

    return _W()


# -- the controller: integrity check and summary (single process or xdist controller) -------------
class _Controller:
    def __init__(self, config, async_on, local=None):
        self.config = config
        self.async_on = async_on
        self.local = local
        self.collected: set[str] = set()
        self.reported: set[str] = set()
        self.worker_summaries: list[dict] = []
        self.t_start = time.time()

    def pytest_collection_finish(self, session):
        if self.local is not None:
            self.collected.update(i.nodeid for i in session.items)

    def pytest_xdist_node_collection_finished(self, node, ids):
        self.collected.update(ids)

    def pytest_testnodedown(self, node, error):
        out = getattr(node, "workeroutput", None) or {}
        if "quack" in out:
            self.worker_summaries.append(out["quack"])

    def pytest_runtest_logreport(self, report):
        self.reported.add(report.nodeid)

    def _total(self) -> dict:
        parts = list(self.worker_summaries)
        if self.local is not None:
            parts.append(self.local.summary())
        tot = {"submitted": 0, "failed": 0, "compiled": 0, "compile_s": 0.0, "deferrals": 0,
               "forced_sync": 0, "timeouts": 0, "worker_deaths": 0, "awaited_external": 0}
        oom, errors, setup_errors, firsts = [], [], [], []
        for p in parts:
            for k in tot:
                tot[k] += p.get(k, 0)
            oom += p.get("oom_retried", [])
            errors += p.get("errors", [])
            setup_errors += p.get("setup_errors", [])
            if p.get("t_first_test"):
                firsts.append(p["t_first_test"])
        tot.update(oom_retried=oom, errors=errors, setup_errors=setup_errors,
                   first_test_s=(min(firsts) - self.t_start) if firsts else None)
        return tot

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        config = session.config
        self.integrity_missing = []
        if getattr(config.option, "collectonly", False) or exitstatus not in (0, 1):
            return
        if session.shouldstop or session.shouldfail:
            return
        missing = sorted(self.collected - self.reported)
        if missing:
            self.integrity_missing = missing
            session.exitstatus = 1
        if self._total()["setup_errors"]:
            session.exitstatus = 1

    def pytest_terminal_summary(self, terminalreporter):
        tr = terminalreporter
        tot = self._total()
        missing = getattr(self, "integrity_missing", [])
        if missing:
            tr.write_line(f"quack: INTEGRITY ERROR: {len(missing)} collected test(s) produced no report "
                          f"(lost with a crashed worker?):", red=True, bold=True)
            for n in missing[:20]:
                tr.write_line(f"  {n}", red=True)
        for e in tot["setup_errors"]:
            tr.write_line(f"quack: {e}", red=True)
        if not (self.async_on or tot["oom_retried"] or tot["submitted"]):
            return
        line = (f"quack: {tot['submitted']} keys submitted ({tot['compiled']} compiled, "
                f"{tot['compile_s']:.1f} s compile), {tot['failed']} failed, "
                f"{tot['deferrals']} deferrals")
        extra = []
        if tot["forced_sync"]:
            extra.append(f"{tot['forced_sync']} synchronous after {MAX_DEFERS} deferrals")
        if tot["awaited_external"]:
            extra.append(f"{tot['awaited_external']} awaited from other processes")
        if tot["timeouts"]:
            extra.append(f"{tot['timeouts']} timed out")
        if tot["worker_deaths"]:
            extra.append(f"{tot['worker_deaths']} worker deaths")
        if tot["oom_retried"]:
            extra.append(f"{len(tot['oom_retried'])} retried after CUDA OOM")
        if extra:
            line += ", " + ", ".join(extra)
        bad = tot["failed"] or tot["oom_retried"]
        tr.write_line(line, yellow=bool(bad) and not tot["failed"], red=bool(tot["failed"]))
        for n in tot["oom_retried"][:20]:
            tr.write_line(f"  CUDA OOM retry: {n}", yellow=True)
        for e in tot["errors"][:5]:
            tr.write_line("  compile error: " + e.splitlines()[0][:300] if e else "", red=True)
