"""The typer application behind ``quack`` (see quack_build.cli): build, verify,
prewarm, cache stats|clean.

Exit status: 0 success; 1 a problem (invalid manifest or settings, a failed
compile, a missing or broken entry); 2 a usage error (typer's own); 130
interrupted. Heavy modules load inside commands: ``quack cache stats`` never
imports cutlass or torch.

The commands live in per-group modules that register on the apps here, in the order
``quack --help`` lists them: quack_build.buildcmd (build), this module (verify, keygen,
prewarm), quack_build.bundlecmd (bundle), quack_build.cachecli (cache stats|clean|pull|
push); what they share is quack_build.clirun."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

app = typer.Typer(
    name="quack",
    add_completion=False,
    no_args_is_help=True,
    help="quack: precompile CuTe DSL kernels into a versioned cache, and manage the cache.",
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
cache_app = typer.Typer(no_args_is_help=True, help="Inspect and clean the kernel cache.")
app.add_typer(cache_app, name="cache")

# After the typer apps, as before; the command modules register on them at the bottom.
from quack_build import buildcmd as _buildcmd  # noqa: E402
from quack_build import bundlecmd as _bundlecmd  # noqa: E402
from quack_build import cachecli as _cachecli  # noqa: E402
from quack_build import tunecmd as _tunecmd  # noqa: E402
from quack_build.buildcmd import build  # noqa: E402
from quack_build.cachecli import cache_clean, cache_pull, cache_push, cache_stats  # noqa: E402
from quack_build.clirun import expand_manifests, local_store, run_command  # noqa: E402
from quack_build.common import Fail, cli_settings, console, current_srcfps, emit_json, load_kernels  # noqa: E402
from quack_build.options import cache_dir_option, manifests_argument, max_configs_option  # noqa: E402

__all__ = [
    "Fail",
    "app",
    "build",
    "cache_app",
    "cache_clean",
    "cache_pull",
    "cache_push",
    "cache_stats",
    "cli_settings",
    "console",
    "current_srcfps",
    "emit_json",
    "keygen",
    "load_kernels",
    "prewarm",
    "verify",
]


# --- verify ----------------------------------------------------------------------


def verify(
    manifests: List[Path] = manifests_argument(),
    arch: List[str] = typer.Option(
        None, "--arch", help="Verify for this arch instead of the manifests' (repeatable)."
    ),
    run: bool = typer.Option(False, "--run", help="GPU only: run each kernel against its reference."),
    no_load: bool = typer.Option(False, "--no-load", help="Skip the load test in a fresh process."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    cache_dir: Optional[Path] = cache_dir_option(),
    max_configs: int = max_configs_option(),
    bundles: bool = typer.Option(
        False, "--bundles", help="Check the installed bundles instead of the cache."
    ),
):
    """Check every configuration: present, checksum intact, loads in a fresh process, right arch."""
    if bundles:
        from quack_build import bundleverify

        run_command(lambda: bundleverify.run_verify_bundles(as_json, cache_dir, no_load, run))
    run_command(lambda: _verify(manifests or [], arch or [], run, no_load, as_json, cache_dir, max_configs))


def _verify(manifests, arch, run, no_load, as_json, cache_dir, max_configs) -> int:
    from quack_build import verify as v

    s = cli_settings(cache_dir, manifests=manifests)
    load_kernels(s)
    exp = expand_manifests(s, manifests, arch, max_configs)
    con = console(to_stderr=as_json)
    from quack.errors import CacheError

    try:
        res = v.verify(
            exp.configs, local_store(s), load=not no_load, run=run, console=None if as_json else con
        )
    except CacheError as e:  # an unsafe root: refused like build, stats and clean do
        raise Fail(f"error: {e}") from None
    if as_json:
        emit_json(res)
    else:
        v.print_report(con, res)
    return 0 if res["ok"] else 1


# --- keygen ----------------------------------------------------------------------


def keygen(
    name: str = typer.Argument(
        ..., help="Key name, e.g. ci-1 (travels with every signature; use a new one to rotate)."
    ),
    out_dir: Path = typer.Option(Path("."), "--out-dir", "-o", help="Directory for NAME.key and NAME.pub."),
):
    """Create an Ed25519 signing key pair: NAME.key (private, mode 0600) and NAME.pub (give to readers)."""
    run_command(lambda: _keygen(name, out_dir))


def _keygen(name: str, out_dir: Path) -> int:
    from quack import signing

    try:
        signing.check_name(name)
    except ValueError as e:
        raise Fail(f"error: {e}", code=2) from None
    try:
        key_path, pub_path = signing.write_keypair(name, out_dir)
    except FileExistsError as e:
        raise Fail(f"error: {e}") from None
    except OSError as e:
        raise Fail(f"error: cannot write the key pair in {out_dir}: {e.strerror or e}") from None
    typer.echo(f"private key: {key_path} (mode 600; writers: QUACK_SIGNING_KEY={key_path})")
    typer.echo(f"public key:  {pub_path} (readers: QUACK_TRUSTED_KEYS={pub_path})")
    typer.echo(pub_path.read_text().strip())
    return 0


# --- prewarm ---------------------------------------------------------------------


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
        help="Compile workers, at least 1 (default: [build] jobs, else CPU count).",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="List, don't compile."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    cache_dir: Optional[Path] = cache_dir_option(),
):
    """Rebuild, for the current fingerprint, what the usage journal shows was used recently."""
    run_command(lambda: _prewarm(since, top, emit_manifest, jobs, dry_run, as_json, cache_dir))


def _prewarm(since, top, emit_manifest, jobs, dry_run, as_json, cache_dir) -> int:
    from quack_build import prewarm as pw
    from quack_build import units

    try:
        age = units.parse_age(since) if since not in ("0", "all") else None
    except ValueError as e:
        typer.echo(f"error: --since: {e}", err=True)
        raise typer.Exit(2) from None
    s = cli_settings(cache_dir, jobs)
    load_kernels(s)
    con = console(to_stderr=as_json)
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


# --- registration: the order `quack --help` lists the commands in -----------------

_buildcmd.register(app)
app.command()(verify)
app.command()(keygen)
app.command()(prewarm)
_bundlecmd.register(app)
_tunecmd.register(app)
_cachecli.register(cache_app)
