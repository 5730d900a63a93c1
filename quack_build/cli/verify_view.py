"""Rendering for ``quack verify``: the report on a manifest's configurations
(quack_build.verify.manifest) and on the installed bundles (quack_build.verify.bundles).
The checks return plain dicts (``--json`` prints them as they are); rich stays here."""

from __future__ import annotations


def print_report(con, res: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    from quack_build.manifest.config import format_params

    bad = [r for r in res["entries"] if r["problems"]]
    if bad:
        tb = Table(title="quack verify: problems", header_style="bold")
        for col in ("kernel", "params", "arch", "key", "problem"):
            tb.add_column(col)
        for r in bad:
            tb.add_row(
                r["kernel"],
                format_params(r["params"]),
                r["arch"],
                r["key"][:12],
                escape("; ".join(r["problems"])),
            )
        con.print(tb)
    if res["note"]:
        con.print(f"[yellow]{escape(res['note'])}[/]")
    checks = (
        "present, checksum, arch"
        + (", loads in a fresh process" if res["loaded"] else "")
        + (", reference run" if res["ran"] else "")
    )
    con.print(
        f"verified {res['total']} configurations ({checks}): "
        + ("[green]all good[/]" if not bad else f"[red]{len(bad)} with problems[/]")
        + f" in {res['seconds']:.1f}s"
    )


def print_bundle_report(con, res: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    from quack_build.manifest.config import format_params

    if not res["bundles"]:
        con.print(f"[red]{escape(res['note'])}[/]")
        return
    tb = Table(title="installed bundles", header_style="bold")
    for c in (
        "bundle",
        "version",
        "entries",
        "this toolchain+arch",
        "other toolchains/archs",
        "signed by",
        "problem",
    ):
        tb.add_column(c)
    for b in res["bundles"]:
        tb.add_row(
            b["name"],
            b["version"],
            str(b["entries"]),
            str(b["current"]),
            str(b["other_toolchain"]),
            b["signer"] or "-",
            escape("; ".join(b["problems"])) or "-",
        )
    con.print(tb)
    bad = [r for r in res["entries"] if r["problems"]]
    if bad:
        tb = Table(title="bundle entries with problems", header_style="bold")
        for c in ("bundle", "kernel", "params", "arch", "key", "problem"):
            tb.add_column(c)
        for r in bad:
            tb.add_row(
                r["bundle"],
                r["kernel"],
                format_params(r["params"]),
                r["arch"],
                r["key"][:12],
                escape("; ".join(r["problems"])),
            )
        con.print(tb)
    if res["note"]:
        con.print(f"[yellow]{escape(res['note'])}[/]")
    n = len(res["entries"])
    con.print(
        f"verified {n} bundle entries in {len(res['bundles'])} bundles: "
        + ("[green]all good[/]" if res["ok"] else f"[red]{res['problems']} problems[/]")
        + f" in {res['seconds']:.1f}s"
    )
