"""The typer commands of ``quack cache``: stats (rendered by quack_build.cli.stats_view, which
the typer-free fast path of quack_build.cli.main shares), clean, pull and push. Registered
on the ``cache`` sub-app by quack_build.cli.app (``register``)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from quack_build.cli import argcheck
from quack_build.cli import context as _common
from quack_build.cli.context import Fail, cli_settings, console, current_srcfps, emit_json, load_kernels
from quack_build.cli.options import cache_dir_option, gpu_option, manifests_argument, max_configs_option
from quack_build.cli.run import expand_manifests, local_store, remote_tier, run_command


def register(cache_app: typer.Typer) -> None:
    cache_app.command("stats")(cache_stats)
    cache_app.command("clean")(cache_clean)
    cache_app.command("pull")(cache_pull)
    cache_app.command("push")(cache_push)


def cache_stats(
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    cache_dir: Optional[Path] = cache_dir_option(),
    top: int = typer.Option(10, "--top", min=0, help="How many of the slowest compiles to list."),
):
    """Entries and bytes per fingerprint (current vs stale) and kernel; usage from the journal."""
    run_command(lambda: _common.stats(as_json, cache_dir, top))


def _size_option(value: Optional[str]) -> Optional[str]:
    """``--max-size``, checked as it is parsed: the error names the option ("'5X' is not
    a size" alone did not say which of the flags was wrong)."""
    from quack_build.cachedir import units

    if value is not None:
        try:
            units.parse_size(value)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
    return value


def _age_option(value: Optional[str]) -> Optional[str]:
    from quack_build.cachedir import units

    if value is not None:
        try:
            units.parse_age(value)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
    return value


def cache_clean(
    remove_all: bool = typer.Option(False, "--all", help="Remove every entry (entries in use are skipped)."),
    max_size: Optional[str] = typer.Option(
        None,
        "--max-size",
        callback=_size_option,
        help="Shrink to this size, least recently used first (e.g. 5G).",
    ),
    older_than: Optional[str] = typer.Option(
        None,
        "--older-than",
        callback=_age_option,
        help="Remove entries unused for this long (e.g. 30d, 12h).",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="Show what would be removed."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    cache_dir: Optional[Path] = cache_dir_option(),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="List every file removed."),
):
    """Remove stale fingerprints, quarantined entries and debris (safe while the cache is in use)."""
    run_command(lambda: _clean(remove_all, max_size, older_than, dry_run, as_json, cache_dir, verbose))


def _clean(remove_all, max_size, older_than, dry_run, as_json, cache_dir, verbose) -> int:
    from quack_build.cachedir import clean as cacheclean
    from quack_build.cachedir import units

    if remove_all and (max_size is not None or older_than is not None):
        # --all silently won: `--all --max-size 1G` meant "shrink to 1G" and deleted everything.
        given = " / ".join(f for f, v in (("--max-size", max_size), ("--older-than", older_than)) if v)
        raise Fail(
            f"error: --all cannot be combined with {given}: --all removes every entry; give --all "
            f"alone, or --max-size and/or --older-than without it",
            code=2,
        )

    # Both were checked as the options were parsed (_size_option, _age_option).
    ms = units.parse_size(max_size) if max_size is not None else None
    age = units.parse_age(older_than) if older_than is not None else None
    from quack.errors import CacheError

    s = cli_settings(cache_dir)
    _common.check_root(s)
    load_kernels(s, required=False)
    con = console(to_stderr=as_json)
    if not Path(s.cache_dir).is_dir():
        if as_json:  # the schema of a clean that removed nothing ("busy": 0 was not a list)
            emit_json(_clean_json(dry_run, [], 0, {}, [], []))
        else:
            con.print(f"cache {s.cache_dir} does not exist: nothing to clean", markup=False)
        return 0
    why = "" if dry_run else cacheclean.unwritable(Path(s.cache_dir))
    if why:
        raise Fail(
            f"error: cannot clean the cache directory {s.cache_dir}: {why}; nothing was removed "
            f"(cache directory set by {_common.cache_dir_origin(s)}). Clean it where it can be "
            f"written (as its owner, or mounted read-write); --dry-run shows what would go"
        )

    def log(r):
        if verbose:
            con.print(
                f"{'would remove' if dry_run else 'removed'} {r.path} ({r.why})", markup=False, soft_wrap=True
            )

    try:
        rep = cacheclean.clean(
            s.cache_dir,
            current_srcfps(),
            remove_all=remove_all,
            max_size=ms,
            older_than=age,
            dry_run=dry_run,
            log=log,
        )
    except CacheError as e:  # a directory in the cache that can't be read (walk)
        raise _common.cache_fail(s, e) from None
    by_why: dict = {}
    for r in rep.removed:
        d = by_why.setdefault(r.why, [0, 0])
        d[0] += 1
        d[1] += r.bytes
    if as_json:
        emit_json(_clean_json(dry_run, rep.removed, rep.freed, by_why, rep.busy, rep.errors))
    else:
        verb = "would free" if dry_run else "freed"
        for why, (n, b) in sorted(by_why.items()):
            con.print(f"  {n:>6} files  {units.human_bytes(b):>10}  {why}", markup=False)
        con.print(
            f"{verb} {units.human_bytes(rep.freed)} ({len(rep.removed)} files) in {s.cache_dir}",
            markup=False,
        )
        if rep.busy:
            con.print(f"skipped {len(rep.busy)} in use by other processes", markup=False)
        for p, err in rep.errors:
            con.print(f"error: {p}: {err}", markup=False)
    return 1 if rep.errors else 0


def _clean_json(dry_run: bool, removed: list, freed: int, by_why: dict, busy: list, errors: list) -> dict:
    """``quack cache clean --json``'s document, one schema whatever happened."""
    return {
        "dry_run": dry_run,
        "removed": len(removed),
        "freed_bytes": freed,
        "by_reason": {k: {"files": v[0], "bytes": v[1]} for k, v in by_why.items()},
        "busy": [str(p) for p, _ in busy],
        "errors": [f"{p}: {e}" for p, e in errors],
    }


def cache_pull(
    manifests: List[Path] = manifests_argument(),
    arch: List[str] = typer.Option(
        None,
        "--arch",
        callback=argcheck.arch_option,
        help="For this arch instead of the manifests' (repeatable).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    cache_dir: Optional[Path] = cache_dir_option(),
    max_configs: int = max_configs_option(),
    gpu: List[str] = gpu_option(),
):
    """Fetch the manifests' configurations missing locally from the remote cache (signatures verified)."""
    run_command(
        lambda: _sync("pull", manifests or [], arch or [], as_json, cache_dir, max_configs, gpu or [])
    )


def cache_push(
    manifests: List[Path] = manifests_argument(),
    arch: List[str] = typer.Option(
        None,
        "--arch",
        callback=argcheck.arch_option,
        help="For this arch instead of the manifests' (repeatable).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    cache_dir: Optional[Path] = cache_dir_option(),
    max_configs: int = max_configs_option(),
    gpu: List[str] = gpu_option(),
):
    """Sign and upload the manifests' configurations from the local cache to the remote (needs write = true and a signing key)."""
    run_command(
        lambda: _sync("push", manifests or [], arch or [], as_json, cache_dir, max_configs, gpu or [])
    )


def _sync(what, manifests, arch, as_json, cache_dir, max_configs, gpus=()) -> int:
    from quack.errors import KeyFileError
    from quack.remote.tier import offline_reason as remote_offline_reason
    from quack_build.build import remote as remote_sync

    # quack.toml from the first manifest's directory, as `quack build` finds it: a project's
    # [remote] and kernel_packages must not depend on where the command is run from.
    s = cli_settings(cache_dir, manifests=manifests)
    if not s.remote_url:
        raise Fail(
            "error: no remote cache configured: set QUACK_REMOTE or [remote] url in quack.toml "
            "(redis://host:port/db, s3://bucket/prefix, file:///path)"
        )
    if what == "push" and not (s.remote_write and s.signing_key):
        raise Fail(
            "error: pushing needs write access and a signing key: set QUACK_REMOTE_WRITE=1 and "
            "QUACK_SIGNING_KEY=PATH.key ([remote] write = true, signing_key = ...); "
            "create a key with `quack keygen NAME`"
        )
    if what == "pull":
        # Without a trusted key every object would be refused unread (the tier does not even
        # ask the remote): "0 pulled, N not available" and exit 0 hid that nothing was tried.
        from quack import signing

        try:
            n_trusted = len(signing.trusted_keys_from_settings(s))
        except KeyFileError as e:
            raise Fail(f"error: remote cache: {e}") from None
        if not n_trusted:
            raise Fail(
                "error: pull needs trusted keys: set QUACK_TRUSTED_KEYS=PATH.pub "
                "([remote] trusted_keys = [...] in quack.toml) to the public keys of the writers"
            )
    load_kernels(s)
    exp = expand_manifests(s, manifests, arch, max_configs, f"nothing was {what}ed", gpus)
    con = console(to_stderr=as_json)
    try:
        remote = remote_tier(s, strict=True)
    except (ValueError, KeyFileError, ImportError) as e:
        raise Fail(f"error: remote cache: {e}") from None
    store = local_store(s)
    try:
        fn = remote_sync.pull_configs if what == "pull" else remote_sync.push_configs
        rep = fn(exp.configs, store, remote)
    finally:
        remote.record(Path(s.cache_dir))
        remote.close()
    if as_json:
        emit_json(rep.to_json())
    else:
        if what == "pull":
            con.print(
                f"pulled {rep.pulled} of {rep.total} from {rep.url} ({rep.local} already local, "
                f"{rep.missing} not available, {rep.failed} not stored locally; "
                f"{rep.refused} refused; {rep.remote_errors} failed with remote errors"
                + (f"; {rep.not_asked} not asked, the remote being off" if rep.not_asked else "")
                + f") in {rep.wall_s:.2f}s",
                markup=False,
            )
        else:
            replaced = f"replaced {rep.replaced} refused objects, " if rep.replaced else ""
            con.print(
                f"pushed {rep.pushed} of {rep.total} to {rep.url} ({replaced}{rep.exists} already there, "
                f"{rep.missing} not in the local cache, {rep.failed} failed"
                + (f", {rep.skipped} not tried after a failure" if rep.skipped else "")
                + f") in {rep.wall_s:.2f}s",
                markup=False,
            )
        if rep.offline:
            why = remote_offline_reason(rep.url)
            con.print(f"error: the remote {rep.url} is off: {why}", markup=False)
    if what == "pull" and rep.failed:
        # On stderr whatever the output mode: the cause (a full disk, a read-only cache) is
        # the point, and --json's stdout carries the counts (issue 30: it was silent).
        err = console(to_stderr=True)
        err.print(
            f"error: {rep.failed} of {rep.total} objects pulled from {rep.url} could not be stored in "
            f"the local cache {s.cache_dir}; first: {rep.errors[0]}",
            markup=False,
        )
    # Every fetch failing with a remote error (a remote answering 503 to everything) is a
    # failed pull, as an unreachable one is; some errors among answers are a partial pull.
    all_errored = what == "pull" and rep.remote_errors > 0 and rep.remote_errors == rep.total - rep.local
    if all_errored and not rep.offline:
        console(to_stderr=True).print(
            f"error: every fetch from {rep.url} ({rep.remote_errors}) failed with a remote error "
            "(the warning above says which); nothing was pulled",
            markup=False,
        )
    return 1 if rep.offline or rep.failed or rep.skipped or all_errored else 0
