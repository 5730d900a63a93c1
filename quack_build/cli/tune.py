"""``quack tune [MANIFEST ...]``: measure each configuration's search space on the GPU and
write the winners to the tuning table (docs/tuning.md). Self-contained: registered on the
typer app by quack_build.cli.app (``register``); the engine is ``quack.compile.autotune``.

Per problem (a manifest configuration of a kernel that declares ``search_space``): the
current default configuration plus the candidates, compiled in parallel in the pool (the
normal build path: cached ones load), each checked with the kernel's reference hook (the
``quack verify --run`` one) before it may win, timed with ``quack.tuning.bench.gpu_time``
at M rows (``--rows``, else 32768, or 4096 for rows over 65536 elements) for a row kernel,
at the sizes its manifest entry lists (``problems = [[m, n, k]]``) for a kernel that
declares ``problem`` names (the GEMM), the close calls
re-measured interleaved. ``--dry-run`` lists the candidates and compiles nothing;
``--compile-only`` builds every candidate into the cache (no GPU needed: a CPU build farm,
``--executor ray``) and stops there, so the measuring run on the GPU machine only loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, NamedTuple, Optional

import typer

from quack_build.cli import argcheck
from quack_build.cli.context import Fail, cli_settings, console, emit_json, load_kernels
from quack_build.cli.options import cache_dir_option, manifests_argument, max_configs_option
from quack_build.cli.run import expand_manifests, run_command


def register(app: typer.Typer) -> None:
    app.command()(tune)


def parse_budget(text: Optional[str]) -> tuple[Optional[float], Optional[int]]:
    """``--budget``: "90s" / "90" (seconds a problem) or "12c" (candidates a problem)."""
    if text is None:
        return None, None
    t = text.strip().lower()
    try:
        if t.endswith("c"):
            n = int(t[:-1])
            if n >= 1:
                return None, n
        else:
            v = float(t[:-1] if t.endswith("s") else t)
            if 0 < v < float("inf"):  # "inf" seconds is no budget, "nan" fails every test
                return v, None
    except ValueError:
        pass
    raise typer.BadParameter(f"--budget {text!r}: seconds ('90s' or '90') or candidates ('12c'), > 0")


def default_rows(n: int) -> int:
    return 32768 if n <= 65536 else 4096


class Problem(NamedTuple):
    """One problem ``quack tune`` measures: a manifest configuration (``config``: its
    BuildConfig) at ``sizes``, the values of the kernel's ``problem`` names (the GEMM's
    m, n, k from the entry's ``problems``) or, for a row kernel (no ``problem``), its rows
    ``{"m": M}``. ``current``: today's default configuration for it (the old winner)."""

    config: Any
    spec: Any
    base: dict  # the bound parameters without the config
    cands: list
    current: Any
    sizes: dict

    def classed(self) -> dict:
        """The parameters with the sizes: what the kernel's ``derive`` classifies (a row's
        class and N; the GEMM's shape class comes from m, n, k)."""
        return dict(self.base, **self.sizes)

    def n(self) -> int:
        """The N a table row is keyed by."""
        return int(self.sizes.get("n", self.base.get("n", 0)))

    def shape(self) -> str:
        if self.spec.problem:
            return "x".join(str(self.sizes[d]) for d in self.spec.problem)
        return f"{self.sizes['m']}x{self.base['n']}"


def tune(
    manifests: List[Path] = manifests_argument(),
    kernel: Optional[str] = typer.Option(None, "--kernel", help="Only this kernel's configurations."),
    budget: Optional[str] = typer.Option(
        None, "--budget", help="A problem's budget: seconds ('90s') or candidates ('12c')."
    ),
    table: Optional[Path] = typer.Option(
        None,
        "--table",
        help="Write the winners here instead (checked, and an existing table read, before anything "
        "is measured; --compile-only does not use it).",
    ),
    from_empty: bool = typer.Option(
        False, "--from-empty", help="Ignore the table's rows: write a table of this run's winners only."
    ),
    rows: Optional[int] = typer.Option(None, "--rows", min=1, help="Rows (M) of the timed problems."),
    min_gain: float = typer.Option(
        0.005,
        "--min-gain",
        min=0.0,
        max=0.5,
        callback=argcheck.finite_option,
        help="Today's winner stays unless a candidate beats it by this fraction and by more than "
        "the spread of their round-by-round time ratios.",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="List the candidates; compile nothing."),
    compile_only: bool = typer.Option(
        False,
        "--compile-only",
        help="Build every candidate into the cache and stop (no GPU needed); measure later.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON result on stdout."),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1, help="Compile workers."),
    executor: Optional[str] = typer.Option(
        None,
        "--executor",
        callback=argcheck.executor_option,
        help="local, ray, auto, ray://HOST:PORT or HOST:PORT (as quack build's --executor).",
    ),
    cache_dir: Optional[Path] = cache_dir_option(),
    max_configs: int = max_configs_option(),
):
    """Measure the kernels' search spaces on this GPU; write the winners to the tuning table."""
    opts = dict(locals())  # every option by name, as run_tune takes them
    seconds, count = parse_budget(opts.pop("budget"))
    if dry_run and compile_only:
        raise typer.BadParameter("--dry-run compiles nothing, --compile-only compiles: give one of them")
    run_command(lambda: run_tune(seconds=seconds, count=count, **opts))


def problems(s, manifests, kernel, max_configs, from_empty=False, rows=None) -> list[Problem]:
    """Every problem to measure. A kernel sized by its parameters (a row kernel: no
    ``problem`` names) has one per configuration, at ``rows`` rows (else ``default_rows``);
    one that declares ``problem`` names (the GEMM) one per size its entry's ``problems``
    lists, and none listed is an error naming the entry. The current default is derived
    for the problem's sizes and is a candidate too (its time is the speed-up's base), except
    from an empty table: then the search space alone must find the winners."""
    if from_empty:
        # the heuristics' configurations, without reading any table: --from-empty replaces
        # the table, so one that is broken must not stop it (nor warn that it has no rows)
        import warnings

        from quack.tuning import without_tables

        with without_tables(s.tune_gpu or "none"), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"quack_kernels: no tuning")
            return _problems(s, manifests, kernel, max_configs, True, rows)
    return _problems(s, manifests, kernel, max_configs, False, rows)


def _problems(s, manifests, kernel, max_configs, from_empty, rows) -> list[Problem]:
    exp = expand_manifests(s, manifests, [], max_configs, "nothing was tuned")
    out = []
    seen = set()
    for c in exp.configs:
        spec = c.spec
        if spec.search_space is None or (kernel is not None and c.kernel != kernel):
            continue
        base = {k: v for k, v in c.params.items() if k != "config"}
        if spec.problem and not c.problems:
            raise Fail(
                f"error: {c.origin}: kernel {c.kernel} is tuned at problem sizes "
                f"({', '.join(spec.problem)}): list them in its manifest entry, problems = "
                f"[[{', '.join(spec.problem)}], ...]"
            )
        sized = [dict(p) for p in c.problems] if spec.problem else [{"m": rows or default_rows(base["n"])}]
        bound = spec.bind((), base, arch=c.arch)
        space = spec.search_space(bound)
        for sizes in sized:
            ident = (c.kernel, c.arch, tuple(sorted(base.items())), tuple(sizes.items()))
            if ident in seen:  # the same problem listed with several configs: tuned once
                continue
            seen.add(ident)
            # today's default for THIS problem: the GEMM's table row / heuristic depends on
            # m, n, k, which the compile parameters do not carry
            current = (
                spec.derive_at(bound, sizes, c.arch, ("config",))["config"]
                if spec.problem
                else bound["config"]
            )
            cands = list(dict.fromkeys(space if from_empty else [current, *space]))
            out.append(Problem(c, spec, base, cands, current, sizes))
    if kernel is not None and not out:
        raise Fail(f"error: --kernel {kernel}: {_no_kernel(kernel)}")
    return out


def _no_kernel(kernel: str) -> str:
    """Why ``--kernel`` found nothing to tune: an unknown name, a kernel without a search
    space, or one the manifests do not list (one message for all three misled)."""
    from quack import registry

    specs = registry.all_specs()
    tunable = ", ".join(sorted(n for n, sp in specs.items() if sp.search_space is not None)) or "none"
    if kernel not in specs:
        return f"no kernel of that name is registered; the kernels with a search space: {tunable}"
    if specs[kernel].search_space is None:
        return f"declares no search space, so there is nothing to tune; the kernels with one: {tunable}"
    return "not in the manifests given: add a [[kernel]] entry for it (docs/tuning.md)"


def row_class(p: Problem) -> str | None:
    """The tuning-table class a problem's winner is written under (None: none can be)."""
    classify = getattr(getattr(p.spec.params["config"], "derive", None), "classify", None)
    return classify(p.classed()) if classify is not None else None


def _label(p: Problem) -> str:
    from quack_build.manifest.config import format_params

    c = p.config
    at = f" {p.shape()}" if p.spec.problem else ""
    return f"{c.kernel}({format_params(c.spec.plain(p.base))}) {c.arch}{at}"


def run_tune(
    *,
    manifests,
    kernel,
    seconds,
    count,
    table,
    from_empty,
    rows,
    min_gain,
    dry_run,
    compile_only,
    as_json,
    jobs,
    executor,
    cache_dir,
    max_configs,
) -> int:
    manifests = manifests or []
    # jit: the candidates are compiled on purpose, whatever the runtime mode says. Under
    # [runtime] mode = "prebuilt" (a server's quack.toml) or inside a strict pytest session
    # (QUACK_PYTEST_PREBUILT_CACHE reaches the processes a test starts) every candidate was
    # refused as "not prebuilt" and the tune failed (tests/test_tune_gpu.py, session 21).
    s = cli_settings(cache_dir, jobs, executor, manifests, mode="jit")
    load_kernels(s)
    con = console(to_stderr=as_json)
    from quack_build.cli import tune_measure as tunerun

    if table is not None and not compile_only:  # before the manifests are expanded or built
        tunerun.check_tables([table], given=True, from_empty=from_empty)
    probs = problems(s, manifests, kernel, max_configs, from_empty, rows)
    if dry_run:
        out = []
        for p in probs:
            cands = p.cands[:count] if count else p.cands
            cls = row_class(p)
            con.print(f"{_label(p)}: {len(cands)} candidates, table class {cls}", markup=False)
            for cand in cands:
                con.print(f"  {'*' if cand == p.current else ' '} {cand.label()}", markup=False)
            out.append(
                dict(
                    problem=_label(p),
                    sizes=p.sizes,
                    table_class=cls,
                    candidates=[cand.knobs() for cand in cands],
                )
            )
        if as_json:
            emit_json(dict(dry_run=True, problems=out))
        return 0
    if compile_only:
        return _compile_only(s, con, probs, count, jobs, as_json)
    import torch

    if not torch.cuda.is_available():
        raise Fail("error: quack tune measures on a CUDA GPU and none is visible here (--dry-run lists)")
    paths = [table] if table else sorted({_table_path(p) for p in probs if row_class(p) is not None})
    loaded = tunerun.check_tables(paths, given=table is not None, from_empty=from_empty)
    try:
        gpu, results, tables = tunerun.measure_and_write(
            s, con, probs, seconds, count, table, from_empty, _label, min_gain=min_gain, loaded=loaded
        )
    except tunerun.TuneStopped as e:
        # what was measured before the stop is still shown and, with --json, printed (the
        # run's stdout was empty, though rows had been written)
        _print_table(con, e.results)
        if as_json:
            emit_json(dict(gpu=e.gpu, problems=e.results, tables=[str(p) for p in e.tables], error=str(e)))
        raise
    _print_table(con, results)
    if as_json:
        emit_json(dict(gpu=gpu, problems=results, tables=[str(p) for p in tables]))
    return 0 if all(r["new"] and not r.get("table_error") for r in results) else 1


def _table_path(p: Problem) -> Path:
    """The kernel's own tuning table for the problem's arch (where no --table writes)."""
    return Path(p.spec.params["config"].derive.table_path(p.config.arch))


def candidate_configs(probs, count) -> list:
    """Each problem's candidates (the first ``count`` with a candidate budget) as the
    BuildConfigs ``quack build`` builds: the same keys the measuring run asks for."""
    from quack_build.manifest.config import BuildConfig

    out: dict = {}
    for c, spec, base, cands, _current, _sizes in probs:
        for cand in cands[:count] if count else cands:
            params = spec.bind((), dict(base, config=cand), arch=c.arch)
            key = spec.key(params, c.arch)
            # two problems may share a candidate's kernel (one key): built once
            out.setdefault(
                key, BuildConfig(c.kernel, params, c.arch, key, f"{c.origin} (tune candidate)", spec)
            )
    return list(out.values())


def _compile_only(s, con, probs, count, jobs, as_json) -> int:
    from quack_build.cli.build import build_configs

    configs = candidate_configs(probs, count)
    con.print(f"quack tune --compile-only: {len(configs)} candidates of {len(probs)} problems", markup=False)
    return build_configs(s, con, configs, jobs, keep_going=True, force=False, as_json=as_json)


def _print_table(con, results) -> None:
    from rich.markup import escape
    from rich.table import Table as RTable

    t = RTable(title="quack tune")
    for col in ("problem", "old winner", "new winner", "old us", "new us", "speed-up", "failed"):
        t.add_column(col)
    for r in results:
        t.add_row(  # labels from the manifest and the table: escaped, a cell is Rich markup
            escape(r["problem"]),
            escape(r["old"]),
            escape(r["new"] or "(none correct: old kept)"),
            f"{r['old_us']:.1f}" if r["old_us"] else "-",
            f"{r['new_us']:.1f}" if r["new_us"] else "-",
            f"{r['speedup']:.3f}x" if r["speedup"] else "-",
            str(len(r["failed"])) if r["failed"] else "-",
        )
    con.print(t)
    # which candidates failed and why (a launch fault, a dead or hung measuring process, a
    # failed compile), after the table so that the last screen shows them
    for r in results:
        for f in r["failed"]:
            con.print(f"failed: {r['problem']}: {f['candidate']}: {f['reason']}", markup=False)
        if not r["new"]:
            con.print(f"kept: {r['problem']}: {r['kept']} (no candidate measured correct)", markup=False)
        if r.get("held"):
            h = r["held"]
            over = f" over {rounds} rounds" if (rounds := h.get("rounds")) else ""
            if h["gain"] > 0:
                why = f"measured {h['gain'] * 100:.2f} % faster, inside the noise ({h['noise'] * 100:.2f} %{over})"
            else:
                # the fastest of the first rounds, slower once a duel's rounds were added (the H100's
                # 8192x28672x8192 in session 24 printed "-3.44 % faster")
                why = (
                    f"the fastest at first, measured {-h['gain'] * 100:.2f} % slower{over} "
                    f"(noise {h['noise'] * 100:.2f} %)"
                )
            if (dueled := h.get("dueled", 0)) > 1:
                why += (
                    f"; {dueled - 1} more contender{'s' * (dueled > 2)} dueled it, none faster in every round"
                )
            con.print(f"held: {r['problem']}: keeps {r['old']}; {h['faster']} {why}", markup=False)
