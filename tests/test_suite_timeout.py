"""The whole suite runs under a per-test time-out (pytest-timeout, pyproject.toml), so a
future hang fails one test instead of stalling CI."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import XDIST_WORKER_ENV


def test_suite_has_a_per_test_timeout(pytestconfig):
    assert pytestconfig.pluginmanager.hasplugin("timeout")
    assert 0 < float(pytestconfig.getini("timeout")) <= 900


def test_a_hanging_test_fails_instead_of_hanging(tmp_path):
    (tmp_path / "test_hang.py").write_text(
        "import time\n\ndef test_hang():\n    time.sleep(3600)\n\ndef test_next():\n    assert True\n"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "timeout=3",
            str(tmp_path / "test_hang.py"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
        # A run of its own, not a worker of ours (tests/conftest.py: XDIST_WORKER_ENV).
        env={k: v for k, v in os.environ.items() if k not in XDIST_WORKER_ENV},
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 failed, 1 passed" in r.stdout and "Timeout" in r.stdout, r.stdout
