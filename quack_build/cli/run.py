"""What every typer command of ``quack`` shares: running a command's body (a Fail is its
message and exit status, Ctrl-C is 130, warnings print as one ``warning:`` line), the
manifests given or configured and their expansion, the local store, the remote tier."""

from __future__ import annotations

from pathlib import Path
from typing import List

import typer

from quack.errors import PreloadError, TomlFileError, TuningTableError
from quack_build.cli import context as _common
from quack_build.cli.context import Fail


def manifest_paths(s, given: List[Path]) -> list:
    if given:
        return list(given)
    paths = s.manifest_paths()
    if not paths:
        raise Fail(
            "error: no manifest given and none listed in quack.toml ([build] manifests = [...])", code=2
        )
    return paths


def expand_manifests(s, manifests, arch, max_configs, outcome: str = "nothing was built", gpus=()):
    """``gpus``: ``--gpu``'s models (each one's tuning rows, the union), else the model in force."""
    from quack.errors import ManifestError
    from quack_build.manifest.read import expand

    try:
        return expand(
            manifest_paths(s, manifests),
            archs=s.build_archs(),
            arch_override=arch or None,
            max_configs=max_configs,
            gpus=gpus,
        )
    except ManifestError as e:
        raise _common.manifest_fail(e, outcome) from None


def tune_models(gpus=()) -> tuple[tuple[str, ...], str]:
    """(models, why): the GPU models whose tuning rows chose a build's configurations, for
    its report and a bundle's index; no models: each table's default GPU."""
    if gpus:
        return tuple(gpus), "--gpu"
    from quack.tuning import gpu_choice

    model, why = gpu_choice()
    return ((model,) if model else ()), why


def local_store(s):
    from quack.cache.store import local_store

    return local_store(s)


def _show_warning(message, category, filename, lineno, file=None, line=None):  # noqa: ARG001
    typer.echo(f"warning: {message}", err=True)


def run_command(fn):
    import warnings

    saved = warnings.showwarning
    warnings.showwarning = _show_warning
    try:
        code = fn()
    except Fail as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(e.code) from None
    except PreloadError as e:
        # A [build] preload module a build (build, tune, prewarm) found missing before
        # starting any worker: its one line, or the child's traceback when it has one.
        typer.echo(e.detail if e.detail.count("\n") > 2 else e.head, err=True)
        raise typer.Exit(1) from None
    except (TuningTableError, TomlFileError) as e:
        # A broken tuning table (or another TOML file no command catches) read while binding
        # a configuration: one line naming the file, row and field, not an 80-line traceback
        # from deep in a bind. A manifest's own problems are ManifestErrors (manifest_fail).
        fix = ""
        if isinstance(e, TuningTableError):
            fix = "; fix it (docs/tuning.md), or give quack tune --from-empty to replace the table"
        typer.echo(f"error: {e}{fix}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(130) from None
    finally:
        warnings.showwarning = saved
    raise typer.Exit(code or 0)


def remote_tier(s, *, strict: bool = False):
    """The remote tier configured for this command, or None. In a build, a bad
    remote configuration is one warning (the build goes on without it)."""
    if not s.remote_url:
        return None
    from quack.remote import tier

    return tier.from_settings(s, strict=strict)
