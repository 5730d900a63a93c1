"""Strict (prebuilt) mode: any kernel miss fails the test with the
KernelNotPrebuilt message, even if the test caught the error, skipped or xfailed.

On with ``--quack-prebuilt``, or when the settings say ``mode = "prebuilt"``
(QUACK_MODE, or ``[runtime] mode`` in quack.toml). The plugin installs the
process's *default* settings with mode=prebuilt and re-installs them whenever a
test leaves none installed. A test that installs its own Settings (a private
tmp cache in jit mode, as the project's cache tests do) runs under those.

What is counted: every KernelNotPrebuilt raised in prebuilt mode for the session's
cache directory, whichever settings object raised it (``settings.override(...)`` of
any other field keeps the mode and the cache: still the session's); a test's own
prebuilt settings on a private cache are its own business. Where: each test attempt
(set-up, call and teardown; a miss fails the report of the phase that met it, or the
call for a set-up that swallowed it), the collection of each collector (a module
that calls a kernel at import: the collector fails, and its tests never run) and the
conftest.py files pytest imports before collection (they fail the session's collection).

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
# A collector (a test module) that met a miss at import or while collecting its tests.
COLLECTING = "quack --quack-prebuilt: {what} asked for a kernel that is not prebuilt{caught}:\n"

_SAVED_ENV = pytest.StashKey[tuple]()  # (QUACK_PYTEST_PREBUILT_CACHE before the session, or None)
_EARLY_MISSES = pytest.StashKey[list]()  # the initial conftests' misses


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


@contextlib.contextmanager
def recording_early(config) -> Iterator[None]:
    """Around the initial conftests' import (before pytest_configure, so before any
    collector): their prebuilt-mode misses, for the session's collection report."""
    from quack.compile import scope

    with scope.recording_not_prebuilt() as misses:
        yield
    config.stash[_EARLY_MISSES] = misses


def early_misses(config) -> list:
    """The initial conftests' misses (once: the stash is emptied)."""
    misses = config.stash.get(_EARLY_MISSES, [])
    config.stash[_EARLY_MISSES] = []
    return misses


class StrictMode:
    def __init__(self) -> None:
        from quack import settings
        from quack.errors import SettingsError

        try:
            self.settings = settings.resolve({"mode": "prebuilt"})
        except SettingsError as e:
            raise pytest.UsageError(f"quack: {e}") from None
        settings.set_current(self.settings)
        self.root = os.path.realpath(self.settings.cache_dir)
        self.charged = 0  # the current attempt's misses already charged to a report

    def ensure(self) -> None:
        """Re-install the strict settings if a test left none installed."""
        from quack import settings

        if settings.installed() is None:
            settings.set_current(self.settings)

    def counts(self, s: Any) -> bool:
        """Is a miss under settings ``s`` the session's? Prebuilt mode on the session's
        cache directory, whatever else ``s`` changed. (Only misses raised under the very
        settings object the plugin installed counted: any ``settings.override(...)``,
        a tighter compile_timeout, let a caught miss pass.)"""
        if s is self.settings:
            return True
        if getattr(s, "mode", None) != "prebuilt":
            return False
        try:
            return os.path.realpath(s.cache_dir) == self.root
        except (OSError, TypeError, ValueError):
            return False

    def hits(self, misses: list) -> list:
        return [e for e, s in misses if self.counts(s)]

    @contextlib.contextmanager
    def attempt(self) -> Iterator[list]:
        """Around one test attempt: records the prebuilt-mode misses."""
        from quack.compile import scope

        self.ensure()
        self.charged = 0
        with scope.recording_not_prebuilt() as misses:
            yield misses

    @contextlib.contextmanager
    def collecting(self) -> Iterator[list]:
        """Around one collector's collection (a module's import, its parametrization):
        records the prebuilt-mode misses. A nested collector records its own."""
        from quack.compile import scope

        self.ensure()
        with scope.recording_not_prebuilt() as misses:
            yield misses

    def check(self, rep: Any, misses: list) -> bool:
        """Fail a report that is not already a failure if its phase of the test hit a
        miss under the strict settings: one that passed (it swallowed the miss), was
        skipped (pytest.skip on KernelNotPrebuilt, in its body or a fixture) or xfailed.
        A set-up that passed leaves its misses to the call's report; a teardown is
        failed for the misses met after the call (a fixture's teardown that caught one).
        A test skipped before any miss is not touched (misses is empty). Each miss is
        charged to one report. Returns True if it failed it."""
        if rep.when == "setup" and rep.passed:
            return False  # the call reports them
        new = misses[self.charged :] if rep.when == "teardown" else misses
        self.charged = len(misses)
        hit = self.hits(new)
        if not hit or rep.failed:
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

    def check_collect(self, rep: Any, misses: list, early: list | None = None) -> bool:
        """Fail a collector's report (a module that caught a miss at import and went on,
        skipping its tests with ``skipif(K is None)`` or a module-level skip) unless it
        already failed. ``early``: the initial conftests' misses, given with the
        session's report (they were imported before any collector). Returns True if
        it failed it."""
        hit = self.hits(misses)
        first = self.hits(early or [])
        if not (hit or first) or rep.failed:
            return False
        caught = " (and caught the error)" if rep.passed else " and was skipped"
        what = (
            "a conftest.py loaded before collection" if first else f"collecting {rep.nodeid or 'the session'}"
        )
        rep.outcome = "failed"
        rep.longrepr = COLLECTING.format(what=what, caught=caught) + str((first or hit)[0])
        rep.result = []
        return True
