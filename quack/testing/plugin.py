"""quack's pytest plugin (registered through the pytest11 entry point; no conftest line).

Options
  --async-compile[=N]  a test whose kernel misses the cache is deferred while its
                       compile runs in N CPU workers (default and most: one per
                       CPU, split over xdist workers; a bare flag takes the next
                       argument as N: put paths first); other tests run meanwhile and the test is
                       retried once its key is done. A deferred attempt's reports are
                       discarded: each test reports exactly one real outcome.
  --quack-prebuilt     strict mode (also QUACK_MODE=prebuilt or [runtime] mode =
                       "prebuilt" in quack.toml): any kernel miss fails the test
                       with the KernelNotPrebuilt message, even if the test then
                       caught it, skipped or xfailed; a miss while collecting fails
                       the collector. The processes a test starts are strict on
                       the session's cache too (QUACK_PYTEST_PREBUILT_CACHE).
  --quack-prewarm      start the compile workers at session start (their imports
                       overlap collection) instead of at the first miss: the
                       --async-compile workers, else the one worker a miss waits
                       on; none in strict (prebuilt) mode. A worker started
                       before collection imports kernel modules through the
                       caller's sys.path as it is at each miss.
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
Nothing is started until the first miss (but with --quack-prewarm), and nothing waits for idle workers at exit.

This module holds the hooks only: deferral.py (pending detection, the pool),
strict.py, oom.py, gpus.py (pinning, the GPU lock), runner.py (one real
outcome per test), summary.py (integrity check and summary line).
"""

from __future__ import annotations

import argparse
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


@pytest.hookimpl(tryfirst=True, wrapper=True)
def pytest_load_initial_conftests(early_config, parser, args):
    # Before any conftest is imported (one may initialise CUDA): pin an xdist
    # worker to its GPU. Not at import: merely installing quack must not change
    # the environment of every pytest run.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        gpus.pin_worker(os.environ, enabled=_gpu_pin_setting(), project_uses_quack=_project_uses_quack())
    # Strict mode reaches the initial conftests (imported before pytest_configure)
    # and every process the session starts (strict.export_cache, until unconfigure).
    # The conftests' misses are recorded: the runner fails the session's collection
    # on one they caught.
    cache = _strict_cache(getattr(early_config.known_args_namespace, "quack_prebuilt", False))
    if cache is None:
        return (yield)
    strict.export_cache(early_config, cache)
    with strict.recording_early(early_config):
        return (yield)


def _strict_cache(option: bool):
    """The session's cache directory if strict mode is on, else None; None too while the
    settings do not resolve (pytest_configure then stops the session on them)."""
    from quack import settings
    from quack.errors import SettingsError

    try:
        s = settings.resolve()
    except SettingsError:
        return None
    return s.cache_dir if option or s.mode == "prebuilt" else None


# -- options ----------------------------------------------------------------------------------
def _async_workers(value: str) -> int:
    """--async-compile's N. The value is optional, so a bare flag before a test path
    took the path as N (`pytest --async-compile tests`: "invalid int value: 'tests'")."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of compile workers, got {value!r}: write --async-compile=N "
            "(N >= 0, 0 = one per CPU), or put the test paths before a bare --async-compile"
        ) from None
    if n < 0:
        raise argparse.ArgumentTypeError(
            f"expected a number of compile workers >= 0 (0 = one per CPU), got {n}: write --async-compile=N"
        )
    return n


def _max_defers(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:  # a negative K was silently 0 (every test compiled synchronously)
        raise argparse.ArgumentTypeError(
            f"expected an integer >= 0 (the deferrals before a test compiles synchronously; "
            f"default {MAX_DEFERS}), got {value!r}: write --quack-max-defers=K"
        )
    return n


def pytest_addoption(parser):
    group = parser.getgroup("quack", "quack kernel cache")
    group.addoption(
        "--async-compile",
        type=_async_workers,
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
        help="start compile workers at session start, not at the first miss (the "
        "--async-compile workers, else one; none with --quack-prebuilt)",
    )
    group.addoption(
        "--quack-max-defers",
        type=_max_defers,
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


def _check_settings() -> None:
    """Stop the session once on quack settings that do not resolve (QUACK_MODE=bogus,
    a malformed quack.toml): without a quack option the plugin stayed out of the way
    and every test that called a kernel failed on the same SettingsError instead."""
    from quack import settings
    from quack.errors import SettingsError

    try:
        settings.resolve()
    except SettingsError as e:
        raise pytest.UsageError(f"quack: {e} (fix or unset it: every kernel call would fail on it)") from None


def pytest_configure(config):
    _check_settings()
    async_n = config.getoption("quack_async", None)
    asked, async_n = async_n, deferral.cap_workers(async_n)
    prebuilt = strict.requested(bool(config.getoption("quack_prebuilt", False)))
    engaged = (
        async_n is not None or prebuilt or config.getoption("quack_prewarm", False) or _project_uses_quack()
    )
    if not engaged:
        return
    cache = _strict_cache(True) if prebuilt else None
    if cache is not None:  # for the processes the tests start (xdist's workers too)
        strict.export_cache(config, cache)
    capped = f"quack: --async-compile={asked} capped at {async_n} compile workers (the CPU count)"
    note = capped if asked != async_n else None
    if _is_xdist_controller(config):
        config.pluginmanager.register(Controller(config, async_n is not None, note=note), _CONTROLLER)
        return
    runner = Runner(config, async_n, prebuilt)
    config.pluginmanager.register(runner, _PLUGIN)
    if runner.deferring:
        config.pluginmanager.register(deferral.PendingHooks(), "quack-pending-hooks")
        if runner.worker:
            config.pluginmanager.register(deferral.worker_drain_hook(runner), "quack-worker-drain")
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(
            Controller(config, async_n is not None, local=runner, note=note), _CONTROLLER
        )


def pytest_unconfigure(config):
    runner = config.pluginmanager.get_plugin(_PLUGIN)
    if runner is not None:
        runner.close()
    strict.restore_cache(config)
