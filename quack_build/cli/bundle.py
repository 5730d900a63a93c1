"""``quack bundle`` and ``quack bundle inspect``.

Registered on the typer app by quack_build.cli.app (``register``). ``quack bundle
inspect WHEEL`` is routed by quack_build.cli.main to the hidden ``bundle-inspect``
command, since a command can't both take manifests and have subcommands."""

from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional

import typer

from quack_build.cli import argcheck
from quack_build.cli.build import run_build
from quack_build.cli.context import Fail, cli_settings, console, emit_json, load_kernels
from quack_build.cli.options import cache_dir_option, gpu_option, manifests_argument, max_configs_option
from quack_build.cli.run import expand_manifests, local_store, run_command, tune_models


def register(app: typer.Typer) -> None:
    """Add the bundle commands to ``app``."""

    @app.command("bundle")
    def bundle(
        manifests: List[Path] = manifests_argument(),
        name: str = typer.Option(..., "--name", help="Bundle (distribution) name, e.g. myapp-kernels."),
        version: str = typer.Option("0.1.0", "--version", help="Bundle version (PEP 440)."),
        arch: List[str] = typer.Option(
            None,
            "--arch",
            callback=argcheck.arch_option,
            help="Build for this arch instead of the manifests' (repeatable).",
        ),
        out: Path = typer.Option(Path("dist"), "--out", "-o", help="Directory for the wheel."),
        sign: bool = typer.Option(False, "--sign", help="Sign the index (Ed25519) with the signing key."),
        signing_key: Optional[Path] = typer.Option(
            None,
            "--signing-key",
            help="Private key file (default: QUACK_SIGNING_KEY / [remote] signing_key).",
        ),
        jobs: Optional[int] = typer.Option(
            None, "--jobs", "-j", min=1, help="Compile workers for what is missing."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print a JSON result on stdout."),
        cache_dir: Optional[Path] = cache_dir_option(),
        max_configs: int = max_configs_option(),
        gpu: List[str] = gpu_option(),
    ):
        """Build what is missing, then write a wheel of the manifests' prebuilt kernels.
        (`quack bundle inspect WHEEL` shows a wheel's contents without installing it.)"""
        run_command(
            lambda: _bundle(
                manifests or [],
                name,
                version,
                arch or [],
                out,
                sign,
                signing_key,
                jobs,
                as_json,
                cache_dir,
                max_configs,
                gpu or [],
            )
        )

    @app.command("bundle-inspect", hidden=True)
    def bundle_inspect(
        wheel: Path = typer.Argument(..., help="A bundle wheel."),
        as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ):
        """Print a bundle wheel's contents and check them, without installing it."""
        run_command(lambda: _inspect(wheel, as_json))


def _bundle(
    manifests,
    name,
    version,
    arch,
    out,
    sign,
    signing_key,
    jobs,
    as_json,
    cache_dir,
    max_configs,
    gpus=(),
) -> int:
    from quack_build.bundle import wheel as bw

    for flag, check, value in (("--name", bw.check_new_name, name), ("--version", bw.check_version, version)):
        try:
            check(value)
        except ValueError as e:
            raise Fail(f"error: {flag}: {e}", code=2) from None
    # Before the build: a file in the way of --out was found only once everything was built.
    why = argcheck.out_dir_problem(out)
    if why:
        raise Fail(f"error: --out {out}: {why}", code=2)
    key = None
    if sign or signing_key:
        from quack import signing
        from quack.errors import KeyFileError

        s0 = cli_settings(cache_dir, jobs, manifests=manifests)
        try:
            key = (
                signing.load_signing_key(signing_key)
                if signing_key
                else signing.signing_key_from_settings(s0)
            )
        except KeyFileError as e:
            raise Fail(f"error: {e}") from None
        if key is None:
            raise Fail(
                "error: --sign needs a signing key: --signing-key FILE, QUACK_SIGNING_KEY or "
                "[remote] signing_key in quack.toml (create one with `quack keygen NAME`)"
            )
    t0 = time.time()
    import contextlib
    import sys

    # With --json, stdout carries only the bundle's result: the build step reports on stderr.
    with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
        rc = run_build(
            manifests, jobs, arch, False, False, False, False, None, cache_dir, max_configs, False,
            outcome="no bundle written", gpus=gpus,
        )  # fmt: skip
    if rc:
        raise Fail(f"error: building the manifests failed (exit {rc}); no bundle written", code=rc)
    build_s = time.time() - t0
    s = cli_settings(cache_dir, jobs, manifests=manifests)
    load_kernels(s)
    exp = expand_manifests(s, manifests, arch, max_configs, "no bundle written", gpus)
    from quack.errors import BundleError

    files, problems = bw.collect(exp.configs, local_store(s))
    if problems:
        raise Fail("error: " + "\n".join(problems) + "\nno bundle written")
    tuned = tune_models(gpus)  # whose tuning rows chose the entries' configurations (as the build's)
    try:
        path, idx = bw.write_wheel(
            files, name=name, version=version, out_dir=out, signing_key=key, tune_gpu=tuned
        )
    except BundleError as e:
        raise Fail(f"error: {e}") from None
    except OSError as e:
        raise Fail(f"error: cannot write the wheel into {out}: {e.strerror or e}") from None
    res = {
        "wheel": str(path),
        "name": name,
        "version": idx.version,
        "entries": len(idx.entries),
        "with_so": sum(1 for f in files if f.so is not None),
        "bytes": idx.bytes,
        "wheel_bytes": path.stat().st_size,
        "stamps": idx.stamps,
        "tune_gpu": {"models": list(tuned[0]), "source": tuned[1]},
        "signed_by": key.name if key else "",
        "build_s": round(build_s, 3),
        "seconds": round(time.time() - t0, 3),
    }
    if as_json:
        emit_json(res)
    else:
        from quack_build.cachedir.units import human_bytes

        console().print(
            f"wrote {path}: {res['entries']} kernels ({res['with_so']} with a linked .so), "
            f"{human_bytes(res['wheel_bytes'])}, {', '.join(res['stamps'])}"
            + (f", signed by {key.name}" if key else "")
            + f"\ntuned for {'GPU ' + ', '.join(tuned[0]) if tuned[0] else 'each table default GPU'} "
            f"({tuned[1]}): processes on another GPU model ask for other configurations"
            + f"\ninstall it with: pip install {path}",
            markup=False,
            soft_wrap=True,
        )
    return 0


def _inspect(wheel: Path, as_json: bool) -> int:
    from quack.bundles import trust
    from quack.errors import BundleError, KeyFileError
    from quack_build.bundle import inspect as bundle_inspect

    s = cli_settings(None)
    try:
        trusted = trust.trusted_keys(s)
    except KeyFileError as e:
        raise Fail(f"error: {e}") from None
    try:
        info = bundle_inspect.inspect_wheel(wheel, trusted)
    except BundleError as e:
        raise Fail(f"error: {e}") from None
    if as_json:
        emit_json(info)
        return 0 if info["ok"] else 1
    from rich.markup import escape
    from rich.table import Table

    from quack_build.cachedir.units import human_bytes
    from quack_build.manifest.config import format_params

    con = console()
    sig = (
        f"signed by {info['signer']}" + (" (verified)" if trusted is not None and info["ok"] else "")
        if info["signed"]
        else "unsigned"
    )
    con.print(
        f"{info['wheel']}: bundle {info['name']} {info['version']} (package {info['package']}), "
        f"{len(info['entries'])} entries, {human_bytes(info['bytes'])} of objects, "
        f"{human_bytes(info['wheel_bytes'])} wheel, {sig}"
        + (
            f", tuned for {'GPU ' + ', '.join(tg['models']) if tg['models'] else 'each table default GPU'} "
            f"({tg['source']})"
            if (tg := info["tune_gpu"])
            else ""
        ),
        markup=False,
        soft_wrap=True,
    )
    tb = Table(header_style="bold")
    for c in ("kernel", "params", "arch", "key", "stamp", "object", ".so", "ok"):
        tb.add_column(c)
    for r in info["entries"]:
        # Every cell is the wheel's data, escaped: a table cell is Rich markup, and a
        # params value "[/]" in index.json crashed inspect with a MarkupError traceback.
        cells = (
            r["kernel"],
            format_params(r["params"]),
            r["arch"],
            r["key"][:12],
            r["stamp"] + ("" if r["current_stamp"] else " (not this toolchain)"),
            human_bytes(r["size"]),
            human_bytes(r["so_size"]) if r["so_size"] else "-",
            "yes" if not r["problems"] else "; ".join(r["problems"]),
        )
        tb.add_row(*(escape(str(c)) for c in cells))
    con.print(tb)
    for p in info["problems"]:
        con.print(f"problem: {p}", markup=False, soft_wrap=True)
    return 0 if info["ok"] else 1
