"""The typer application behind ``quack`` (see quack_build.cli): build, verify,
prewarm, cache stats|clean.

Exit status: 0 success; 1 a problem (invalid manifest or settings, a failed
compile, a missing or broken entry); 2 a usage error (typer's own); 130
interrupted. Heavy modules load inside commands: ``quack cache stats`` never
imports cutlass or torch."""

from __future__ import annotations

import contextlib
import signal
import sys
import time
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

from quack_build import common as _common  # noqa: E402 - after the typer apps, as before
from quack_build.common import Fail, cli_settings, console, current_srcfps, emit_json, load_kernels  # noqa: E402,F401
from quack_build.options import cache_dir_option, manifests_argument, max_configs_option  # noqa: E402


def _manifests(s, given: List[Path]) -> list:
    if given:
        return list(given)
    paths = s.manifest_paths()
    if not paths:
        raise Fail(
            "error: no manifest given and none listed in quack.toml ([build] manifests = [...])", code=2
        )
    return paths


def _expand(s, manifests, arch, max_configs):
    from quack.errors import ManifestError
    from quack_build.manifest import expand

    try:
        return expand(
            _manifests(s, manifests),
            archs=s.build_archs(),
            arch_override=arch or None,
            max_configs=max_configs,
        )
    except ManifestError as e:
        raise _common.manifest_fail(e) from None


def _store(s):
    from quack.cache.store import local_store

    return local_store(s)


def _show_warning(message, category, filename, lineno, file=None, line=None):  # noqa: ARG001
    typer.echo(f"warning: {message}", err=True)


def _run(fn):
    import warnings

    saved = warnings.showwarning
    warnings.showwarning = _show_warning
    try:
        code = fn()
    except Fail as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(e.code) from None
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(130) from None
    finally:
        warnings.showwarning = saved
    raise typer.Exit(code or 0)


# --- build ---------------------------------------------------------------------


def _check_executor(value: Optional[str]) -> Optional[str]:
    if value is None:
        return None
    from quack.settings import check_executor

    try:
        return check_executor(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


@app.command()
def build(
    manifests: List[Path] = manifests_argument(),
    jobs: Optional[int] = typer.Option(
        None,
        "--jobs",
        "-j",
        min=1,
        help="Compile workers, at least 1 (default: [build] jobs, else CPU count).",
    ),
    arch: List[str] = typer.Option(
        None, "--arch", help="Build for this arch instead of the manifests' (repeatable)."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", "-n", help="List what would compile and what is cached."
    ),
    keep_going: bool = typer.Option(False, "--keep-going", "-k", help="Go on after a failed compile."),
    force: bool = typer.Option(False, "--force", help="Rebuild even what is cached."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON result on stdout (progress on stderr)."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Write a Chrome trace-event JSON file."),
    cache_dir: Optional[Path] = cache_dir_option(),
    max_configs: int = max_configs_option(),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also list cached and started keys."),
    executor: Optional[str] = typer.Option(
        None,
        "--executor",
        callback=_check_executor,
        help="Where to compile: local (default: this host's worker pool), ray (a Ray instance started "
        "for the build), auto (the running Ray cluster, or RAY_ADDRESS), ray://HOST:PORT or "
        "HOST:PORT (a Ray cluster). Default: [build] executor / QUACK_BUILD_EXECUTOR.",
    ),
):
    """Compile the manifests' configurations into the cache, in parallel."""
    _run(
        lambda: _build(
            manifests or [],
            jobs,
            arch or [],
            dry_run,
            keep_going,
            force,
            as_json,
            trace,
            cache_dir,
            max_configs,
            verbose,
            executor,
        )
    )


def _build(
    manifests,
    jobs,
    arch,
    dry_run,
    keep_going,
    force,
    as_json,
    trace,
    cache_dir,
    max_configs,
    verbose,
    executor=None,
) -> int:
    from quack.errors import CacheError, ExecutorError
    from quack_build import display, executors, scheduler

    t0 = time.time()
    s = cli_settings(cache_dir, jobs, executor, manifests)
    load_kernels(s)
    con = console(to_stderr=as_json)
    if dry_run:
        from quack_build import dryrun

        paths = _manifests(s, manifests)
        store = _store(s)
        return dryrun.run(
            s, paths, arch=arch, max_configs=max_configs, store=store, con=con, force=force, as_json=as_json
        )
    exp = _expand(s, manifests, arch, max_configs)
    for w in exp.warnings:
        con.print(f"warning: {w}", markup=False)
    store = _store(s)
    try:
        tasks = scheduler.plan(exp.configs, store, force=force)
    except (CacheError, OSError) as e:
        raise Fail(f"error: cache {s.cache_dir}: {e}") from None
    plan_s = time.time() - t0
    n_jobs = s.effective_jobs(jobs)
    try:
        ex = executors.create(s, jobs=jobs or s.jobs or None, store=store)
    except ExecutorError as e:
        raise Fail(f"error: {e}") from None
    rep = display.make_reporter(con, verbose=verbose)
    remote = _remote(s)
    old_term = signal.getsignal(signal.SIGTERM)
    if old_term in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _term_to_interrupt)
    # --json: stdout carries the JSON only; what others print there meanwhile (Ray's driver
    # prints its cluster's error messages on sys.stdout) goes to stderr.
    quiet_stdout = contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()
    try:
        with quiet_stdout:
            res = scheduler.run(
                tasks,
                store,
                jobs=n_jobs,
                reporter=rep,
                keep_going=keep_going,
                force=force,
                log_dir=Path(s.cache_dir) / "logs",
                plan_s=plan_s,
                settings=s,
                remote=remote,
                executor=ex,
            )
    except ExecutorError as e:
        raise Fail(f"error: {e}") from None
    finally:
        if old_term in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if remote is not None:
            remote.record(Path(s.cache_dir))
            remote.close()
    if trace:
        scheduler.write_trace(trace, res, res.t0)
        res.trace_path = str(trace)
    display.print_summary(con, res)
    if trace:
        con.print(f"trace: {trace} (open in ui.perfetto.dev)", markup=False)
    if as_json:
        emit_json(res.to_json())
    if res.interrupted:
        return 130
    return 0 if res.ok else 1


def _remote(s, *, strict: bool = False):
    """The remote tier configured for this command, or None. In a build, a bad
    remote configuration is one warning (the build goes on without it)."""
    if not s.remote_url:
        return None
    from quack.remote import tier

    return tier.from_settings(s, strict=strict)


def _term_to_interrupt(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt


# --- cache stats / clean -------------------------------------------------------


@cache_app.command("stats")
def cache_stats(
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    cache_dir: Optional[Path] = cache_dir_option(),
    top: int = typer.Option(10, "--top", min=0, help="How many of the slowest compiles to list."),
):
    """Entries and bytes per fingerprint (current vs stale) and kernel; usage from the journal."""
    _run(lambda: _common.stats(as_json, cache_dir, top))


@cache_app.command("clean")
def cache_clean(
    remove_all: bool = typer.Option(False, "--all", help="Remove every entry (entries in use are skipped)."),
    max_size: Optional[str] = typer.Option(
        None, "--max-size", help="Shrink to this size, least recently used first (e.g. 5G)."
    ),
    older_than: Optional[str] = typer.Option(
        None, "--older-than", help="Remove entries unused for this long (e.g. 30d, 12h)."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="Show what would be removed."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    cache_dir: Optional[Path] = cache_dir_option(),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="List every file removed."),
):
    """Remove stale fingerprints, quarantined entries and debris (safe while the cache is in use)."""
    _run(lambda: _clean(remove_all, max_size, older_than, dry_run, as_json, cache_dir, verbose))


def _clean(remove_all, max_size, older_than, dry_run, as_json, cache_dir, verbose) -> int:
    from quack_build import cacheclean, units

    try:
        ms = units.parse_size(max_size) if max_size is not None else None
        age = units.parse_age(older_than) if older_than is not None else None
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    s = cli_settings(cache_dir)
    _common.check_root(s.cache_dir)
    load_kernels(s, required=False)
    con = console(to_stderr=as_json)
    if not Path(s.cache_dir).is_dir():
        if as_json:
            emit_json({"removed": 0, "freed_bytes": 0, "busy": 0, "dry_run": dry_run})
        else:
            con.print(f"cache {s.cache_dir} does not exist: nothing to clean", markup=False)
        return 0

    def log(r):
        if verbose:
            con.print(
                f"{'would remove' if dry_run else 'removed'} {r.path} ({r.why})", markup=False, soft_wrap=True
            )

    rep = cacheclean.clean(
        s.cache_dir,
        current_srcfps(),
        remove_all=remove_all,
        max_size=ms,
        older_than=age,
        dry_run=dry_run,
        log=log,
    )
    by_why: dict = {}
    for r in rep.removed:
        d = by_why.setdefault(r.why, [0, 0])
        d[0] += 1
        d[1] += r.bytes
    if as_json:
        emit_json(
            {
                "dry_run": dry_run,
                "removed": len(rep.removed),
                "freed_bytes": rep.freed,
                "by_reason": {k: {"files": v[0], "bytes": v[1]} for k, v in by_why.items()},
                "busy": [str(p) for p, _ in rep.busy],
                "errors": [f"{p}: {e}" for p, e in rep.errors],
            }
        )
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


@cache_app.command("pull")
def cache_pull(
    manifests: List[Path] = manifests_argument(),
    arch: List[str] = typer.Option(
        None, "--arch", help="For this arch instead of the manifests' (repeatable)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    cache_dir: Optional[Path] = cache_dir_option(),
    max_configs: int = max_configs_option(),
):
    """Fetch the manifests' configurations missing locally from the remote cache (signatures verified)."""
    _run(lambda: _sync("pull", manifests or [], arch or [], as_json, cache_dir, max_configs))


@cache_app.command("push")
def cache_push(
    manifests: List[Path] = manifests_argument(),
    arch: List[str] = typer.Option(
        None, "--arch", help="For this arch instead of the manifests' (repeatable)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    cache_dir: Optional[Path] = cache_dir_option(),
    max_configs: int = max_configs_option(),
):
    """Sign and upload the manifests' configurations from the local cache to the remote (needs write = true and a signing key)."""
    _run(lambda: _sync("push", manifests or [], arch or [], as_json, cache_dir, max_configs))


def _sync(what, manifests, arch, as_json, cache_dir, max_configs) -> int:
    from quack.errors import KeyFileError
    from quack_build import remote_sync

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
    load_kernels(s)
    exp = _expand(s, manifests, arch, max_configs)
    con = console(to_stderr=as_json)
    try:
        remote = _remote(s, strict=True)
    except (ValueError, KeyFileError, ImportError) as e:
        raise Fail(f"error: remote cache: {e}") from None
    store = _store(s)
    try:
        fn = remote_sync.pull_configs if what == "pull" else remote_sync.push_configs
        rep = fn(exp.configs, store, remote)
    finally:
        remote.record(Path(s.cache_dir))
        remote.close()
    if as_json:
        emit_json(rep.to_json())
    else:
        c = rep.counters
        if what == "pull":
            con.print(
                f"pulled {rep.pulled} of {rep.total} from {rep.url} ({rep.local} already local, "
                f"{rep.missing} not available; {c.get('rejected', 0)} refused) in {rep.wall_s:.2f}s",
                markup=False,
            )
        else:
            con.print(
                f"pushed {rep.pushed} of {rep.total} to {rep.url} ({rep.exists} already there, "
                f"{rep.missing} not in the local cache, {rep.failed} failed) in {rep.wall_s:.2f}s",
                markup=False,
            )
        if rep.offline:
            con.print(f"error: the remote {rep.url} is unreachable", markup=False)
    return 1 if rep.offline or rep.failed else 0


# --- verify ----------------------------------------------------------------------


@app.command()
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
        from quack_build import bundlecmd

        _run(lambda: bundlecmd.run_verify_bundles(as_json, cache_dir, no_load, run))
    _run(lambda: _verify(manifests or [], arch or [], run, no_load, as_json, cache_dir, max_configs))


def _verify(manifests, arch, run, no_load, as_json, cache_dir, max_configs) -> int:
    from quack_build import verify as v

    s = cli_settings(cache_dir, manifests=manifests)
    load_kernels(s)
    exp = _expand(s, manifests, arch, max_configs)
    con = console(to_stderr=as_json)
    from quack.errors import CacheError

    try:
        res = v.verify(exp.configs, _store(s), load=not no_load, run=run, console=None if as_json else con)
    except CacheError as e:  # an unsafe root: refused like build, stats and clean do
        raise Fail(f"error: {e}") from None
    if as_json:
        emit_json(res)
    else:
        v.print_report(con, res)
    return 0 if res["ok"] else 1


# --- keygen ----------------------------------------------------------------------


@app.command()
def keygen(
    name: str = typer.Argument(
        ..., help="Key name, e.g. ci-1 (travels with every signature; use a new one to rotate)."
    ),
    out_dir: Path = typer.Option(Path("."), "--out-dir", "-o", help="Directory for NAME.key and NAME.pub."),
):
    """Create an Ed25519 signing key pair: NAME.key (private, mode 0600) and NAME.pub (give to readers)."""
    _run(lambda: _keygen(name, out_dir))


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


@app.command()
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
    _run(lambda: _prewarm(since, top, emit_manifest, jobs, dry_run, as_json, cache_dir))


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
        _store(s),
        since_s=age,
        top=top,
        emit_manifest=emit_manifest,
        jobs=s.effective_jobs(jobs),
        dry_run=dry_run,
        as_json=as_json,
        console=con,
        emit_json=emit_json,
    )


# --- bundle ------------------------------------------------------------------------

from quack_build import bundlecmd as _bundlecmd  # noqa: E402 - registers on the app defined above

_bundlecmd.register(app, _run, _build, _expand, _store)
