"""quack's pytest plugin (registered through the pytest11 entry point; no conftest line).

Options
  --async-compile[=N]  a test whose kernel misses the cache is deferred while its
                       compile runs in N CPU workers (default: one per CPU, split
                       over xdist workers); other tests run meanwhile and the test is
                       retried once its key is done. A deferred attempt's reports are
                       discarded: each test reports exactly one real outcome.
  --quack-prebuilt     strict mode (also QUACK_MODE=prebuilt or [runtime] mode =
                       "prebuilt" in quack.toml): any kernel miss fails the test
                       with the KernelNotPrebuilt message, even if the test then
                       caught it, skipped or xfailed.
  --quack-prewarm      start the compile workers at session start (their imports
                       overlap collection) instead of at the first miss.
  --quack-max-defers=K after K deferrals a test's next attempt compiles synchronously.

Deferral rule: quack/testing/deferral.py. Strict mode rule: quack/testing/strict.py.

Engaged when any quack option is given, the settings' mode is prebuilt, or a
quack.toml is found from the rootdir up (the project uses quack). Engaged, it also
  * pins each xdist worker to one GPU, round-robin over the visible GPUs
    (CUDA_VISIBLE_DEVICES; QUACK_PYTEST_GPU_PIN=0 / [pytest] gpu_pin = false turns
    it off). The pin is made in pytest_load_initial_conftests, before any conftest
    can initialise CUDA; importing the plugin changes nothing;
  * retries a test that failed with CUDA out-of-memory once, after gc.collect()
    and torch.cuda.empty_cache(), holding the GPU exclusively (a GPU-wide file
    lock that every worker sharing the GPU takes shared around each test);
  * checks at session end that every collected, non-deselected test reported;
  * prints one summary line (keys submitted, failed, deferrals, compile seconds).
Nothing is started until the first miss, and nothing waits for idle workers at exit.

This module holds the hooks only: deferral.py (pending detection, the pool),
strict.py, oom.py, gpus.py (pinning, the GPU lock), runner.py (one real
outcome per test), summary.py (integrity check and summary line).
"""

from __future__ import annotations

import os

import pytest

from quack.testing import deferral, gpus, strict
from quack.testing.deferral import MAX_DEFERS
from quack.testing.runner import Runner
from quack.testing.summary import Controller

_PLUGIN = "quack-runner"
_CONTROLLER = "quack-controller"


def _project_uses_quack() -> bool:
    try:
        from quack.settings import find_config

        return find_config() is not None
    except Exception:  # noqa: BLE001
        return False


def _gpu_pin_setting() -> bool | None:
    from quack import settings
    from quack.errors import SettingsError

    try:
        return settings.resolve().pytest_gpu_pin
    except SettingsError:
        return None


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    # Before any conftest is imported (one may initialise CUDA): pin an xdist
    # worker to its GPU. Not at import: merely installing quack must not change
    # the environment of every pytest run.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        gpus.pin_worker(os.environ, enabled=_gpu_pin_setting(), project_uses_quack=_project_uses_quack())


# -- options ----------------------------------------------------------------------------------
def pytest_addoption(parser):
    group = parser.getgroup("quack", "quack kernel cache")
    group.addoption(
        "--async-compile",
        type=int,
        nargs="?",
        const=0,
        default=None,
        metavar="N",
        dest="quack_async",
        help="defer tests whose kernels miss the cache while N CPU workers compile "
        "them; retry when ready (N default: one per CPU)",
    )
    group.addoption(
        "--quack-prebuilt",
        action="store_true",
        default=False,
        help="fail any test whose kernel is not prebuilt (QUACK_MODE=prebuilt)",
    )
    group.addoption(
        "--quack-prewarm",
        action="store_true",
        default=False,
        help="start compile workers at session start, not at the first miss",
    )
    group.addoption(
        "--quack-max-defers",
        type=int,
        default=MAX_DEFERS,
        metavar="K",
        help=f"after K deferrals a test compiles synchronously (default {MAX_DEFERS})",
    )


def _is_xdist_controller(config) -> bool:
    return (
        not hasattr(config, "workerinput")
        and bool(getattr(config.option, "numprocesses", None))
        and getattr(config.option, "dist", "no") != "no"
    )


def pytest_configure(config):
    async_n = config.getoption("quack_async", None)
    prebuilt = strict.requested(bool(config.getoption("quack_prebuilt", False)))
    engaged = (
        async_n is not None or prebuilt or config.getoption("quack_prewarm", False) or _project_uses_quack()
    )
    if not engaged:
        return
    if _is_xdist_controller(config):
        config.pluginmanager.register(Controller(config, async_n is not None), _CONTROLLER)
        return
    runner = Runner(config, async_n, prebuilt)
    config.pluginmanager.register(runner, _PLUGIN)
    if runner.deferring:
        config.pluginmanager.register(deferral.PendingHooks(), "quack-pending-hooks")
        if runner.worker:
            config.pluginmanager.register(deferral.worker_drain_hook(runner), "quack-worker-drain")
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(Controller(config, async_n is not None, local=runner), _CONTROLLER)


def pytest_unconfigure(config):
    runner = config.pluginmanager.get_plugin(_PLUGIN)
    if runner is not None:
        runner.close()
