"""``quack build --dry-run``: list what a build would compile and what is cached, one
line per configuration as it is expanded, so a big manifest shows its first line as
soon as every file is validated instead of after the whole plan (issue 9, item 6).

Every manifest is read and validated first (syntax, keys, values and the
``--max-configs`` total, all counted before anything is expanded), so a refused
manifest prints no configuration and the listing never exceeds the limit. Lines then
come in manifest order (the real build starts the longest known compiles first).
``--json`` keeps one JSON document on stdout, written at the end (keys to compile
longest first, then the cached ones, as before); the lines stream on stderr, the
progress stream of ``--json``."""

from __future__ import annotations

import time

from quack.errors import CacheError, ManifestError
from quack_build.build import plan as planning
from quack_build.build import results
from quack_build.cli.context import emit_json, manifest_fail, store_fail
from quack_build.manifest.read import ExpansionStream

# Lines go out in batches at most this far apart (Rich costs ~45 us a call, ~4 us a
# line when batched); the first line goes out at once.
FLUSH_S = 0.05


class _Lines:
    """Plain lines to a Rich console, batched by time. A reader that closes the pipe
    early (``quack build -n | head``) ends the command quietly: Rich's own handling."""

    def __init__(self, con):
        self.con = con
        self.buf: list[str] = []
        self.last = 0.0

    def add(self, line: str) -> None:
        self.buf.append(line)
        now = time.monotonic()
        if now - self.last >= FLUSH_S:
            self.flush()
            self.last = now

    def flush(self) -> None:
        if self.buf:
            self.con.print("\n".join(self.buf), markup=False, soft_wrap=True)
            self.buf.clear()


def run(
    s,
    paths,
    *,
    arch,
    max_configs: int,
    store,
    con,
    force: bool,
    as_json: bool,
    verbose: bool = False,
    gpus=(),
) -> int:
    """``verbose``: then what each listed kernel's fingerprint covers (quack_build.cli.sourcelist);
    ``gpus``: ``--gpu``'s models (each one's tuning rows, the union)."""
    stream = ExpansionStream(
        paths, archs=s.build_archs(), arch_override=arch or None, max_configs=max_configs, gpus=gpus
    )
    out = _Lines(con)
    kernels: set[str] = set()
    try:
        rc = _list(s, stream, store, out, force=force, as_json=as_json, kernels=kernels, gpus=gpus)
    finally:
        out.flush()
    if verbose:
        from quack_build.cli import sourcelist

        sourcelist.print_sources(con, kernels)
    return rc


def _for(cfg) -> str:
    """ "  for 8192x4096x4096, ...": the problem sizes whose tuned configuration this is."""
    return f"  for {', '.join(cfg.sizes)}" if cfg.sizes else ""


def _list(
    s, stream: ExpansionStream, store, out: _Lines, *, force: bool, as_json: bool, kernels: set, gpus=()
) -> int:
    times = planning.PastTimes(store.root)
    tasks: list[results.Task] = []  # kept for --json only: plain output holds nothing
    n_total = n_cached = n_corrupt = 0
    warned = 0

    def warn() -> None:
        nonlocal warned
        for w in stream.warnings[warned:]:
            out.add(f"warning: {w}")
        warned = len(stream.warnings)

    try:
        for cfg in stream:
            if len(stream.warnings) > warned:
                warn()
            t = planning.plan_one(cfg, store, force=force, dry_run=True)  # read-only: nothing moved
            kernels.add(cfg.kernel)
            n_total += 1
            if t.status == results.CACHED:
                n_cached += 1
                out.add(f"cached   {cfg.label()}  key {cfg.key[:16]}{_for(cfg)}")
            else:
                t.est_s = times.get(cfg.kernel, cfg.key)
                est = f"  ~{t.est_s:.2f}s" if t.est_s else ""
                bad = (
                    f"  (corrupt: {t.corrupt}; a build moves it to quarantine/ and rebuilds it)"
                    if t.corrupt
                    else ""
                )
                if t.corrupt:
                    n_corrupt += 1
                out.add(f"compile  {cfg.label()}  key {cfg.key[:16]}{est}{_for(cfg)}{bad}")
            if as_json:
                tasks.append(t)
    except ManifestError as e:
        warn()
        out.flush()  # the lines listed so far, then the problems
        raise manifest_fail(e) from None
    except (CacheError, OSError) as e:
        out.flush()
        raise store_fail(s, e) from None
    warn()
    todo = n_total - n_cached
    from quack_build.cli.run import tune_models

    models, why = tune_models(gpus)  # before building: which models' rows the keys above are for
    out.add(f"tuning rows for {'GPU ' + ', '.join(models) if models else 'each table default GPU'} ({why})")
    out.add(
        f"{n_total} configurations ({stream.duplicates} duplicates dropped): "
        f"{n_cached} cached, {todo} to compile"
        + (
            f" ({n_corrupt} of them corrupt in the cache, left as they are: a dry run moves nothing)"
            if n_corrupt
            else ""
        )
    )
    out.flush()
    if as_json:
        pending = [t for t in tasks if t.status != results.CACHED]
        known = {t.cfg.key: t.est_s for t in pending if t.est_s is not None}
        pending = planning.order_longest_first(pending, known) if pending else []
        emit_json(
            {
                "dry_run": True,
                "total": n_total,
                "cached": n_cached,
                "to_compile": todo,
                "corrupt": n_corrupt,
                "duplicates": stream.duplicates,
                "tune_gpu": {"models": list(models), "source": why},
                "keys": [t.to_json() for t in pending]
                + [t.to_json() for t in tasks if t.status == results.CACHED],
            }
        )
    return 0
