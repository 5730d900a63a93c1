"""Autotuning on the compile pool, the one engine under ``quack tune`` (docs/tuning.md
"The autotune API"): submit every candidate at once, check and benchmark each as soon as its
kernel is ready (cached ones first) while the others compile, re-measure the close calls
interleaved, keep the fastest correct one.

    from quack.compile.autotune import autotune
    res = autotune(my_compile, [{"block": b} for b in (128, 256, 512)],
                   bench=lambda fn, cfg: time_it(fn, x, y),      # seconds, lower wins
                   check=lambda fn, cfg: check_against_torch(fn), # raises when wrong
                   common={"dtype": "bfloat16", "n": 4096})
    res.best, res.best_time, res.errors, res.refused

A candidate whose compile fails, whose benchmark raises or that exceeds the budget is in
``errors``, and so is one whose ``check`` raises ``MeasureError`` (it could not run: a
launch fault, a dead measuring process); one whose ``check`` raises anything else is in
``refused`` and never wins. Timing noise (a
shape that is bimodal from run to run) is handled by the method, not by hand: every
candidate within ``close`` of the best is measured again in ``rounds`` interleaved rounds
(each round visits them in a rotated order) and ranked by the median of its rounds; with
``hold``, the ``baseline`` (today's winner) stays the winner unless the fastest beats it by
more than the spread of their round-by-round ratios, so a re-tune does not rewrite a table
on noise; when three rounds cannot tell, a duel of fresh rounds decides (a sign test), and
when the fastest loses its duel the next fastest get theirs (``contenders``).
Benchmarking runs on the caller's thread, in the caller's CUDA context."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

from quack.compile import pool as _pool
from quack.compile import rounds as rnd
from quack.compile import scope
from quack.compile.tasks import PENDING
from quack.errors import CompileError, CompilePending, MeasureError


@dataclasses.dataclass
class TuneResult:
    best: dict | None
    best_time: float | None
    times: list[tuple[dict, float]]  # final (robust) times, in the order first benchmarked
    errors: list[tuple[dict, str]]  # failed compiles / benchmarks, the budget's leftovers
    submitted: int  # candidates that had to compile
    wall_s: float
    refused: list[tuple[dict, str]] = dataclasses.field(default_factory=list)  # wrong results
    remeasured: int = 0  # candidates measured again as close calls
    held: float | None = None  # ``hold``: the baseline kept, the faster one inside this noise
    held_back: dict | None = None  # ... and that faster one (the challenger the hold kept out)
    compared: int = 0  # the rounds the baseline and the fastest were compared in (with a duel's)
    dueled: int = 0  # candidates that dueled the baseline (the fastest, then the next contenders)

    def table(self) -> str:
        rows = [f"{t * 1e6:10.1f} us  {c}" for c, t in sorted(self.times, key=lambda ct: ct[1])]
        rows += [f"{'wrong':>13}  {c}: {e.splitlines()[0][:120]}" for c, e in self.refused]
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
    check: Callable[[Any, dict], Any] | None = None,
    max_candidates: int | None = None,
    close: float = 0.03,
    rounds: int = 3,
    duel_rounds: int = 6,
    on_result: Callable[[str, dict, Any], None] | None = None,
    confirm: int = 3,
    baseline: dict | None = None,
    hold: float | None = None,
    contenders: int = 3,
) -> TuneResult:
    """Compile ``kernel(**common, **config)`` for every config in parallel and return the
    correct one ``bench(fn, config)`` (seconds) rates fastest. ``timeout``: seconds for the
    whole search (the budget: a candidate still compiling or not yet measured then is an
    error, and the re-measuring rounds stop at it); ``max_candidates``:
    the first that many configs only; ``close``: the fraction of the best time within which
    candidates are re-measured ``rounds`` times, and so are the ``confirm`` fastest and
    ``baseline`` (a config whose time is reported beside the winner's, e.g. today's default)
    whatever their distance: a single low outlier must not win unopposed, nor a single high
    one make a speed-up; ``duel_rounds``: with ``hold``, when the fastest beats ``baseline``
    by more than ``hold`` but inside the noise, that many more rounds of the two alone
    decide: the fastest wins if it is faster by more than ``hold`` in every one of them, or
    if its gain over all the rounds clears their noise; ``contenders``: when the fastest loses
    its duel, the next fastest (by their ratios to ``baseline`` in the same rounds, each faster
    by more than ``hold``) duel it in turn, up to this many duels in all, each deciding by
    its own six fresh rounds; ``hold``: the least gain (a fraction, e.g. 0.005) over ``baseline``
    that may replace it: a faster candidate whose gain is inside that or inside the spread
    of the two's per-round ratios (``rounds.paired_spread``: measured in the same rounds, so a GPU
    that slows as it heats moves both) leaves the baseline the winner (``TuneResult.held``:
    that noise); ``on_result(kind, config, value)``: each "time" /
    "wrong" / "error" as it happens (a progress display)."""
    t0 = time.perf_counter()
    if close < 0 or rounds < 0 or confirm < 0 or duel_rounds < 0 or (hold is not None and not 0 <= hold < 1):
        raise ValueError(
            f"autotune: close (got {close}), rounds (got {rounds}), confirm (got {confirm}) and "
            f"duel_rounds (got {duel_rounds}) must be >= 0, and hold (got {hold}) None or in [0, 1)"
        )
    if isinstance(contenders, bool) or not isinstance(contenders, int) or contenders < 1:
        raise ValueError(f"autotune: contenders must be an int >= 1, got {contenders!r}")
    common = dict(common or {})
    configs = list(configs)[: max_candidates if max_candidates is not None else None]
    times: list[tuple[dict, float]] = []
    fns: list[Any] = []  # beside times: the callable of each benchmarked candidate
    errors: list[tuple[dict, str]] = []
    refused: list[tuple[dict, str]] = []
    waiting: list[tuple[dict, CompilePending]] = []
    ready: list[tuple[dict, Any]] = []
    submitted = 0
    deadline = None if timeout is None else t0 + timeout

    def note(kind: str, cfg: dict, value: Any) -> None:
        if on_result is not None:
            on_result(kind, cfg, value)

    def attempt(cfg):
        try:
            return kernel(**common, **cfg), None
        except CompilePending as p:
            return None, p
        except CompileError as e:
            errors.append((cfg, str(e)))
            note("error", cfg, str(e))
            return None, None

    def measure(cfg, fn) -> None:
        if deadline is not None and time.perf_counter() > deadline:
            # the budget bounds measuring too: with every candidate built already (quack
            # tune --compile-only first) it bounded nothing
            errors.append((cfg, "autotune budget spent: not measured"))
            note("error", cfg, "budget spent")
            return
        if check is not None:
            try:
                check(fn, cfg)
            except MeasureError as e:  # it could not run (a fault, a dead process): failed, not wrong
                errors.append((cfg, f"check: {rnd.first_line(e)}"))
                note("error", cfg, str(e))
                return
            except Exception as e:  # noqa: BLE001 - any other failure of the check refuses the candidate
                refused.append((cfg, rnd.first_line(e)))
                note("wrong", cfg, rnd.first_line(e))
                return
        try:
            t = rnd.seconds(bench(fn, cfg))
        except Exception as e:  # noqa: BLE001 - a candidate that cannot run is an error, not a crash
            errors.append((cfg, f"benchmark: {rnd.first_line(e)}"))
            note("error", cfg, str(e))
            return
        times.append((cfg, t))
        fns.append(fn)
        note("time", cfg, t)

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
                measure(cfg, fn)
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
                    for cfg, _ in waiting:
                        errors.append((cfg, "autotune budget spent: still compiling"))
                        note("error", cfg, "budget spent")
                    break
                gen = p.wait_change(gen, 0.5)
    samples: list[list[float] | None] = []
    remeasured = rnd.remeasure(times, fns, bench, close, rounds, errors, confirm, baseline, deadline, samples)
    best = min(times, key=lambda ct: ct[1]) if times else None
    held = held_back = None
    compared = dueled = 0
    if hold is not None and best is not None and baseline is not None and best[0] != baseline:
        i_base = next((i for i, (cfg, _) in enumerate(times) if cfg == baseline), None)
        if i_base is not None:
            i_best = times.index(best)

            def noise() -> float:
                paired = rnd.paired_spread(samples[i_base], samples[i_best])
                if paired is None:  # too few rounds in common: each one's own spread
                    paired = max(rnd.spread(samples[i_base]), rnd.spread(samples[i_best]))
                return max(hold, paired)

            def gain() -> float:
                return 1 - times[i_best][1] / times[i_base][1]

            least = hold  # (a float here: mypy does not narrow it inside the closure)

            def duel(i: int) -> bool:
                """Six fresh rounds of ``i`` and the baseline alone: faster by more than the
                least gain in every one of them (fresh rounds, not the ones whose low draw
                made it a contender) is a sign test at 1 in 2^duel_rounds. On the H100's 5 ms
                GEMM the ratios of even nine rounds spread 9 % (the clocks swing under the
                power cap), while the candidate was 3.4-5.6 % faster in three tunes of three."""
                nonlocal remeasured, dueled
                sb_, si = samples[i_base], samples[i]  # re-measured: lists, which rnd.duel appends to
                assert sb_ is not None and si is not None
                n_base, n_i = len(sb_), len(si)
                ran = rnd.duel(times, fns, bench, samples, i_base, i, duel_rounds, deadline)
                remeasured += ran
                dueled += ran  # past the budget's deadline no round runs: not a duel
                a, b = sb_[n_base:], si[n_i:]
                return len(a) == len(b) == duel_rounds and all(y < x * (1 - least) for x, y in zip(a, b))

            sa, sb = samples[i_base], samples[i_best]
            won = i_best if gain() > noise() else None
            held = noise()  # the fastest's, if it is held back: after its duel, of all its rounds
            if won is None and hold < gain() and duel_rounds > 0 and sa and sb:
                # Undecided: faster by more than the least gain, but inside the noise of three
                # rounds. More rounds of just the two, decided once at the end (stopping as
                # soon as the gain cleared the noise would favour the challenger). The fastest
                # of a noisy first pass is the one with the luckiest draw (the winner's curse):
                # on the H100 at 8192x28672x8192 (session 24) it lost its duel while a
                # stream-K order that benchmarks/gemm.py had measured 2-5 % faster never
                # dueled; so when it loses, the next fastest get their own duels.
                order = [i_best, *rnd.contenders(samples, i_base, i_best, len(sa), hold)][:contenders]
                for n, i in enumerate(order):
                    swept = duel(i)
                    if n == 0:
                        held = noise()
                    # (swept, and still faster over all its rounds: the median decides the time)
                    if (n == 0 and gain() > held) or (swept and 1 - times[i][1] / times[i_base][1] > hold):
                        won = i
                        break
            # each one's rounds were all measured beside the baseline's (its first ones and its duel)
            shown = samples[won if won is not None else i_best]
            compared = len(shown) if sa and shown else 0
            if won is None:
                best, held_back = times[i_base], times[i_best][0]
            else:
                best, held = times[won], None
    return TuneResult(
        best[0] if best else None,
        best[1] if best else None,
        times,
        errors,
        submitted,
        time.perf_counter() - t0,
        refused,
        remeasured,
        held,
        held_back,
        compared,
        dueled,
    )
