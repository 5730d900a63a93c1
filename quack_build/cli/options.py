"""Typer options that several commands share, spelled once so their flags, defaults and
help stay the same everywhere (kept out of ``common``: the typer-free ``cache stats``
fast path imports that)."""

from __future__ import annotations

import typer


def cache_dir_option():
    return typer.Option(None, "--cache-dir", help="Cache directory (default: settings).")


def max_configs_option():
    return typer.Option(
        10_000,
        "--max-configs",
        min=1,
        help="Limit on the tables' cross products (before exclude, plus include entries), summed over all manifests given.",
    )


def manifests_argument():
    return typer.Argument(None, help="Manifest files (default: [build] manifests in quack.toml).")
