"""Typer options that several commands share, spelled once so their flags, defaults and
help stay the same everywhere (kept out of ``common``: the typer-free ``cache stats``
fast path imports that)."""

from __future__ import annotations

from pathlib import Path

import typer


def _cache_dir(value: str) -> Path:
    """``--cache-dir``'s value: a path that must not be empty. ``--cache-dir ''`` was
    Path('') == '.', so ``quack cache clean --all --cache-dir ''`` cleaned the current
    directory (a callback can't tell: it gets that Path('.') already)."""
    if not str(value).strip():
        raise typer.BadParameter(
            "must not be empty: give the cache directory's path, or leave --cache-dir out "
            "to use QUACK_CACHE_DIR, [cache] dir in quack.toml or the default"
        )
    return Path(value)


def cache_dir_option():
    return typer.Option(
        None, "--cache-dir", parser=_cache_dir, metavar="<path>", help="Cache directory (default: settings)."
    )


def gpu_option():
    return typer.Option(
        None,
        "--gpu",
        callback=argcheck_gpu,
        metavar="<model>",
        help="Choose tuned configurations by this GPU model's tuning rows (repeatable or "
        "comma-separated, at most 16: the union, one cache or bundle for several models; "
        "--max-configs counts each table once). Default: [tune] gpu / QUACK_TUNE_GPU, else "
        "this machine's GPU, else each table's default.",
    )


def argcheck_gpu(values):
    from quack_build.cli import argcheck

    return argcheck.gpu_option(values)


def max_configs_option():
    return typer.Option(
        10_000,
        "--max-configs",
        min=1,
        help="Limit on the tables' cross products (before exclude, plus include entries), summed over all manifests given.",
    )


def manifests_argument():
    return typer.Argument(None, help="Manifest files (default: [build] manifests in quack.toml).")
