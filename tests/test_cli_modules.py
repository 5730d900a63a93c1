"""The CLI's modules after the split by concern: the names callers import from
quack_build.manifest, .scheduler, .inventory, .bundlecmd and .app are the objects of
their home modules (some re-exported on first use); the typer app registers its
commands in the order ``quack --help`` has always listed them; ``quack --help`` and the
typer-free ``quack cache stats`` do not load the modules they have no use for."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from quack_build import (
    app,
    buildcmd,
    buildconfig,
    buildtasks,
    bundlecmd,
    bundleverify,
    cacheclean,
    cachecli,
    cachestats,
    inventory,
    manifest,
    manifest_tables,
    planning,
    scheduler,
    trace,
    units,
)

ROOT = Path(__file__).resolve().parents[1]

HOMES = {
    manifest: {
        buildconfig: ("BuildConfig", "format_params"),
        manifest_tables: ("Budget", "DEFAULT_MAX_CONFIGS", "TOP_KEYS", "DEFAULTS_KEYS", "KERNEL_KEYS"),
    },
    scheduler: {
        buildtasks: (
            "CACHED",
            "COMPILED",
            "SHARED",
            "FAILED",
            "SKIPPED",
            "INTERRUPTED",
            "REMOTE",
            "Task",
            "Reporter",
            "NullReporter",
            "BuildResult",
        ),
        planning: ("plan", "plan_one", "PastTimes", "past_compile_times", "order_longest_first"),
        trace: ("write_trace",),
    },
    inventory: {units: ("parse_size", "parse_age", "human_bytes")},
    app: {
        buildcmd: ("build",),
        cachecli: ("cache_stats", "cache_clean", "cache_pull", "cache_push"),
    },
}

# Re-exported through a module __getattr__ (their homes import the old module, or
# `quack --help` should not load them): not in __all__, found on first use.
LAZY = {
    inventory: {
        cachestats: ("summarize", "journal_summary"),
        cacheclean: ("clean", "Cleaner", "CleanReport", "Removal", "LOG_MAX_AGE"),
    },
    bundlecmd: {bundleverify: ("verify_bundles", "print_bundle_report", "run_verify_bundles")},
}


def test_reexports_are_the_home_modules_objects():
    n = 0
    for old, homes in HOMES.items():
        for home, names in homes.items():
            for name in names:
                assert getattr(old, name) is getattr(home, name), (old.__name__, name)
                assert name in old.__all__, (old.__name__, name)
                n += 1
    assert n == 32


def test_lazy_reexports_are_the_home_modules_objects_and_unknown_names_still_fail():
    n = 0
    for old, homes in LAZY.items():
        for home, names in homes.items():
            for name in names:
                assert getattr(old, name) is getattr(home, name), (old.__name__, name)
                n += 1
        with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
            old.not_a_name  # noqa: B018
    assert n == 10
    from quack_build.inventory import Cleaner  # the `from ... import` form goes through it too

    assert Cleaner is cacheclean.Cleaner


def test_commands_register_in_the_order_help_lists_them():
    group = typer.main.get_command(app.app)
    assert list(group.commands) == [
        "build",
        "verify",
        "keygen",
        "prewarm",
        "bundle",
        "bundle-inspect",
        "cache",
    ]
    assert [n for n, c in group.commands.items() if c.hidden] == ["bundle-inspect"]
    assert list(group.commands["cache"].commands) == ["stats", "clean", "pull", "push"]


_LOADED = r"""
import contextlib, io, json, sys
from quack_build.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main(sys.argv[1:])
    except SystemExit as e:
        assert not e.code, e.code
print(json.dumps(sorted(m for m in sys.modules if m.startswith("quack_build"))))
"""


@pytest.mark.parametrize(
    "args, loaded, not_loaded",
    [
        (
            ["--help"],
            {"quack_build.app", "quack_build.buildcmd", "quack_build.cachecli", "quack_build.bundlecmd"},
            {"quack_build.bundleverify", "quack_build.manifest", "quack_build.scheduler"},
        ),
        (
            ["cache", "stats", "--json"],
            {"quack_build.cachestats", "quack_build.inventory"},
            {"quack_build.app", "quack_build.cacheclean", "quack_build.clirun"},
        ),
    ],
)
def test_help_and_stats_load_only_what_they_use(tmp_path, args, loaded, not_loaded):
    env = dict(os.environ, QUACK_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-c", _LOADED, *args],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    mods = set(json.loads(r.stdout.strip().splitlines()[-1]))
    assert loaded <= mods, loaded - mods
    assert not (not_loaded & mods), not_loaded & mods
