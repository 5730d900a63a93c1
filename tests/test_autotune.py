"""The autotune helper: candidates compile in parallel in the pool, each is
benchmarked as soon as it is ready, failures are recorded, the fastest wins."""

import random

import poolkernels
import toykernels

from quack.compile import pool as qpool
from quack.compile.autotune import autotune


def test_autotune_benchmarks_ready_first_skips_failures_picks_fastest(quack_settings):
    tag = random.randrange(1, 1 << 30)
    configs = [
        {"mode": "slow", "tag": tag},
        {"mode": "ok", "tag": tag + 1},
        {"mode": "raise", "tag": tag + 2},
    ]
    fake = {"slow": 1e-5, "ok": 3e-5}
    seen = []

    def bench(fn, cfg):
        assert callable(fn)
        seen.append(cfg["mode"])
        return fake[cfg["mode"]]

    p = qpool.CompilePool(3)
    try:
        res = autotune(poolkernels.pool_fault, configs, bench, pool=p)
    finally:
        p.shutdown()
    assert res.best == {"mode": "slow", "tag": tag} and res.best_time == 1e-5
    assert seen == ["ok", "slow"], "the quick compile is benchmarked while the slow one compiles"
    assert len(res.errors) == 1 and "deliberate compile failure" in res.errors[0][1]
    assert res.submitted == 3
    assert "failed" in res.table()


def test_autotune_cached_candidates_need_no_compile(quack_settings):
    blocks = [{"block": b} for b in (32, 64)]
    first = autotune(
        toykernels.toy_scale,
        blocks,
        lambda fn, cfg: 1.0 / cfg["block"],
        common={"dtype": "float32", "bias": True},
    )
    assert first.submitted == 2 and first.best == {"block": 64}
    again = autotune(
        toykernels.toy_scale,
        blocks,
        lambda fn, cfg: 1.0 / cfg["block"],
        common={"dtype": "float32", "bias": True},
    )
    assert again.submitted == 0 and again.best == {"block": 64} and not again.errors
