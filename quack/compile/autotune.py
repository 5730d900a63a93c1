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
import math
import statistics
import time
from typing import Any, Callable, Sequence

from quack.compile import pool as _pool
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


def _seconds(v: Any) -> float:
    """A benchmark's result as seconds; ValueError unless positive and finite (a NaN won
    every comparison it was in, and a negative time beat every real one)."""
    t = float(v)
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"returned {v!r} seconds (a time must be positive and finite)")
    return t


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return f"{type(e).__name__}: {text}"


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
    of the two's per-round ratios (``paired_spread``: measured in the same rounds, so a GPU
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
                errors.append((cfg, f"check: {_first_line(e)}"))
                note("error", cfg, str(e))
                return
            except Exception as e:  # noqa: BLE001 - any other failure of the check refuses the candidate
                refused.append((cfg, _first_line(e)))
                note("wrong", cfg, _first_line(e))
                return
        try:
            t = _seconds(bench(fn, cfg))
        except Exception as e:  # noqa: BLE001 - a candidate that cannot run is an error, not a crash
            errors.append((cfg, f"benchmark: {_first_line(e)}"))
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
    remeasured = _remeasure(times, fns, bench, close, rounds, errors, confirm, baseline, deadline, samples)
    best = min(times, key=lambda ct: ct[1]) if times else None
    held = held_back = None
    compared = dueled = 0
    if hold is not None and best is not None and baseline is not None and best[0] != baseline:
        i_base = next((i for i, (cfg, _) in enumerate(times) if cfg == baseline), None)
        if i_base is not None:
            i_best = times.index(best)

            def noise() -> float:
                paired = paired_spread(samples[i_base], samples[i_best])
                if paired is None:  # too few rounds in common: each one's own spread
                    paired = max(_spread(samples[i_base]), _spread(samples[i_best]))
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
                sb_, si = samples[i_base], samples[i]  # re-measured: lists, which _duel appends to
                assert sb_ is not None and si is not None
                n_base, n_i = len(sb_), len(si)
                ran = _duel(times, fns, bench, samples, i_base, i, duel_rounds, deadline)
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
                order = [i_best, *_contenders(samples, i_base, i_best, len(sa), hold)][:contenders]
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


def _contenders(samples, i_base: int, i_best: int, n0: int, hold: float) -> list[int]:
    """The candidates, other than the baseline and the fastest, faster than the baseline by
    more than ``hold`` in the first ``n0`` re-measured rounds (by the median of their
    round-by-round ratios: the same rounds, so a GPU's drift moves both), fastest first."""
    base = samples[i_base]
    if not base or n0 < 1:
        return []
    gains = []
    for j, s in enumerate(samples):
        if j in (i_base, i_best) or not s or len(s) < n0:
            continue
        g = 1 - statistics.median(y / x for x, y in zip(base[:n0], s[:n0]))
        if g > hold:
            gains.append((-g, j))
    return [j for _, j in sorted(gains)]


def paired_spread(a: list[float] | None, b: list[float] | None) -> float | None:
    """The noise of comparing ``b`` with ``a`` (two candidates' times in the same
    interleaved rounds): the spread ((max - min) / median) of their per-round ratios b/a;
    None with fewer than three rounds in common. Why the ratios and not each one's own
    spread: a GPU that heats and clocks down over a 5 ms GEMM's rounds slows every
    candidate of a round alike, so each one's rounds spread by 6-12 % (the H100 in
    session 23) while the ratio of two measured in the same round moves by ~1 %; with
    the spreads as noise a candidate 3-4 % faster in every round (the stream-K tile
    order at 8192x28672x8192, 5.37 against 5.56-5.69 ms in benchmarks/gemm.py) was held
    back and the table kept the heuristic."""
    if not a or not b or len(a) != len(b) or len(a) < 3:
        return None
    q = sorted(y / x for x, y in zip(a, b))
    # From six rounds on, one round at each end is dropped for every six: a round the GPU
    # throttled in the middle of cannot veto on its own what the others agree on.
    cut = len(q) // 6
    q = q[cut : len(q) - cut]
    return (q[-1] - q[0]) / statistics.median(q)


def _spread(rounds: list[float] | None) -> float:
    """(max - min) / median of a candidate's re-measured rounds; 0 with fewer than two."""
    if not rounds or len(rounds) < 2:
        return 0.0
    return (max(rounds) - min(rounds)) / statistics.median(rounds)


def _duel(times, fns, bench, samples, i_a, i_b, rounds, deadline) -> int:
    """``rounds`` more rounds of candidates ``i_a`` and ``i_b`` alone (the order alternating),
    appended to their ``samples``; their ``times`` become the median of their first time and
    every round. Stops at ``deadline`` after whole rounds; a failure leaves the samples as
    they are (the caller decides on what it has). Returns 1 if any round ran, else 0."""
    ran = 0
    first = {i: times[i][1] for i in (i_a, i_b)}
    for r in range(rounds):
        if deadline is not None and time.perf_counter() > deadline:
            break
        try:
            got = {i: _seconds(bench(fns[i], times[i][0])) for i in ((i_a, i_b) if r % 2 else (i_b, i_a))}
        except Exception:  # noqa: BLE001 - a failure on a re-run ends the duel, not the search
            break
        for i, t in got.items():
            samples[i].append(t)
        ran = 1
    for i in (i_a, i_b):
        times[i] = (times[i][0], statistics.median([first[i], *samples[i]]))
    return ran


def _remeasure(
    times,
    fns,
    bench,
    close,
    rounds,
    errors,
    confirm=0,
    baseline=None,
    deadline=None,
    samples_out=None,
) -> int:
    """Measure again, ``rounds`` interleaved rounds (rotated order: none always runs first
    after a cold GPU), the candidates within ``close`` of the best, the ``confirm`` fastest
    and ``baseline``; replace each time with the median of its first time and its rounds.
    Returns how many were re-measured; fills ``samples_out`` (beside ``times``) with each
    re-measured candidate's rounds' times (not its first time, taken while the pool
    compiled: _remeasure's reason), None for the others (``paired_spread`` compares two of
    them round by round). Why the fastest even when far apart: on the H200 a
    first measurement taken while the compile pool loaded every core came out 1.6x off
    either way (90 us and 144 us for two ~120 us kernels), and the old rule re-measured
    nothing when no other candidate was within ``close`` of such an outlier."""
    if samples_out is not None:
        samples_out[:] = [None] * len(times)
    if not times or rounds == 0:
        return 0
    best = min(t for _, t in times)
    ranked = sorted(range(len(times)), key=lambda i: times[i][1])
    pick = {i for i, (_, t) in enumerate(times) if t <= best * (1 + close)} | set(ranked[:confirm])
    pick |= {i for i, (cfg, _) in enumerate(times) if baseline is not None and cfg == baseline}
    idx = sorted(pick)
    if len(idx) < 2:
        return 0
    samples = {i: [times[i][1]] for i in idx}
    dead: set[int] = set()
    for r in range(rounds):
        if deadline is not None and time.perf_counter() > deadline:
            break  # the budget's end: whole rounds only, so every candidate has as many
        order = idx[r % len(idx) :] + idx[: r % len(idx)]
        for i in order:
            if i in dead:
                continue
            try:
                samples[i].append(_seconds(bench(fns[i], times[i][0])))
            except Exception as e:  # noqa: BLE001 - failed on a re-run: out of the race
                dead.add(i)
                errors.append((times[i][0], f"benchmark (re-measure): {_first_line(e)}"))
    for i in idx:
        times[i] = (times[i][0], float("inf") if i in dead else statistics.median(samples[i]))
        if samples_out is not None and i not in dead:
            samples_out[i] = samples[i][1:]
    keep = [i for i, ct in enumerate(times) if ct[1] != float("inf")]
    times[:] = [times[i] for i in keep]
    fns[:] = [fns[i] for i in keep]  # beside times: the duel runs fns[i] for times[i]
    if samples_out is not None:
        samples_out[:] = [samples_out[i] for i in keep]
    return len(idx)
