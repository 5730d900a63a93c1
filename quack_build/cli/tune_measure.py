"""The GPU side of ``quack tune`` (quack_build.cli.tune): measure each problem through
``quack.compile.autotune`` and write the winners to the tuning table."""

from __future__ import annotations

import datetime
import importlib
from pathlib import Path

from quack_build.cli.context import Fail


def _resolve(ref: str):
    mod, _, fn = ref.partition(":")
    return getattr(importlib.import_module(mod), fn)


def measure_and_write(s, con, probs, seconds, count, table, from_empty, label):
    """Measure each problem, write the winners' tables (a line each on ``con``) and return
    ``(gpu, results, table paths)``; the caller (quack_build.cli.tune) renders them."""
    import torch

    from quack.compile import pool as qpool
    from quack.compile.autotune import autotune
    from quack.runtime.jit import kernel as registered_kernel
    from quack.tuning import Row, Table, current_gpu, normalise_gpu, use_config
    from quack.tuning.bench import gpu_time

    device = torch.device("cuda", torch.cuda.current_device())
    gpu = s.tune_gpu or normalise_gpu(torch.cuda.get_device_name(device))
    results, tables = [], {}
    written: dict = {}  # (table path, row ident) -> the shape whose winner was written there
    pool = qpool.CompilePool(s.effective_jobs(None))
    try:
        for p in probs:
            c, spec, base, cands, current = p.config, p.spec, p.base, p.cands, p.current
            if spec.bench is None or spec.reference is None:
                raise Fail(f"error: {c.kernel}: declares a search space but no bench= / reference= hook")
            derive = spec.params["config"].derive
            plain = spec.plain(dict(base, config=current))
            call = _resolve(spec.bench)(plain, device=device, **p.sizes)
            ref = _resolve(spec.reference)

            def check(fn, cfg, _c=c, _plain=plain, _ref=ref):
                with use_config(_c.kernel, cfg["config"]):
                    _ref(dict(_plain, config=cfg["config"]), device)

            def bench(fn, cfg, _c=c, _call=call):
                with use_config(_c.kernel, cfg["config"]):
                    return gpu_time(_call, device=device)

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
                errors=[(cfg["config"].label(), e.splitlines()[0][:200]) for cfg, e in res.errors],
                written=False,
            )
            if new is not None and cls is not None:
                path = Path(table) if table else Path(derive.table_path(c.arch))
                if path not in tables:
                    base_t = Table.load(path) if path.is_file() and not from_empty else None
                    tables[path] = base_t or Table(c.arch, current_gpu(gpu) or gpu, path=str(path))
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
                tables[path].put(row)
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
            results.append(entry)
    finally:
        pool.shutdown()
    for path, t in tables.items():
        t.write(path)
        con.print(f"wrote {path}", markup=False)
    return gpu, results, list(tables)
