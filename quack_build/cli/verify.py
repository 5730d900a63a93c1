"""``quack verify``: every configuration present, intact, loadable, for the right arch
(the check itself is quack_build.verify.manifest; ``--bundles`` quack_build.verify.bundles)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from quack_build.cli import argcheck
from quack_build.cli.context import Fail, cache_fail, cli_settings, console, emit_json, load_kernels
from quack_build.cli.options import cache_dir_option, gpu_option, manifests_argument, max_configs_option
from quack_build.cli.run import expand_manifests, local_store, run_command

# The default -j's cap when only loading (CPU work: a fresh process dlopens each object).
MAX_DEFAULT_JOBS = 8
# The default -j with --run: the loaders share one GPU, and each pays its own imports and
# CUDA set-up. Over the shipped manifests (1,178 entries) on the H200, once the inputs were
# drawn on the GPU: 1 loader 9.7 s, 2 took 8.9 s, 3 took 8.1 s (an entry's ~6 ms is mostly
# host work: the launch, the reference's torch calls). Before that (inputs drawn on the
# CPU, copied over): 1 took 15.2 s, 4 took 17.9 s, 8 took 43.5 s. A given -j is kept.
RUN_DEFAULT_JOBS = 3


def verify(
    ctx: typer.Context,
    manifests: List[Path] = manifests_argument(),
    arch: List[str] = typer.Option(
        None,
        "--arch",
        callback=argcheck.arch_option,
        help="Verify for this arch instead of the manifests' (repeatable).",
    ),
    run: bool = typer.Option(False, "--run", help="GPU only: run each kernel against its reference."),
    no_load: bool = typer.Option(False, "--no-load", help="Skip the load test in a fresh process."),
    jobs: Optional[int] = typer.Option(
        None,
        "--jobs",
        "-j",
        min=1,
        help=f"Fresh loader processes at once, at least 1 (default: [build] jobs, else [runtime] compile_jobs, else CPU count, "
        f"at most {MAX_DEFAULT_JOBS}; with --run {RUN_DEFAULT_JOBS}: the loaders share one GPU).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    cache_dir: Optional[Path] = cache_dir_option(),
    max_configs: int = max_configs_option(),
    bundles: bool = typer.Option(
        False, "--bundles", help="Check the installed bundles instead of the cache."
    ),
    gpu: List[str] = gpu_option(),
):
    """Check every configuration: present, checksum intact, loads in a fresh process, right arch."""
    if bundles:
        run_command(lambda: _verify_bundles(as_json, cache_dir, no_load, run, jobs, _manifest_options(ctx)))
    run_command(
        lambda: _verify(
            manifests or [], arch or [], run, no_load, as_json, cache_dir, max_configs, jobs, gpu or []
        )
    )


def _verify(manifests, arch, run, no_load, as_json, cache_dir, max_configs, jobs, gpus=()) -> int:
    from quack_build.verify import manifest as v

    s = cli_settings(cache_dir, manifests=manifests)
    load_kernels(s)
    exp = expand_manifests(s, manifests, arch, max_configs, "nothing was verified", gpus)
    con = console(to_stderr=as_json)
    from quack.errors import CacheError

    try:
        res = v.verify(
            exp.configs,
            local_store(s),
            load=not no_load,
            run=run,
            console=None if as_json else con,
            jobs=_jobs(s, jobs, run),
        )
    except CacheError as e:  # an unsafe or unreachable root: refused like build, stats and clean do
        raise cache_fail(s, e) from None
    if as_json:
        emit_json(res)
    else:
        from quack_build.cli.verify_view import print_report

        print_report(con, res)
    return 0 if res["ok"] else 1


def _manifest_options(ctx: typer.Context) -> list[str]:
    """The manifest-only arguments given on the command line (manifests, --arch,
    --max-configs, --gpu): `verify --bundles m1.toml --arch sm_80` silently ignored all three."""
    names = {"manifests": "manifests", "arch": "--arch", "max_configs": "--max-configs", "gpu": "--gpu"}
    # Compared by name: typer carries its own copy of click, whose ParameterSource is not
    # click.core's (an explicit --max-configs is refused even at its default value).
    given = {n for n in names if getattr(ctx.get_parameter_source(n), "name", "DEFAULT") != "DEFAULT"}
    return [flag for n, flag in names.items() if n in given and ctx.params.get(n) not in (None, [], ())]


def _verify_bundles(as_json: bool, cache_dir, no_load: bool, run: bool, jobs, ignored=()) -> int:
    if ignored:
        raise Fail(
            f"error: --bundles checks the installed bundles, which take no "
            f"{' or '.join(filter(None, (', '.join(ignored[:-1]), ignored[-1])))} "
            f"(those select the cache's configurations): give --bundles alone, or leave it out "
            f"to verify the manifests",
            code=2,
        )
    s = cli_settings(cache_dir)
    load_kernels(s, required=False)
    from quack_build.cli.verify_view import print_bundle_report
    from quack_build.verify.bundles import verify_bundles

    res = verify_bundles(s, load=not no_load, run=run, jobs=_jobs(s, jobs, run))
    if as_json:
        emit_json(res)
    else:
        print_bundle_report(console(), res)
    return 0 if res["ok"] else 1


def _jobs(s, given: Optional[int], run: bool) -> int:
    if given:
        return given
    return RUN_DEFAULT_JOBS if run else min(MAX_DEFAULT_JOBS, s.effective_jobs(None))
