"""The typer application behind ``quack`` (entry point: quack_build.cli.main), and only
the registration of its commands, in the order ``quack --help`` lists them: build,
verify, keygen, prewarm, bundle, tune, then the ``cache`` group (stats, clean, pull, push).
Each command lives in its own module here; what they share is quack_build.cli.run
(running a command's body) and quack_build.cli.context (settings, consoles, JSON).

Exit status: 0 success; 1 a problem (invalid manifest or settings, a failed
compile, a missing or broken entry); 2 a usage error (typer's own); 130
interrupted. Heavy modules load inside commands: ``quack cache stats`` never
imports cutlass or torch."""

from __future__ import annotations

import typer

from quack_build.cli import build, bundle, cache, keygen, prewarm, tune, verify

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

build.register(app)
app.command()(verify.verify)
app.command()(keygen.keygen)
app.command()(prewarm.prewarm)
bundle.register(app)
tune.register(app)
cache.register(cache_app)
