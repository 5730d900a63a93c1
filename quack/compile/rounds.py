"""The measuring rounds under ``quack.compile.autotune`` (docs/tuning.md "How a candidate is
measured"): the interleaved re-measure of the close calls, the paired noise of two candidates
measured in the same rounds, the duel of fresh rounds that decides a hold, and which candidates
get one. Pure functions over the candidates' times and round samples; ``bench`` is the
caller's, run on the caller's thread."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any


def seconds(v: Any) -> float:
    """A benchmark's result as seconds; ValueError unless positive and finite (a NaN won
    every comparison it was in, and a negative time beat every real one)."""
    t = float(v)
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"returned {v!r} seconds (a time must be positive and finite)")
    return t


def first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return f"{type(e).__name__}: {text}"


def contenders(samples, i_base: int, i_best: int, n0: int, hold: float) -> list[int]:
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


def spread(rounds: list[float] | None) -> float:
    """(max - min) / median of a candidate's re-measured rounds; 0 with fewer than two."""
    if not rounds or len(rounds) < 2:
        return 0.0
    return (max(rounds) - min(rounds)) / statistics.median(rounds)


def duel(times, fns, bench, samples, i_a, i_b, rounds, deadline) -> int:
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
            got = {i: seconds(bench(fns[i], times[i][0])) for i in ((i_a, i_b) if r % 2 else (i_b, i_a))}
        except Exception:  # noqa: BLE001 - a failure on a re-run ends the duel, not the search
            break
        for i, t in got.items():
            samples[i].append(t)
        ran = 1
    for i in (i_a, i_b):
        times[i] = (times[i][0], statistics.median([first[i], *samples[i]]))
    return ran


def remeasure(
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
    compiled: remeasure's reason), None for the others (``paired_spread`` compares two of
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
                samples[i].append(seconds(bench(fns[i], times[i][0])))
            except Exception as e:  # noqa: BLE001 - failed on a re-run: out of the race
                dead.add(i)
                errors.append((times[i][0], f"benchmark (re-measure): {first_line(e)}"))
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
