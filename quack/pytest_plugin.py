"""quack's pytest plugin (registered through the pytest11 entry point)."""
from __future__ import annotations


def pytest_addoption(parser):
    group = parser.getgroup("quack", "quack kernel cache")
    group.addoption("--quack-prebuilt", action="store_true", default=False,
                    help="fail any test whose kernel is not prebuilt (QUACK_MODE=prebuilt)")
