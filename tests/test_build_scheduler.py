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
from quack_build.manifest.config import BuildConfig


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


class _ScriptedExecutor:
    """An executor whose events the test orders: each poll answers every key submitted
    so far, in submission order, failing the keys in ``fail``. What a real pool does when
    two workers finish together: a key's DONE may come in the same batch as, or before,
    another key's FAILED."""

    name = "scripted"
    start_s = 0.0

    def __init__(self, jobs: int, fail: set[str]):
        self.jobs, self.fail = jobs, fail
        self.submitted: list[str] = []
        self.answered = 0
        self.polls: list[int] = []  # keys submitted when each poll was asked

    def start(self, max_jobs: int) -> None:
        pass

    def submit(self, item) -> None:
        self.submitted.append(item.key)

    def poll(self, timeout: float) -> list:
        from quack_build.build.executors.base import DONE, FAILED, Event

        self.polls.append(len(self.submitted))
        batch = self.submitted[self.answered :]
        self.answered = len(self.submitted)
        return [
            Event(FAILED, k, error=ValueError("does not compile"))
            if k in self.fail
            else Event(DONE, k, compiled=True)
            for k in reversed(batch)  # the failing key's event comes last in its batch
        ]

    def cancel(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_fail_fast_submits_nothing_after_a_failure_and_never_more_than_the_window(tmp_path):
    """More keys than the window (jobs + 2): the first batch holds the failing key and
    DONE events of its neighbours; the failure stops the build before any refill, so
    exactly the window was ever submitted. (A real-pool test of this bound depended on
    which of two workers finished first and failed on a busy machine.)"""
    store = DiskStore(tmp_path / "cache", fsync=False)
    cfgs = [_cfg(b) for b in (32, 64, 128, 256, 512)]
    spec = registry.get("toy_scale")
    for dt in ("float32", "bfloat16"):
        for b in (32, 64, 128, 256, 512):
            p = spec.bind((), {"dtype": dt, "block": b})
            cfgs.append(BuildConfig("toy_scale", p, "sm_90a", spec.key(p, "sm_90a"), "test", spec))
    tasks = planning.plan(cfgs, store)
    first = tasks[0].cfg.key
    for jobs in (1, 2, 4):
        for t in tasks:
            t.status = "todo"
        ex = _ScriptedExecutor(jobs, {first})
        opts = scheduler.BuildOptions(jobs=jobs, executor=ex, order="given")
        res = scheduler.BuildSession(tasks, store, opts).run()
        assert ex.submitted[0] == first and len(ex.submitted) == jobs + 2, (jobs, ex.submitted)
        assert res.count(results.FAILED) == 1 and res.count(results.COMPILED) == jobs + 1
        assert res.to_json()["not_built"] == len(tasks) - (jobs + 2)
    # --keep-going: every key, still never more than the window in flight
    for t in tasks:
        t.status = "todo"
    ex = _ScriptedExecutor(2, {first})
    opts = scheduler.BuildOptions(jobs=2, executor=ex, order="given", keep_going=True)
    res = scheduler.BuildSession(tasks, store, opts).run()
    assert len(ex.submitted) == len(tasks) and res.count(results.FAILED) == 1
    assert all(b - a <= 4 for a, b in zip([0, *ex.polls], ex.polls)), ex.polls


class _InterruptedExecutor(_ScriptedExecutor):
    """Answers the first poll; Ctrl-C arrives during the second."""

    def poll(self, timeout: float) -> list:
        if self.polls:
            raise KeyboardInterrupt
        return super().poll(timeout)


def test_interrupted_build_lists_the_keys_it_left_missing(tmp_path):
    """`timeout -s INT 1.6 quack build --json` said "not_built": 6 and "missing_after": []
    (filled only when not interrupted): the JSON read as "nothing missing"."""
    store = DiskStore(tmp_path / "cache", fsync=False)
    tasks = planning.plan([_cfg(b) for b in (32, 64, 128, 256, 512)], store)
    ex = _InterruptedExecutor(1, set())
    res = scheduler.BuildSession(
        tasks, store, scheduler.BuildOptions(jobs=1, executor=ex, order="given")
    ).run()
    doc = res.to_json()
    assert doc["interrupted"] and not doc["ok"] and doc["compiled"] == 3 and doc["not_built"] == 2
    unbuilt = [t.cfg.key for t in tasks if t.status != results.COMPILED]
    assert len(unbuilt) == 2 and sorted(doc["missing_after"]) == sorted(unbuilt)
