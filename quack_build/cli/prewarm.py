"""``quack prewarm``: rebuild what the usage journal shows was used recently
(the work itself is quack_build.build.prewarm)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from quack_build.cli.context import Fail, check_root, cli_settings, console, emit_json, load_kernels
from quack_build.cli.options import cache_dir_option
from quack_build.cli.run import local_store, run_command


def prewarm(
    since: str = typer.Option(
        "7d", "--since", help="Use journal records this recent (e.g. 7d, 12h; 0 = all)."
    ),
    top: Optional[int] = typer.Option(None, "--top", min=1, help="Only the N most used configurations."),
    emit_manifest: Optional[Path] = typer.Option(
        None, "--emit-manifest", help="Write them as a manifest (TOML)."
    ),
    jobs: Optional[int] = typer.Option(
        None,
        "--jobs",
        "-j",
        min=1,
        help="Compile workers, at least 1 (default: [build] jobs, else [runtime] compile_jobs, else CPU count).",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="List, don't compile."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    cache_dir: Optional[Path] = cache_dir_option(),
):
    """Rebuild, for the current fingerprint, what the usage journal shows was used recently."""
    run_command(lambda: _prewarm(since, top, emit_manifest, jobs, dry_run, as_json, cache_dir))


def _prewarm(since, top, emit_manifest, jobs, dry_run, as_json, cache_dir) -> int:
    from quack_build.build import prewarm as pw
    from quack_build.cachedir import units

    try:
        age = units.parse_age(since) if since not in ("0", "all") else None
    except ValueError as e:
        typer.echo(f"error: --since: {e}", err=True)
        raise typer.Exit(2) from None
    from quack.errors import OutputFileError

    why = pw.emit_path_problem(emit_manifest) if emit_manifest is not None else ""
    if why:  # a usage error, found before the journal is read, as --trace's is
        raise Fail(f"error: --emit-manifest {emit_manifest}: {why}", code=2)
    s = cli_settings(cache_dir, jobs)
    # The journal lives in the cache: one that can't be reached is an error, not an empty
    # journal (a cache directory set to a file printed "0 journal records" and exited 0).
    check_root(s)
    load_kernels(s)
    con = console(to_stderr=as_json)
    try:
        return pw.prewarm(
            s,
            local_store(s),
            since_s=age,
            top=top,
            emit_manifest=emit_manifest,
            jobs=s.effective_jobs(jobs),
            dry_run=dry_run,
            as_json=as_json,
            console=con,
            emit_json=emit_json,
        )
    except OutputFileError as e:
        raise Fail(f"error: {e}") from None
