"""Rendering for ``quack cache stats``.

Every table cell and markup line that holds data read from the cache escapes it
(``escape``): directory names, the journal's kernels and params, bundle indexes, the
remote's URL are anyone's text, and a ``[/]`` in them raised Rich's MarkupError, a
traceback instead of the report."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from quack_build.cachedir.units import human_bytes


def print_stats(con: Console, info: dict) -> None:
    """``quack cache stats``: the totals line, then a section for each part of ``info``
    that has something to show (each section prints nothing when it is empty)."""
    _print_totals(con, info)
    _print_fingerprints(con, info)
    _print_bundles(con, info)
    _print_kernels(con, info)
    _print_slowest(con, info.get("journal", {}))
    _print_remote(con, info.get("remote") or {})
    _print_debris(con, info)
    _print_planted(con, info)
    _print_stale_hint(con, info)


def _print_totals(con: Console, info: dict) -> None:
    """The one-line summary: entries, bytes, current / stale / unregistered."""
    t = info["totals"]
    con.print(
        f"cache {info['root']}: {t['entries']} entries, {human_bytes(t['bytes'])} "
        f"({t['current_entries']} current, {t['stale_entries']} stale, "
        f"{t['unknown_entries']} of kernels not registered here)",
        markup=False,
    )


def _print_fingerprints(con: Console, info: dict) -> None:
    """Entries by toolchain stamp and source fingerprint, with their status."""
    if info["fingerprints"]:
        tb = Table(title="per toolchain stamp / source fingerprint", header_style="bold")
        for c in ("stamp", "kernel", "srcfp", "status", "entries", "bytes"):
            tb.add_column(c, justify="right" if c in ("entries", "bytes") else "left")
        for f in info["fingerprints"]:
            st = {"current": "[green]current[/]", "stale": f"[yellow]stale[/] ({escape(str(f['why']))})"}.get(
                f["status"], f"[dim]{escape(str(f['status']))}[/]"
            )
            tb.add_row(
                *(escape(str(c)) for c in (f["stamp"], f["kernel"], f["srcfp"])),
                st,
                str(f["entries"]),
                human_bytes(f["bytes"]),
            )
        con.print(tb)


def _print_bundles(con: Console, info: dict) -> None:
    """The installed bundles (the read-only tier after this cache) and their status."""
    if info.get("bundles"):
        tb = Table(title="installed bundles (read-only tier after this cache)", header_style="bold")
        for c in ("bundle", "version", "entries", "bytes", "stamps", "status"):
            tb.add_column(c, justify="right" if c in ("entries", "bytes") else "left")
        for b in info["bundles"]:
            if b["problem"]:
                st = f"[red]refused[/] ({escape(str(b['problem']))})"
            elif b["current"]:
                st = "[green]current[/]" + (
                    f" ({b['current_entries']} for this toolchain and arch)"
                    if b["current_entries"] != b["entries"]
                    else ""
                )
            else:
                st = "[yellow]not for this toolchain or arch[/] (ignored)"
            tb.add_row(
                escape(str(b["name"])),
                escape(str(b["version"])),
                str(b["entries"]),
                human_bytes(b["bytes"]),
                escape(", ".join(map(str, b["stamps"]))),
                st,
            )
        con.print(tb)


def _print_kernels(con: Console, info: dict) -> None:
    """Entries and journal counts by kernel (registered here or seen in the journal)."""
    j = info.get("journal", {})
    kernels = sorted(set(info["kernels"]) | set(j.get("kernels", {})))
    if kernels:
        tb = Table(title="per kernel", header_style="bold")
        # Compiles counted where they happened: `quack build` and run time (a miss compiled
        # by a worker for the calling process); "waited" = misses another process compiled.
        for c in (
            "kernel",
            "current",
            "stale",
            "bytes",
            "hits",
            "misses",
            "compiles build/run",
            "compile s build/run",
            "waited",
        ):
            tb.add_column(c, justify="left" if c == "kernel" else "right")
        for k in kernels:
            e = info["kernels"].get(k, {"current": 0, "stale": 0, "unknown": 0, "bytes": 0})
            u = j.get("kernels", {}).get(k, {})
            bc, bs = u.get("build_compiles", 0), u.get("build_compile_s", 0.0)
            tb.add_row(
                escape(str(k)),  # the journal's kernel names: anyone's text
                str(e["current"] + e.get("unknown", 0)),
                str(e["stale"]),
                human_bytes(e["bytes"]),
                str(u.get("hits", 0)),
                str(u.get("misses", 0)),
                f"{bc}/{u.get('compiles', 0) - bc}",
                f"{bs:.1f}/{u.get('compile_s', 0.0) - bs:.1f}",
                str(u.get("waits", 0)),
            )
        con.print(tb)


def _print_slowest(con: Console, j: dict) -> None:
    """The journal's slowest compiles."""
    if j.get("slowest"):
        tb = Table(title="slowest compiles (journal)", header_style="bold")
        for c in ("kernel", "params", "arch", "where", "seconds"):
            tb.add_column(c, justify="right" if c == "seconds" else "left")
        for r in j["slowest"]:
            params = " ".join(f"{a}={b}" for a, b in (r.get("params") or {}).items())
            cells = (r["kernel"], params, r.get("arch"), r.get("where", "run"))
            tb.add_row(*(escape(str(c)) for c in cells), f"{r['compile_s']:.2f}")
        con.print(tb)


def _print_debris(con: Console, info: dict) -> None:
    """Leftovers `quack cache clean` removes: temp files, objects without metadata, quarantine."""
    d = info["debris"]
    if any(d.values()):
        con.print(
            f"debris: {d['tmp_files']} orphaned temp files ({human_bytes(d['tmp_bytes'])}), "
            f"{d['orphan_objects']} objects without metadata ({human_bytes(d['orphan_bytes'])}), "
            f"{d.get('orphan_so_files', 0)} .so without .so.json ({human_bytes(d.get('orphan_so_bytes', 0))}), "
            f"{d['quarantined_files']} quarantined files ({human_bytes(d['quarantined_bytes'])}), "
            f"{d.get('scratch_files', 0)} temp files of killed links "
            f"({human_bytes(d.get('scratch_bytes', 0))}); "
            f"`quack cache clean` removes them",
            markup=False,
        )


def _print_planted(con: Console, info: dict) -> None:
    """Links and other entries planted in the cache (never followed)."""
    planted = info.get("planted") or []
    if planted:
        con.print(
            f"planted in the cache ({len(planted)}; quack never follows or uses them, "
            f"`quack cache clean` removes them):",
            markup=False,
        )
        for x in planted[:20]:
            con.print(f"  {x['what']}: {x['path']}", markup=False, soft_wrap=True)
        if len(planted) > 20:
            con.print(f"  ... and {len(planted) - 20} more", markup=False)


def _print_stale_hint(con: Console, info: dict) -> None:
    """How much is stale, and the command that removes it."""
    t = info["totals"]
    if t["stale_entries"]:
        con.print(
            f"{t['stale_entries']} stale entries ({human_bytes(t['stale_bytes'])}): "
            f"`quack cache clean` removes them",
            markup=False,
        )


def _print_remote(con: Console, r: dict) -> None:
    per_url = r.get("per_url") or {}
    if not per_url and not r.get("configured"):
        return
    tb = Table(title="remote cache (all processes that used one)", header_style="bold")
    cols = (
        "remote",
        "hits",
        "misses",
        "errors",
        "rejected",
        "pushed",
        "replaced",
        "push failed",
        "down",
        "up",
    )
    for c in cols:
        tb.add_column(c, justify="left" if c == "remote" else "right")
    rows = list(per_url.items())
    if r.get("configured") and r["configured"] not in per_url:
        rows.append((r["configured"], {}))
    for url, c in rows:
        rej = c.get("rejected", 0)
        why = ", ".join(f"{k} {v}" for k, v in sorted((c.get("rejected_by_reason") or {}).items()))
        tb.add_row(
            escape(str(url)),
            str(c.get("hits", 0)),
            str(c.get("misses", 0)),
            str(c.get("errors", 0)),
            f"{rej} ({escape(why)})" if rej else "0",
            str(c.get("pushed", 0)),
            str(c.get("replaced", 0)),
            str(c.get("push_failed", 0))
            + (f" (+{c['push_skipped']} not tried)" if c.get("push_skipped") else ""),
            human_bytes(c.get("bytes_down", 0)),
            human_bytes(c.get("bytes_up", 0)),
        )
    con.print(tb)
