"""Shared fixtures. Every test that touches a cache gets its own under tmp_path."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

import pytest
import xdist_units
from xdist_units import gpu_file

from quack import settings

TESTS = Path(__file__).parent
ROOT = TESTS.parent
# Compile workers and fresh subprocesses import the toy kernels from here.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")) if p
)
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


requires_gpu = pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (README command 2): one worker per CPU, at least four. Most of the CPU
    suite's time is spent waiting on the processes it starts (builds, Ray actors, servers,
    fresh interpreters): on 2 cores four workers ran it in 511 s wall with the machine
    shared against 1044 s serial (issue 25). The tests that launch kernels do not spread
    over those workers: they run in one xdist group per GPU (below)."""
    return max(4, os.cpu_count() or 1)


#: The skip reason (and marker) of a test that launches kernels.
GPU_REASON = "needs a CUDA GPU"


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """On the H200 (16 cores, one GPU) 16 workers that each took GPU tests failed 5 tests
    in the first 20 % of the suite; the suite passed there in one process. So the tests of
    the GPU files run as one unit per visible GPU (one worker runs a unit's tests one at a
    time, as that run did) while every other test spreads over all workers, except those
    sharing an expensive fixture (one unit each), costliest first: tests/xdist_units.py. (xdist's
    `loadgroup` would do this from marks, but with pytest 9.2 its node-id suffix is lost
    and the marks are ignored.) Only for xdist's default mode: an explicit `--dist` wins."""
    if config.getvalue("dist") != "load":
        return None
    from quack.testing.gpus import visible_gpus

    return xdist_units.make_scheduler(config, log, len(visible_gpus()))


def pytest_runtest_setup(item):
    """The latency-bound tests (Ray) first at normal priority, the others after: see
    tests/xdist_units.py's LATENCY_BOUND."""
    xdist_units.lower_priority_once(item.nodeid)


def pytest_collection_modifyitems(config, items):
    """Keeps the file-name contract above true: a test that needs a GPU (the `gpu` mark or
    the skip reason GPU_REASON) outside a GPU file would share the GPU with the GPU units.
    And the shared-fixture units' names: a renamed test would leave its unit silently."""
    defined = {
        it.nodeid.split("::", 1)[0]: set(vars(it.module)) for it in items if getattr(it, "module", None)
    }
    unmatched = xdist_units.unmatched_prefixes(defined)
    if unmatched:
        raise pytest.UsageError(
            "tests/xdist_units.py's SHARED_FIXTURE_UNITS names tests their files do not define "
            f"(renamed? its unit would fall apart): {unmatched}"
        )
    # the PTX batch (_fixtures.session_ptx) is compiled once a session per worker: a test
    # using it outside the "ptx" unit would have a second worker compile it all again
    loose = [
        it.nodeid
        for it in items
        if "session_ptx" in getattr(it, "fixturenames", ()) and xdist_units.shared_unit(it.nodeid) != "ptx"
    ]
    if loose:
        raise pytest.UsageError(
            f'tests using _fixtures.session_ptx must be in tests/xdist_units.py\'s "ptx" unit: {loose}'
        )
    stray = [
        it.nodeid
        for it in items
        if not gpu_file(it.nodeid)
        and (
            it.get_closest_marker("gpu") is not None
            or any(m.kwargs.get("reason") == GPU_REASON for m in it.iter_markers("skipif"))
        )
    ]
    if stray:
        raise pytest.UsageError(
            "tests that need a GPU must live in a file named *_gpu.py or test_gpu_*.py "
            f"(tests/conftest.py, the xdist GPU units): {stray}"
        )


def pytest_collection_finish(session):
    """Start the verify-all test's build of every shipped manifest in the background, when
    this run is one process on a GPU machine and will run that test (tests/kernels/_fixtures.py
    says why)."""
    if os.environ.get("PYTEST_XDIST_WORKER") or session.config.getoption("collectonly"):
        return
    if not any(it.nodeid.endswith(VERIFY_ALL_SUFFIX) for it in session.items) or not has_gpu():
        return
    from _fixtures import session_kernel_cache, start_shipped_build

    start_shipped_build(session_kernel_cache())


class _StopShippedBuilds:
    """Ends a background build no test waited for (a plugin object: gpupin, imported below,
    owns this module's pytest_sessionfinish)."""

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session):
        mod = sys.modules.get("_fixtures")
        if mod is not None:
            mod.stop_shipped_builds()


def pytest_configure(config):
    config.pluginmanager.register(_StopShippedBuilds(), "quack-tests-stop-shipped-builds")
    compile_sources()
    rewrite_test_modules(config)


#: The project's own source trees (the editable install runs them from here).
SOURCE_TREES = ("quack", "quack_build", "kernels", "tests")


def compile_sources() -> None:
    """Write the bytecode of the project's own modules once, before the workers start, when
    this interpreter writes none (PYTHONDONTWRITEBYTECODE, set on the 2-core CI machine).
    An editable install's modules are otherwise compiled from source in every process the
    suite starts (about 1,600: CLI runs, fresh loaders, compile workers, Ray actors), each
    paying 0.1-0.3 CPU-s for it (cProfile of `quack cache stats`: 0.38 s of 1.7 s in
    `compile`); installed packages have their bytecode from pip already. Timestamp-checked
    .pyc files (Python's default) are never used for an edited source. Only the controller:
    xdist workers start after this."""
    if not sys.dont_write_bytecode or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import compileall

    for name in SOURCE_TREES:
        try:
            compileall.compile_dir(str(ROOT / name), quiet=2)
        except OSError:  # a read-only checkout: the processes compile as before
            pass


def rewrite_test_modules(config) -> None:
    """Write pytest's assertion-rewritten bytecode of the test modules once, in the
    controller, before the xdist workers start, when this interpreter writes no bytecode.
    pytest reads a cached rewrite even then, but writes none: every worker rewrote all
    ~90 test modules itself at collection (10.2 CPU-s a collection here against 4.3 with
    the rewrites cached; four workers on the 2-core CI machine). This uses pytest's own
    rewrite and writer (``_pytest.assertion.rewrite``, pytest 8-9), so the bytes are
    those a worker writes when it may; anything unexpected (another pytest, a read-only
    checkout) leaves the workers rewriting as before."""
    if not sys.dont_write_bytecode or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if config.getoption("assertmode", "rewrite") != "rewrite" or not config.getoption("numprocesses", None):
        return
    try:
        from _pytest.assertion import rewrite as rw

        state = config.stash[rw.assertstate_key]
        for fn in sorted(ROOT.joinpath("tests").rglob("*.py")):
            if not (fn.name.startswith("test_") or fn.name == "conftest.py"):
                continue
            pyc = rw.get_cache_dir(fn) / (fn.name[:-3] + rw.PYC_TAIL)
            if pyc.exists() and pyc.stat().st_mtime >= fn.stat().st_mtime:
                continue  # written since the last edit (a worker checks its mtime and size)
            source_hash, co = rw._rewrite_test(fn, config)
            if rw.try_makedirs(pyc.parent):
                rw._write_pyc(state, co, source_hash, pyc)
    except Exception:  # noqa: BLE001 - an optimization only: the workers rewrite instead
        return


#: tests/kernels/_fixtures.py's VERIFY_ALL, as a node-id suffix (the rootdir may differ)
VERIFY_ALL_SUFFIX = "test_reference_hooks_gpu.py::test_verify_run_passes_over_every_shipped_manifest"


@pytest.fixture(autouse=True)
def _no_inherited_terminal_width(monkeypatch):
    """The CLI's tables are as wide as COLUMNS says (160 without it and without a tty,
    quack_build/cli/context.py), and the tests read their rows. An xdist worker runs with
    COLUMNS=80: rows wrapped and seven CLI tests failed under `-n`; a terminal that
    exports COLUMNS did the same to a serial run. Every test (and every process it starts)
    sees no inherited width."""
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.fixture
def log_records():
    """``with log_records("quack", logging.INFO) as records:`` the records that logger (and
    its children) emits inside the block. pytest's own log capture (caplog) is off for this
    suite (``-p no:logging``, pyproject.toml): it attaches its handlers to every
    non-propagating logger at each of a test's six phases, and with torch's several hundred
    loggers that walk took seconds of the GPU tier's ~2,500 tests."""

    @contextlib.contextmanager
    def capture(name: str, level: int):
        logger = logging.getLogger(name)
        records: list[logging.LogRecord] = []
        handler = logging.Handler(level)
        handler.emit = records.append  # type: ignore[method-assign]
        old = logger.level
        logger.setLevel(level)
        logger.addHandler(handler)
        try:
            yield records
        finally:
            logger.removeHandler(handler)
            logger.setLevel(old)

    return capture


@pytest.fixture
def cache_dir(tmp_path) -> Path:
    d = tmp_path / "cache"
    return d


@pytest.fixture
def quack_settings(cache_dir):
    """Settings pointing at a private cache, arch sm_90a, jit mode; restored after."""
    saved = settings.installed()
    s = settings.resolve({"cache_dir": str(cache_dir), "arch": "sm_90a", "mode": "jit"})
    settings.set_current(s)
    yield s
    settings.set_current(saved)


# What pytest-xdist tells one of its workers. A pytest this suite starts in a subprocess
# is a run of its own, not a worker of ours: with these inherited, its controller pinned
# itself to one GPU as if it were our worker (tests/test_plugin.py's round-robin check
# then saw one GPU where it set two) and split its compile pool by our worker count.
XDIST_WORKER_ENV = ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID")


# pytester restores sys.modules after each test, dropping what the test imported first. The
# compile pool is process-wide: had its worker module been first imported inside such a
# test, the next import made a second copy and the pool's dispatcher could no longer pickle
# the ``worker_build`` it holds (under xdist a later test's compile then hung). Imported
# here, before any snapshot, it stays one module.
import quack.compile.pool  # noqa: E402,F401


@pytest.fixture
def pytester(pytester, monkeypatch):
    """pytest's own fixture, minus this run's xdist worker identity (see above)."""
    for name in XDIST_WORKER_ENV:
        monkeypatch.delenv(name, raising=False)
    return pytester


def use_settings(**overrides):
    """Install settings with overrides (on top of the current ones' cache dir)."""
    cur = settings.get()
    base = {"cache_dir": str(cur.cache_dir), "arch": cur.arch, "mode": cur.mode}
    base.update(overrides)
    s = settings.resolve(base)
    settings.set_current(s)
    return s


sys.path.insert(0, str(TESTS))


# Issue 16: per-worker GPU records and the session-end pinning check (tests/gpupin.py).
from gpupin import pytest_sessionfinish, pytest_terminal_summary, pytest_testnodedown  # noqa: E402,F401

# --- the remote-cache suites' servers (tests/remote_services.py): one of each a module ----


@pytest.fixture(scope="module")
def redis_srv(tmp_path_factory):
    """A redis-server of the module's own on a free loopback port, stopped after it."""
    from remote_services import redis_server

    with redis_server(tmp_path_factory.mktemp("redis")) as srv:
        yield srv


@pytest.fixture(scope="module")
def s3_url():
    """A moto S3 server of the module's own: its endpoint URL."""
    from remote_services import moto_s3

    with moto_s3() as url:
        yield url


@pytest.fixture
def fresh_remote_state():
    """A remote switched off by an earlier test (unreachable: off for the process) is on
    again: each remote test starts as a fresh process would."""
    from quack.remote import tier

    tier.reset_offline_for_tests()
    yield
    tier.reset_offline_for_tests()
