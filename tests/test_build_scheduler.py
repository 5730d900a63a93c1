"""Scheduler pieces without compiling: longest-first order from past compile times."""

from __future__ import annotations

import json
import time

import toykernels  # noqa: F401

from quack import registry
from quack.cache import journal
from quack.cache.store import DiskStore
from quack_build.build import plan as planning
from quack_build.build import results, scheduler
from quack_build.manifest.read import BuildConfig


def _cfg(block: int) -> BuildConfig:
    spec = registry.get("toy_scale")
    p = spec.bind((), {"dtype": "float16", "block": block})
    return BuildConfig("toy_scale", p, "sm_90a", spec.key(p, "sm_90a"), "test", spec)


def test_longest_first_from_metadata_of_any_fingerprint_and_journal(tmp_path):
    root = tmp_path / "cache"
    cfgs = [_cfg(b) for b in (32, 64, 128, 256, 512)]
    # Compile times seen before: in an older source fingerprint's metadata (an edit
    # moves the directory, not the key) and in the journal.
    old = root / "v1" / "py3.11-cutlass4.0.0-cu12-tvmffi0.1.0-sm_90a" / "toy_scale" / "feedfacefeedface"
    old.mkdir(parents=True)
    (old / f"{cfgs[1].key}.json").write_text(json.dumps({"compile_s": 5.0}))
    (old / f"{cfgs[3].key}.json").write_text(json.dumps({"compile_s": 1.0}))
    journal.append(
        root,
        [
            {
                "kernel": "toy_scale",
                "key": cfgs[4].key,
                "compiles": 1,
                "compile_s": 9.0,
                "hits": 0,
                "misses": 1,
                "t": time.time(),
            }
        ],
    )
    tasks = [results.Task(c) for c in cfgs]
    known = planning.past_compile_times(root, tasks)
    assert known == {cfgs[1].key: 5.0, cfgs[3].key: 1.0, cfgs[4].key: 9.0}
    ordered = planning.order_longest_first(tasks, known)
    assert [t.cfg.params["block"] for t in ordered][:2] == [512, 64]
    # unknown keys get the kernel's mean (5.0), after the known key with the same time
    assert ordered[2].est_s == ordered[3].est_s == (5.0 + 1.0 + 9.0) / 3
    assert ordered[-1].cfg.params["block"] == 256


def test_plan_marks_cached_and_run_with_nothing_to_do(tmp_path):
    store = DiskStore(tmp_path / "cache", fsync=False)
    tasks = planning.plan([_cfg(32)], store)
    assert tasks[0].status == "todo"
    tasks[0].status = results.CACHED  # pretend; run() must not start a pool for it
    res = scheduler.BuildSession(tasks, store, scheduler.BuildOptions(jobs=4)).run()
    assert res.jobs == 4 and res.count(results.CACHED) == 1
    assert res.missing_after == [tasks[0].cfg.key] and not res.ok
