"""``quack build``: expand the manifests, plan, compile what is missing through the chosen
executor, print the summary (``--json``, ``--trace``); ``--dry-run`` goes to
quack_build.cli.dry_run. Registered on the typer app by quack_build.cli.app (``register``)."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from quack_build.cli import argcheck
from quack_build.cli.context import Fail, cli_settings, console, emit_json, load_kernels, store_fail
from quack_build.cli.options import cache_dir_option, gpu_option, manifests_argument, max_configs_option
from quack_build.cli.run import (
    expand_manifests,
    local_store,
    manifest_paths,
    remote_tier,
    run_command,
    tune_models,
)


def register(app: typer.Typer) -> None:
    app.command()(build)


def build(
    manifests: List[Path] = manifests_argument(),
    jobs: Optional[int] = typer.Option(
        None,
        "--jobs",
        "-j",
        min=1,
        help="Compile workers, at least 1 (default: [build] jobs, else [runtime] compile_jobs, else CPU count).",
    ),
    arch: List[str] = typer.Option(
        None,
        "--arch",
        callback=argcheck.arch_option,
        help="Build for this arch instead of the manifests' (repeatable).",
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
    verbose: bool = typer.Option(
        False,
        "--verbose",
        "-v",
        help="Also list cached and started keys, and the files and distributions each kernel's "
        "fingerprint covers.",
    ),
    executor: Optional[str] = typer.Option(
        None,
        "--executor",
        callback=argcheck.executor_option,
        help="Where to compile: local (default: this host's worker pool), ray (a Ray instance started "
        "for the build), auto (the running Ray cluster, or RAY_ADDRESS), ray://HOST:PORT or "
        "HOST:PORT (a Ray cluster). Default: [build] executor / QUACK_BUILD_EXECUTOR.",
    ),
    gpu: List[str] = gpu_option(),
):
    """Compile the manifests' configurations into the cache, in parallel."""
    run_command(
        lambda: run_build(
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
            gpus=gpu or [],
        )
    )


def run_build(
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
    outcome="nothing was built",
    gpus=(),
) -> int:
    t0 = time.time()
    if trace is not None:
        # Checked before anything is built: a bad path used to end a whole build in a traceback.
        if dry_run:
            raise Fail(
                "error: --trace records a build and --dry-run builds nothing: give one of them", code=2
            )
        why = argcheck.output_file_problem(trace, "trace.json")
        if why:
            raise Fail(f"error: --trace {trace}: {why}", code=2)
    s = cli_settings(cache_dir, jobs, executor, manifests)
    load_kernels(s)
    con = console(to_stderr=as_json)
    if dry_run:
        from quack_build.cli import dry_run as dryrun

        paths = manifest_paths(s, manifests)
        store = local_store(s)
        return dryrun.run(
            s,
            paths,
            arch=arch,
            max_configs=max_configs,
            store=store,
            con=con,
            force=force,
            as_json=as_json,
            verbose=verbose,
            gpus=gpus,
        )
    exp = expand_manifests(s, manifests, arch, max_configs, outcome, gpus)
    for w in exp.warnings:
        con.print(f"warning: {w}", markup=False)
    if verbose:
        from quack_build.cli import sourcelist

        sourcelist.print_sources(con, (c.kernel for c in exp.configs))
    return build_configs(
        s, con, exp.configs, jobs, keep_going, force, as_json, trace, verbose, t0=t0, gpus=gpus
    )


def build_configs(
    s, con, configs, jobs, keep_going, force, as_json, trace=None, verbose=False, t0=None, gpus=()
) -> int:
    """Build ``configs`` (BuildConfigs) into the cache through the scheduler and the
    configured executor, with the progress display and summary: ``quack build``'s body
    after its manifests are expanded (``quack tune --compile-only`` builds candidates with
    it). Returns the exit status."""
    from quack.errors import CacheError, ExecutorError
    from quack_build.build import executors, scheduler
    from quack_build.build import plan as planning
    from quack_build.build import progress as display
    from quack_build.build import trace as tracing

    t0 = time.time() if t0 is None else t0
    store = local_store(s)
    try:
        tasks = planning.plan(configs, store, force=force)
    except (CacheError, OSError) as e:
        raise store_fail(s, e) from None
    plan_s = time.time() - t0
    n_jobs = s.effective_jobs(jobs)
    try:
        ex = executors.create(s, jobs=jobs or s.jobs or None, store=store)
    except ExecutorError as e:
        raise Fail(f"error: {e}") from None
    rep = display.make_reporter(con, verbose=verbose)
    remote = remote_tier(s)
    # --json: stdout carries the JSON only; what others print there meanwhile (Ray's driver
    # prints its cluster's error messages on sys.stdout) goes to stderr.
    quiet_stdout = contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()
    try:
        with quiet_stdout:
            res = scheduler.BuildSession(
                tasks,
                store,
                scheduler.BuildOptions(
                    jobs=n_jobs,
                    reporter=rep,
                    keep_going=keep_going,
                    force=force,
                    log_dir=Path(s.cache_dir) / "logs",
                    plan_s=plan_s,
                    settings=s,
                    remote=remote,
                    executor=ex,
                ),
            ).run()
    except ExecutorError as e:
        raise Fail(f"error: {e}") from None
    finally:
        if remote is not None:
            remote.record(Path(s.cache_dir))
            remote.close()
    res.tune_gpu = tune_models(gpus)
    trace_error = ""
    if trace:
        try:
            tracing.write_trace(trace, res, res.t0)
            res.trace_path = str(trace)
        except OSError as e:  # checked before the build, yet removed or filled since
            trace_error = f"error: --trace {trace}: cannot write the trace ({e.strerror or e}); the build itself is done"
    display.print_summary(con, res)
    if res.trace_path:
        con.print(f"trace: {trace} (open in ui.perfetto.dev)", markup=False)
    if trace_error:
        typer.echo(trace_error, err=True)
    if as_json:
        emit_json(res.to_json())
    if res.interrupted:
        return 130  # 143 after SIGTERM: quack_build.cli.main.main maps it (quack_build.build.interrupts)
    return 0 if res.ok and not trace_error else 1
