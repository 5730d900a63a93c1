"""settings.override / installed, and the settings read through settings.py
(QUACK_POOL_START, QUACK_NO_PRELOAD, QUACK_LOG, QUACK_PYTEST_GPU_PIN)."""

import subprocess
import sys

import pytest

from quack import settings
from quack.errors import SettingsError


def test_override_installs_and_restores(quack_settings, tmp_path):
    before = settings.installed()
    assert before is quack_settings
    with settings.override(mode="prebuilt", cache_dir=str(tmp_path / "x"), compile_jobs="3") as s:
        assert settings.get() is s and settings.installed() is s
        assert s.mode == "prebuilt" and s.cache_dir == tmp_path / "x" and s.compile_jobs == 3
        assert s.arch == quack_settings.arch and s.sources["mode"] == "override"
    assert settings.installed() is before


def test_override_restores_none(quack_settings):
    settings.set_current(None)
    with settings.override(arch="sm_100a"):
        assert settings.get().arch == "sm_100a"
    assert settings.installed() is None
    settings.set_current(quack_settings)


def test_override_restores_after_an_error(quack_settings):
    with pytest.raises(RuntimeError):
        with settings.override(mode="prebuilt"):
            raise RuntimeError("boom")
    assert settings.installed() is quack_settings


@pytest.mark.parametrize(
    "kw,word",
    [
        ({"mode": "fast"}, "mode"),
        ({"arch": "sm_1"}, "arch"),
        ({"no_such": 1}, "no_such"),
        ({"pool_start": "thread"}, "pool_start"),
    ],
)
def test_override_checks_values(quack_settings, kw, word):
    with pytest.raises(SettingsError) as e:
        with settings.override(**kw):
            pytest.fail(f"override({kw}) was entered: a bad value must be refused on entry")
    assert word in str(e.value)
    assert settings.installed() is quack_settings


def test_env_only_settings_are_settings(tmp_path):
    s = settings.resolve(
        env={
            "QUACK_POOL_START": "spawn",
            "QUACK_NO_PRELOAD": "1",
            "QUACK_LOG": "INFO",
            "QUACK_PYTEST_GPU_PIN": "0",
        },
        cwd=tmp_path,
    )
    assert (s.pool_start, s.no_preload, s.log, s.pytest_gpu_pin) == ("spawn", True, "info", False)
    d = settings.resolve(env={}, cwd=tmp_path)
    assert (d.pool_start, d.no_preload, d.log, d.pytest_gpu_pin) == ("forkserver", False, "", None)
    assert settings.resolve(env={"QUACK_PYTEST_GPU_PIN": "auto"}, cwd=tmp_path).pytest_gpu_pin is None
    with pytest.raises(SettingsError) as e:
        settings.resolve(env={"QUACK_POOL_START": "threads"}, cwd=tmp_path)
    assert "QUACK_POOL_START" in str(e.value)
    (tmp_path / "quack.toml").write_text('[pytest]\ngpu_pin = false\n[runtime]\npool_start = "spawn"\n')
    s = settings.resolve(env={}, cwd=tmp_path)
    assert s.pytest_gpu_pin is False and s.pool_start == "spawn"


def test_pool_start_method_comes_from_settings(quack_settings):
    from quack.compile.pool import CompilePool

    with settings.override(pool_start="spawn") as s:
        assert CompilePool(1, settings=s).start_method == "spawn"


_LOG = r"""
import logging, warnings
from quack import settings
s = settings.get()
logging.getLogger("quack.tiers").warning("a tier fallback")
logging.getLogger("quack.pool").info("a pool event")
"""


@pytest.mark.parametrize(
    "level,want", [("", []), ("warning", ["a tier fallback"]), ("info", ["a tier fallback", "a pool event"])]
)
def test_quack_log_level(tmp_path, level, want):
    env = {"PATH": "/usr/bin:/bin", "QUACK_LOG": level, "HOME": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-c", _LOG], env=env, capture_output=True, text=True, timeout=120, cwd=str(tmp_path)
    )
    assert r.returncode == 0, r.stderr
    got = [ln.split(": ", 1)[1] for ln in r.stderr.splitlines() if ln.startswith("quack.")]
    assert got == want, r.stderr
