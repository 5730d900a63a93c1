"""Autotuning on the compile pool: submit every candidate configuration at once,
benchmark each as soon as its kernel is ready (cached ones first), keep the fastest.

    from quack.compile.autotune import autotune
    res = autotune(rmsnorm_fwd_compile, [{"block": b} for b in (128, 256, 512)],
                   bench=lambda fn, cfg: time_it(fn, x, w, y),
                   common={"dtype": "bfloat16", "n": 4096})
    res.best, res.best_time, res.errors

A candidate whose compile fails is recorded in ``errors`` and skipped; a wedged
one falls back to an in-process compile (the pool's time-out rule). Benchmarking
runs on the caller's thread, in the caller's CUDA context, while the other
candidates compile in the workers."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

from quack.compile import pool as _pool
from quack.compile import scope
from quack.compile.tasks import PENDING
from quack.errors import CompileError, CompilePending


@dataclasses.dataclass
class TuneResult:
    best: dict | None
    best_time: float | None
    times: list[tuple[dict, float]]  # in the order they were benchmarked
    errors: list[tuple[dict, str]]
    submitted: int  # candidates that had to compile
    wall_s: float

    def table(self) -> str:
        rows = [f"{t * 1e6:10.1f} us  {c}" for c, t in sorted(self.times, key=lambda ct: ct[1])]
        rows += [f"{'failed':>13}  {c}: {e.splitlines()[0][:120]}" for c, e in self.errors]
        return "\n".join(rows)


def autotune(
    kernel,
    configs: Sequence[dict],
    bench: Callable[[Any, dict], float],
    *,
    common: dict | None = None,
    pool: _pool.CompilePool | None = None,
    timeout: float | None = None,
) -> TuneResult:
    """Compile ``kernel(**common, **config)`` for every config in parallel and return
    the one ``bench(fn, config)`` (seconds; lower wins) rates fastest."""
    t0 = time.perf_counter()
    common = dict(common or {})
    times: list[tuple[dict, float]] = []
    errors: list[tuple[dict, str]] = []
    waiting: list[tuple[dict, CompilePending]] = []
    ready: list[tuple[dict, Any]] = []
    submitted = 0
    deadline = None if timeout is None else t0 + timeout

    def attempt(cfg):
        try:
            return kernel(**common, **cfg), None
        except CompilePending as p:
            return None, p
        except CompileError as e:
            errors.append((cfg, str(e)))
            return None, None

    with scope.pool_scope(pool) as p:
        for cfg in configs:  # submit everything before benchmarking anything
            fn, pend = attempt(dict(cfg))
            if pend is not None:
                submitted += 1
                waiting.append((dict(cfg), pend))
            elif fn is not None:
                ready.append((dict(cfg), fn))
        gen = p.generation
        while ready or waiting:
            for cfg, fn in ready:
                times.append((cfg, float(bench(fn, cfg))))
            ready = []
            still = []
            for cfg, pend in waiting:
                if p.state(pend.key, getattr(pend, "root", None)) == PENDING:
                    still.append((cfg, pend))
                    continue
                fn, again = attempt(cfg)
                if again is not None:  # another kernel behind this one (or forgotten): keep waiting
                    still.append((cfg, again))
                elif fn is not None:
                    ready.append((cfg, fn))
            waiting = still
            if waiting and not ready:
                if deadline is not None and time.perf_counter() > deadline:
                    errors.extend((cfg, "autotune time-out: still compiling") for cfg, _ in waiting)
                    break
                gen = p.wait_change(gen, 0.5)
    best = min(times, key=lambda ct: ct[1]) if times else None
    return TuneResult(
        best[0] if best else None,
        best[1] if best else None,
        times,
        errors,
        submitted,
        time.perf_counter() - t0,
    )
