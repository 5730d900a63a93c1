"""The ``quack`` console script: build, verify, prewarm, cache stats|clean.

Exit status: 0 success; 1 a problem (invalid manifest or settings, a failed
compile, a missing or broken entry); 2 a usage error; 130 interrupted (Ctrl-C, SIGINT);
143 terminated (SIGTERM); 129 hung up (SIGHUP). The three signals are handled from the first line of ``main`` on
(quack_build.build.interrupts): any phase ends within a few seconds, no process left behind.

``quack cache stats [--json]`` takes a fast path that does not import typer
(nor, like every command here, cutlass or torch): it is meant to be cheap
enough to run from scripts and prompts. Everything else goes through the typer
app in quack_build.cli.app."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from quack_build.build import interrupts

    # Installed for the rest of the process, interpreter exit included: that is where a
    # thread stuck in a blocking call is joined (the watchdog ends that wait).
    interrupts.install()
    try:
        _main(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as e:
        if interrupts.received() is None:
            raise
        sys.exit(interrupts.exit_code(e.code))
    except KeyboardInterrupt:
        # Interrupted outside a command's body (imports, argument parsing): no traceback.
        print("interrupted", file=sys.stderr)
        sys.exit(interrupts.exit_code(130))
    sys.exit(interrupts.exit_code(0))


def _main(args: list[str]) -> None:
    if args[:2] == ["cache", "stats"] and set(args[2:]) <= {"--json"}:
        # Stats is not a typer command here, so warnings print plainly.
        import warnings

        warnings.simplefilter("ignore")
        from quack_build.cli.context import stats_fast

        sys.exit(stats_fast("--json" in args[2:]))
    if args[:2] == ["bundle", "inspect"]:
        # `quack bundle` takes manifests, so `inspect` can't be a click subcommand of it.
        args = ["bundle-inspect", *args[2:]]
    from quack_build.cli.app import app

    app(args)


if __name__ == "__main__":  # pragma: no cover
    main()
