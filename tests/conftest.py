"""Shared fixtures. Every test that touches a cache gets its own under tmp_path."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

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
