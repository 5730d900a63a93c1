"""Fixtures shared by the kernel tiers (imported by the test modules: a conftest.py here
would shadow tests/conftest.py for the `from conftest import ...` of other tests)."""

import os

import pytest


@pytest.fixture(scope="module")
def kernel_cache():
    """The session's cache (QUACK_CACHE_DIR, quack.toml): `quack build manifests/tests.toml`
    fills it, so under `pytest --quack-prebuilt` (CI) these tests prove every prebuilt
    entry loads, and without it they compile what is missing in the workers.
    QUACK_TEST_KERNEL_CACHE points them at another cache instead."""
    from quack import settings

    d = os.environ.get("QUACK_TEST_KERNEL_CACHE")
    if not d:
        yield str(settings.get().cache_dir)
        return
    saved = settings.installed()
    settings.set_current(settings.resolve({"cache_dir": d, "arch": "sm_90a", "mode": "jit"}))
    yield d
    settings.set_current(saved)
