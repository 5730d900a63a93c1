"""``quack keygen``: create an Ed25519 signing key pair (quack.signing)."""

from __future__ import annotations

from pathlib import Path

import typer

from quack_build.cli.context import Fail
from quack_build.cli.run import run_command


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
    from quack_build.cli.argcheck import out_dir_problem

    why = out_dir_problem(out_dir)  # a file there gave a bare "[Errno 17] File exists"
    if why:
        raise Fail(f"error: --out-dir {out_dir}: {why}", code=2)
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
