"""Rendering for ``quack verify``: the report on a manifest's configurations
(quack_build.verify.manifest) and on the installed bundles (quack_build.verify.bundles).
The checks return plain dicts (``--json`` prints them as they are); rich stays here."""

from __future__ import annotations


def print_report(con, res: dict) -> None:
    from rich.markup import escape

    bad = [r for r in res["entries"] if r["problems"]]
    if bad:
        con.print(_problems_table("quack verify: problems", bad))
    if res["note"]:
        con.print(f"[yellow]{escape(res['note'])}[/]")
    _local_memory(con, res["entries"])
    runs = res.get("reference_runs", 0)
    checks = (
        "present, checksum, arch"
        + (", loads in a fresh process" if res["loaded"] else "")
        + (f", {runs} reference run{'s' * (runs != 1)}" if res["ran"] else "")
    )
    if bad:
        verdict = f"[red]{len(bad)} with problems[/]"
    elif res["ok"]:
        verdict = "[green]all good[/]"
    else:  # no entry has a problem, yet --run ran no kernel (the note above says why): exit 1
        verdict = "[red]no problems found, but no kernel was run[/]"
    con.print(
        f"verified {res['total']} configurations ({checks}): {verdict}{_not_run(res)} in {res['seconds']:.1f}s",
        soft_wrap=True,  # one line, however many kernels it names
    )
    if res["ran"]:
        _slowest(con, res["entries"])


def print_bundle_report(con, res: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

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
        # Names, versions and signers come from the installed bundles' files: escaped,
        # as every cell here, since a table cell is Rich markup ("[/]" raised MarkupError).
        cells = (
            b["name"],
            b["version"],
            b["entries"],
            b["current"],
            b["other_toolchain"],
            b["signer"] or "-",
            "; ".join(b["problems"]) or "-",
        )
        tb.add_row(*(escape(str(c)) for c in cells))
    con.print(tb)
    for b in res["bundles"]:
        if b.get("gpu_note"):
            con.print(f"[yellow]bundle {escape(b['name'])}: {escape(b['gpu_note'])}[/]", soft_wrap=True)
    bad = [r for r in res["entries"] if r["problems"]]
    if bad:
        con.print(_problems_table("bundle entries with problems", bad, bundle=True))
    if res["note"]:
        con.print(f"[yellow]{escape(res['note'])}[/]")
    n = len(res["entries"])
    runs = res.get("reference_runs", 0)
    con.print(
        f"verified {n} bundle entries in {len(res['bundles'])} bundles"
        + (f" ({runs} reference run{'s' * (runs != 1)})" if runs else "")
        + ": "
        + (
            "[green]all good[/]"
            if res["ok"]
            else f"[red]{res['problems']} problems[/]"
            if res["problems"]
            else "[red]no problems found, but no kernel was run[/]"  # --run: the note says why
        )
        + _not_run(res)
        + f" in {res['seconds']:.1f}s",
        soft_wrap=True,
    )


def _not_run(res: dict) -> str:
    """ "; 4 not run: no reference hook (toy_scale)": what --run loaded but did not run, by
    why, with the kernels (markup-escaped); "" when nothing was left out."""
    from rich.markup import escape

    kernels: dict[str, set] = {}
    for r in res["entries"]:
        if r.get("run") not in (None, "ok", "failed"):
            kernels.setdefault(r["run"], set()).add(r["kernel"])
    parts = [
        f"{n} not run: {why} ({', '.join(sorted(kernels.get(why, ())))})"
        for why, n in res.get("not_run_why", {}).items()
    ]
    return escape("; " + "; ".join(parts)) if parts else ""


def _local_memory(con, entries: list[dict]) -> None:
    """The configurations whose kernels keep per-thread data in local memory (a stack
    frame: register spills or an array not kept in registers), largest frame first: each
    such access goes to cached DRAM instead of a register."""
    from rich.markup import escape

    from quack_build.manifest.config import format_params

    framed = [(max(k["frame_bytes"] for k in r["resources"]), r) for r in entries if r.get("resources")]
    framed = sorted(((f, r) for f, r in framed if f > 0), key=lambda fr: -fr[0])
    if not framed:
        return
    shown = "; ".join(
        f"{r['kernel']}({format_params(r['params'])}) {r['arch']}: {f} B" for f, r in framed[:5]
    )
    more = f" (and {len(framed) - 5} more; --json lists them)" if len(framed) > 5 else ""
    con.print(
        f"[yellow]{len(framed)} configuration{'s use' if len(framed) > 1 else ' uses'} local memory (a per-thread "
        f"stack frame: register spills or arrays not kept in registers; slower than registers): "
        f"{escape(shown)}{more}[/]",
        soft_wrap=True,
    )


def _slowest(con, entries: list[dict]) -> None:
    """Where a long ``--run`` went: its three slowest entries (each one's load and reference
    run, in its loader process)."""
    from rich.markup import escape

    from quack_build.manifest.config import format_params

    timed = sorted((r for r in entries if r.get("seconds")), key=lambda r: -r["seconds"])
    if len(timed) > 3:
        top = "; ".join(f"{r['kernel']}({format_params(r['params'])}) {r['seconds']:.2f}s" for r in timed[:3])
        con.print("slowest: " + escape(top), soft_wrap=True)


def _problems_table(title: str, bad: list[dict], *, bundle: bool = False):
    """The entries with problems, a row each (``bundle``: led by the bundle's name)."""
    from rich.markup import escape
    from rich.table import Table

    from quack_build.manifest.config import format_params

    tb = Table(title=title, header_style="bold")
    for col in ("bundle",) * bundle + ("kernel", "params", "arch", "key"):
        tb.add_column(col)
    tb.add_column("problem", overflow="fold")  # a path longer than the column wraps, never "…"
    for r in bad:
        cells = [
            *([r["bundle"]] if bundle else []),
            r["kernel"],
            format_params(r["params"]),  # a bundle's params are its index's: "[/]" crashed
            r["arch"],
            r["key"][:12],
            "; ".join(r["problems"]),
        ]
        tb.add_row(*(escape(str(c)) for c in cells))
    return tb
