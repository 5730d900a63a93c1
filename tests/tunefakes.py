"""A fake tunable kernel for ``quack tune``'s measuring process (tests/test_tune_crash_cpu.py):
registered like the GEMM (``problem`` sizes, a search space, bench / reference hooks), but
its candidates only pretend to run, in the measuring child, on the CPU. Each candidate's
``mode`` says what its "launch" does there:

- fast / slow: runs; its time is ``us`` microseconds (``timer``, the gpu_time stand-in);
- wrong: its check's comparison fails (AssertionError: a wrong result, not a failure);
- sticky: its check faults like a real launch failure AND poisons the process: every later
  launch in that process fails the same way, as a sticky CUDA error does;
- abort: checks fine, then its timed run calls os.abort() (a dead process);
- hang: checks fine, then its timed run never returns at n == 1 (a pipeline deadlock);
  elsewhere it runs like ``slow``.

A problem of dtype float16 is doomed: every launch of every candidate faults (sticky)."""

from __future__ import annotations

import dataclasses
import os
import threading

from quack import jit_cache
from quack.params import Choice, Config, Dtype, Int
from quack.tuning import TuneConfig, knob
from quack.tuning.override import override

MODES = ("fast", "slow", "wrong", "sticky", "abort", "hang")
_POISONED: list = []  # set by a sticky fault: this process's "context" is lost


@dataclasses.dataclass(frozen=True)
class FakeConfig(TuneConfig):
    mode: str | None = knob(Choice(MODES), "what the fake launch does")
    us: int | None = knob(Int(min=1, max=10_000), "its time when it runs")


OLD = FakeConfig(mode="slow", us=70)  # the "heuristic": today's default, the old winner
CANDIDATES = [
    FakeConfig(mode="sticky", us=1),  # first: without a fresh process every later one would fail
    FakeConfig(mode="fast", us=20),
    FakeConfig(mode="abort", us=1),
    FakeConfig(mode="wrong", us=1),
    FakeConfig(mode="hang", us=30),
    FakeConfig(mode="fast", us=10),
    FakeConfig(mode="slow", us=40),
]


def _derive(params: dict, arch: str) -> FakeConfig:
    return OLD


_derive.classify = lambda p: f"m{p['m']}" if "m" in p else None  # type: ignore[attr-defined]
_derive.n_range = lambda p: (p["n"], p["n"])  # type: ignore[attr-defined]


def search_space(params: dict) -> list:
    return list(CANDIDATES)


@jit_cache(
    "tune_fake",
    params={"dtype": Dtype(), "config": Config(FakeConfig, derive=_derive)},
    reference="tunefakes:check",
    search_space=search_space,
    bench="tunefakes:bench",
    problem=("m", "n", "k"),
)
def tune_fake(dtype: str, config: FakeConfig | None = None, arch: str = "sm_90a"):
    raise AssertionError("tune_fake never compiles: the test's parent side stands in for the load")


def _launch(dtype: str, n: int, timed: bool) -> FakeConfig:
    cfg = override("tune_fake")
    if _POISONED:
        raise RuntimeError("CUDA error: unspecified launch failure (sticky: an earlier launch faulted)")
    if cfg.mode == "sticky" or dtype == "float16":
        _POISONED.append(cfg)
        raise RuntimeError("CUDA error: unspecified launch failure")
    if timed and cfg.mode == "abort":
        os.abort()
    if timed and cfg.mode == "hang" and n == 1:
        threading.Event().wait(3600)  # killed by the parent's time limit long before
    return cfg


def check(params: dict, device) -> None:
    assert params["config"] == override("tune_fake"), "the check runs the candidate's configuration"
    cfg = _launch(params["dtype"], 0, timed=False)
    if cfg.mode == "wrong":
        raise AssertionError("d: 17 elements differ")


def bench(params: dict, device, m: int, n: int, k: int):
    return lambda: _launch(params["dtype"], n, timed=True)


def timer(call, *, device=None) -> float:
    """The gpu_time stand-in: one call, then the configuration's ``us``."""
    return call().us * 1e-6
