"""The GPU side of ``quack tune`` (quack_build.cli.tune): measure each problem through
``quack.compile.autotune`` and write the winners to the tuning table."""

from __future__ import annotations

import datetime
import errno
import os
import tempfile
from pathlib import Path

import typer

from quack_build.cli.argcheck import output_file_problem
from quack_build.cli.context import Fail


def check_tables(paths, *, given: bool, from_empty: bool) -> dict:
    """Each tuning table a run will write, checked before anything is compiled or measured
    (a bad ``--table`` used to end the run in a traceback after all the GPU measuring):
    writable where it is, and an existing one loaded (its rows are kept) unless
    ``from_empty``. Returns {path: the loaded Table, or None}; a problem is a Fail naming
    the option (``given``: the paths are ``--table``'s) or the kernels' table."""
    from quack.errors import TomlFileError, TuningTableError
    from quack.tuning import Table

    what = "--table" if given else "tuning table"
    out: dict = {}
    for path in map(Path, paths):
        why = output_file_problem(path, "tuned.toml")
        if why:
            raise Fail(f"error: {what} {path}: {why}", code=2 if given else 1)
        if path.exists() and not from_empty:
            try:
                out[path] = Table.load(path)
                check_rows(out[path])
            except (TomlFileError, TuningTableError) as e:
                raise Fail(
                    f"error: {what} {path}: cannot read it: {e}. Fix the file, or give --from-empty "
                    "to replace it with this run's winners"
                ) from None
        else:
            out[path] = None
    return out


def check_rows(t) -> None:
    """Every row of table ``t`` names a registered kernel whose configuration is derived
    from tables, and passes that kernel's own row check (its ``derive.check_rows``: the
    classes its classifier produces, dtype and GPU names). Raises TuningTableError: a row
    no lookup would ever reach was kept silently (``kernel = "softmax_fw"``)."""
    from quack import registry
    from quack.errors import TuningTableError

    specs = registry.all_specs()
    tuned = sorted(
        n for n, sp in specs.items() if any(getattr(p, "derive", None) for p in sp.params.values())
    )
    for i, r in enumerate(t.rows, 1):
        if r.kernel not in tuned:
            raise TuningTableError(
                t.path,
                f"kernel {r.kernel!r} is not a registered kernel with a tuned configuration "
                f"(those: {', '.join(tuned) or 'none'})",
                row=i,
                field="kernel",
            )
    for kernel in sorted({r.kernel for r in t.rows}):
        spec = specs[kernel]
        derives = [getattr(p, "derive", None) for p in spec.params.values()]
        check = getattr(next(d for d in derives if d is not None), "check_rows", None)
        if check is not None:
            check(t)


class TuneStopped(Fail):
    """The measuring process could not be started again: the run stopped early. Carries
    what was measured and written before, which the caller still prints (table, --json)."""

    def __init__(self, message: str, gpu: str, results: list, tables: list):
        super().__init__(message)
        self.gpu, self.results, self.tables = gpu, results, tables


#: How long a run waits for another ``quack tune`` writing the same table (seconds): the
#: other's write is a re-read, a merge and a rename, well under a second.
TABLE_LOCK_TIMEOUT = 60.0


def write_winners(path: Path, rows: list, arch: str, gpu: str, from_empty: bool) -> Path:
    """Merge this run's winning ``rows`` into the table at ``path`` and write it, holding a
    lock beside it (``.<name>.lock``): the table is read again under the lock, so two runs
    writing one table each keep the other's rows (each wrote the table it had read at its
    start: the first one's winners were lost). ``from_empty``: the run replaces the table.
    Raises OSError, ValueError (a value the file cannot hold), filelock.Timeout,
    TomlFileError / TuningTableError (the file was broken meanwhile, or a row would tie)."""
    import filelock

    from quack.tuning import Table

    if not path.parent.is_dir():  # filelock would create it (and the table in it)
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path.parent))
    with filelock.FileLock(str(path.parent / f".{path.name}.lock"), timeout=TABLE_LOCK_TIMEOUT):
        t = Table.load(path) if path.is_file() and not from_empty else Table(arch, gpu, path=str(path))
        for r in rows:
            t.put(r)
        return t.write(path)


def _write_elsewhere(t, dest: Path) -> str:
    """Where the winners went when ``dest`` could not be written: a copy of the table in the
    working directory, else the temporary directory ('' when neither takes it)."""
    for d in (Path.cwd(), Path(tempfile.gettempdir())):
        try:
            fd, tmp = tempfile.mkstemp(dir=d, prefix=f"quack-tune-{dest.stem}-", suffix=".toml")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(t.dumps())
            return tmp
        except OSError:
            continue
    return ""


def measure_and_write(
    s, con, probs, seconds, count, table, from_empty, label, *, measurer=None, min_gain=0.005, loaded=None
):
    """Measure each problem, write the winners' tables (a line each on ``con``) and return
    ``(gpu, results, table paths)``; the caller (quack_build.cli.tune) renders them.

    Candidates compile here (the pool) and are checked and timed in a measuring process
    (``quack_build.tune.measure.Measurer``; ``measurer`` replaces it in a test): a launch
    that faults poisons that process's CUDA context, so it is replaced and the candidate
    reported as failed, with its configuration and the error, as it happens and in the
    result (``failed``); the other candidates go on. A problem whose every candidate
    failed keeps its old winner (``kept``): no row is written for it. The old winner also
    stays (``held``) when the fastest beats it by less than ``min_gain`` or than the spread
    of their round-by-round time ratios (``autotune``'s ``hold``): a re-tune on the same GPU does
    not rewrite rows on noise (two runs a call apart picked different winners for the two
    5 ms GEMM shapes, each 2-4 % off the other in the next call).

    ``loaded``: the tables ``check_tables`` read before the run, by path. The winners are
    merged into each table as it is on disk at the end (``write_winners``: another run's
    rows written meanwhile stay); an interrupt or failure mid-run still writes the winners
    measured before it. A table that cannot be written loses nothing: its winners go to
    another file, named in an ``error:`` line on stderr and in its problems'
    ``table_error``; the caller exits 1. A measuring process that cannot start again stops
    the run: ``TuneStopped``, carrying the results so far."""
    import torch

    from quack.compile import pool as qpool
    from quack.compile.autotune import autotune
    from quack.runtime.jit import kernel as registered_kernel
    from quack.tuning import Row, current_gpu, normalise_gpu
    from quack_build.tune.measure import Measurer, problem_request

    if measurer is None:
        device = torch.device("cuda", torch.cuda.current_device())
        # the child measures what this process compiled: the same cache directory
        measurer = Measurer(device=str(device), env={"QUACK_CACHE_DIR": str(s.cache_dir)})
    gpu = s.tune_gpu or normalise_gpu(torch.cuda.get_device_name(torch.cuda.current_device()))
    results: list = []
    tables: dict = {}  # path -> (arch, default GPU, {row ident: this run's winning row})
    written: dict = {}  # (table path, row ident) -> the shape whose winner was written there
    stop = ""
    pool = qpool.CompilePool(s.effective_jobs(None))
    try:
        for p in probs:
            c, spec, base, cands, current = p.config, p.spec, p.base, p.cands, p.current
            if spec.bench is None or spec.reference is None:
                raise Fail(f"error: {c.kernel}: declares a search space but no bench= / reference= hook")
            derive = spec.params["config"].derive
            prob = problem_request(spec, spec.plain(base), p.sizes)

            def check(fn, cfg, _prob=prob):
                measurer.check(_prob, cfg["config"])

            def bench(fn, cfg, _prob=prob):
                return measurer.time(_prob, cfg["config"])

            def on_result(kind, cfg, value):
                if kind in ("error", "wrong"):  # named as it happens: a later crash cannot hide it
                    why = str(value).strip().splitlines()[0][:300] if str(value).strip() else kind
                    con.print(
                        f"  {'failed' if kind == 'error' else 'wrong '} {cfg['config'].label()}: {why}",
                        markup=False,
                    )

            con.print(f"tuning {label(p)}: {len(cands[:count] if count else cands)} candidates", markup=False)
            res = autotune(
                registered_kernel(c.kernel),
                [{"config": x} for x in cands],
                bench,
                common=base,
                pool=pool,
                timeout=seconds,
                check=check,
                max_candidates=count,
                baseline={"config": current},  # the old winner's time: re-measured with the new one
                hold=min_gain,
                on_result=on_result,
            )
            old_t = next((t for cfg, t in res.times if cfg["config"] == current), None)
            new = res.best["config"] if res.best else None
            cls = derive.classify(p.classed()) if getattr(derive, "classify", None) else None
            # the N range the row covers: the problem's own N, or the N bucket of a class that
            # names one (the GEMM's), so a shape of the same class reaches the row
            n_range = derive.n_range(p.classed()) if getattr(derive, "n_range", None) else (p.n(), p.n())
            entry = dict(
                problem=label(p),
                old=current.label(),
                new=new.label() if new else None,
                old_us=old_t and old_t * 1e6,
                new_us=res.best_time and res.best_time * 1e6,
                speedup=(old_t / res.best_time) if old_t and res.best_time else None,
                refused=[(cfg["config"].label(), e) for cfg, e in res.refused],
                failed=[
                    dict(candidate=cfg["config"].label(), config=cfg["config"].knobs(), reason=_reason(e))
                    for cfg, e in res.errors
                ],
                written=False,
            )
            if res.held is not None:
                # the challenger the hold kept out (after a duel not always the fastest of the
                # times: its rounds re-timed it), else the fastest
                fast_cfg, fast_t = next(
                    (ct for ct in res.times if ct[0] == res.held_back), min(res.times, key=lambda ct: ct[1])
                )
                entry["held"] = dict(
                    faster=fast_cfg["config"].label(),
                    gain=1 - fast_t / old_t if old_t else 0.0,
                    noise=res.held,
                    rounds=res.compared,
                    dueled=res.dueled,
                )
            if new is None:
                entry["kept"] = current.label()
                con.print(
                    f"  {label(p)}: no candidate measured correct ({len(res.errors)} failed, "
                    f"{len(res.refused)} wrong): keeps {current.label()}, no row written",
                    markup=False,
                )
            if new is not None and cls is not None:
                path = Path(table) if table else Path(derive.table_path(c.arch))
                if path not in tables:
                    base_t = (loaded or {}).get(path)
                    tables[path] = (c.arch, base_t.default_gpu if base_t else current_gpu(gpu) or gpu, {})
                row = Row(
                    c.kernel,
                    gpu,
                    cls,
                    tuple(n_range),
                    new.knobs(),
                    (base["dtype"],),
                    float(res.best_time or 0.0) * 1e6,
                    p.shape(),
                    datetime.date.today().isoformat(),
                )
                tables[path][2][row.ident()] = row
                earlier = written.get((path, row.ident()))
                if earlier is not None:  # two problems of one class: the last one's winner stands
                    entry["replaced"] = earlier
                    con.print(
                        f"note: {p.shape()} shares the table row (class {cls}, n {list(n_range)}) with "
                        f"{earlier} tuned earlier in this run: {p.shape()}'s winner is written",
                        markup=False,
                    )
                written[(path, row.ident())] = p.shape()
                entry["written"] = True
                entry["table"] = str(path)
            results.append(entry)
            if measurer.broken:  # no measuring process starts: the other problems would fail alike
                stop = measurer.broken
                break
    except BaseException:
        measurer.kill()  # an interrupt or a failure: nothing will ask the child again
        pool.shutdown()
        # the winners measured before it are written (an interrupt on the last problem lost
        # every finished one), then the interrupt or failure goes on
        if any(rows for _a, _g, rows in tables.values()):
            con.print("stopped: writing the winners measured before it", markup=False)
            write_tables(con, tables, results, table, from_empty)
        raise
    try:
        measurer.close()
    finally:
        pool.shutdown()
    out = write_tables(con, tables, results, table, from_empty)
    if stop:
        raise TuneStopped(f"error: quack tune: {stop}", gpu, results, out)
    return gpu, results, out


def write_tables(con, tables: dict, results: list, table, from_empty: bool) -> list:
    """Write each table's winners (``write_winners``); a table that cannot be written loses
    nothing: its winners go to another file, named in an ``error:`` line and in the
    results. Returns the paths written."""
    import filelock

    from quack.errors import TomlFileError, TuningTableError
    from quack.tuning import Table

    out = []
    for path, (arch, gpu, rows) in tables.items():
        if not rows:
            continue
        try:
            write_winners(path, list(rows.values()), arch, gpu, from_empty)
        except (OSError, ValueError, filelock.Timeout, TomlFileError, TuningTableError) as e:
            # checked before the run, yet removed, filled, broken or locked since
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            if isinstance(e, filelock.Timeout):
                why = f"another quack tune held its lock for {TABLE_LOCK_TIMEOUT:.0f} s"
            mine = Table(arch, gpu, path=str(path))
            try:
                for r in rows.values():
                    mine.put(r)
                other = _write_elsewhere(mine, path)
            except (ValueError, TuningTableError):
                other = ""
            what = f"--table {path}" if table else f"tuning table {path}"
            msg = f"error: {what}: cannot write it ({why}); " + (
                f"this run's winners were written to {other} instead: move it there"
                if other
                else "this run's winners are only in the results printed here"
            )
            typer.echo(msg, err=True)
            for r in results:
                if r.get("table") == str(path):
                    r["table"], r["table_error"] = other or None, msg
            if other:
                out.append(Path(other))
            continue
        con.print(f"wrote {path}", markup=False)
        out.append(path)
    return out


def _reason(e: str) -> str:
    """An error's first line (a compile error's is its summary), at most 300 characters."""
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[0].strip()[:300] if lines else "failed"
