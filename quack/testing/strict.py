"""Strict (prebuilt) mode: any kernel miss fails the test with the
KernelNotPrebuilt message, even if the test caught the error, skipped or xfailed.

On with ``--quack-prebuilt``, or when the settings say ``mode = "prebuilt"``
(QUACK_MODE, or ``[runtime] mode`` in quack.toml). The plugin installs the
process's *default* settings with mode=prebuilt and re-installs them whenever a
test leaves none installed. A test that installs its own Settings (a private
tmp cache in jit mode, as the project's cache tests do) runs under those.

The processes a test starts: the plugin exports QUACK_PYTEST_PREBUILT_CACHE (the
session's cache directory) for the session, restored at its end, so a child that uses
that cache (a distributed rank, a spawned worker, ``python -c``) or sets none raises
KernelNotPrebuilt instead of compiling on demand, and an xdist worker starts with it;
a child the test gave a private cache resolves its own mode, as in this process. A
child's miss is its own process's error: the test sees it as the child's failure (its
exit status, its stderr with the manifest entry)."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import pytest

PREFIX = "quack --quack-prebuilt: the test asked for a kernel that is not prebuilt (and caught the error):\n"
# A test that met a miss and then skipped or xfailed (pytest.skip in an `except
# KernelNotPrebuilt`, an xfail mark): reported as such, strict mode was escaped.
ESCAPED = "quack --quack-prebuilt: the test asked for a kernel that is not prebuilt and was {how}:\n"

_SAVED_ENV = pytest.StashKey[tuple]()  # (QUACK_PYTEST_PREBUILT_CACHE before the session, or None)


def requested(option: bool) -> bool:
    """--quack-prebuilt, or the resolved settings' mode (environment or quack.toml).
    Settings that do not resolve stopped the session already (plugin._check_settings)."""
    if option:
        return True
    from quack import settings
    from quack.errors import SettingsError

    try:
        return settings.resolve().mode == "prebuilt"
    except SettingsError:
        return False


def export_cache(config, cache_dir) -> None:
    """Until ``restore_cache``, every process this one starts (a test's child: a
    distributed rank, a spawned worker, ``python -c``; xdist's workers) is strict on the
    session's cache: QUACK_PYTEST_PREBUILT_CACHE names it, and a process whose cache it is
    (or that sets none) resolves prebuilt mode (quack.settings.sources). Only
    ``pytest_configure`` installed the prebuilt settings, in this process: a child that
    called a kernel compiled it on demand and the test passed. Not QUACK_MODE=prebuilt:
    that would also refuse the compiles of a child the test gave a private cache, in
    jit mode as it was (the suite's own tests start many). Idempotent (called before
    the initial conftests load, then at configure)."""
    from quack.settings import PREBUILT_CACHE_ENV

    if _SAVED_ENV not in config.stash:
        config.stash[_SAVED_ENV] = (os.environ.get(PREBUILT_CACHE_ENV),)
    os.environ[PREBUILT_CACHE_ENV] = os.path.realpath(cache_dir)


def restore_cache(config) -> None:
    """Put the environment back as it was before ``export_cache``."""
    from quack.settings import PREBUILT_CACHE_ENV

    saved = config.stash.get(_SAVED_ENV, None)
    if saved is None:
        return
    del config.stash[_SAVED_ENV]
    (old,) = saved
    if old is None:
        os.environ.pop(PREBUILT_CACHE_ENV, None)
    else:
        os.environ[PREBUILT_CACHE_ENV] = old


class StrictMode:
    def __init__(self) -> None:
        from quack import settings
        from quack.errors import SettingsError

        try:
            self.settings = settings.resolve({"mode": "prebuilt"})
        except SettingsError as e:
            raise pytest.UsageError(f"quack: {e}") from None
        settings.set_current(self.settings)

    def ensure(self) -> None:
        """Re-install the strict settings if a test left none installed."""
        from quack import settings

        if settings.installed() is None:
            settings.set_current(self.settings)

    @contextlib.contextmanager
    def attempt(self) -> Iterator[list]:
        """Around one test attempt: records the prebuilt-mode misses."""
        from quack.compile import scope

        self.ensure()
        with scope.recording_not_prebuilt() as misses:
            yield misses

    def check(self, rep: Any, misses: list) -> bool:
        """Fail a setup or call report that is not already a failure if the test hit a
        miss under the strict settings: one that passed (it swallowed the miss), was
        skipped (pytest.skip on KernelNotPrebuilt, in its body or a fixture) or xfailed.
        Only passing reports were failed, and a skip escaped strict mode. A test skipped
        before any miss is not touched (misses is empty). Returns True if it failed it."""
        hit = [e for e, s in misses if s is self.settings]
        if not hit or rep.failed or (rep.passed and rep.when != "call"):
            return False
        if rep.passed:
            head = PREFIX
        else:
            head = ESCAPED.format(how="xfailed" if hasattr(rep, "wasxfail") else "skipped")
        if hasattr(rep, "wasxfail"):
            del rep.wasxfail  # else reported as an xpass/xfail, not as the failure it is
        rep.outcome = "failed"
        rep.longrepr = head + str(hit[0])
        return True
