"""How the suite's tests are dealt out to xdist workers (tests/conftest.py's scheduler).

A *unit* is a set of tests one worker runs one after another; a worker takes the next unit
when it runs low. Three rules:

* GPU files (``*_gpu.py`` / ``test_gpu_*.py``): one unit per visible GPU (conftest.py).
* Tests sharing an expensive module- or session-scoped fixture (``SHARED_FIXTURE_UNITS``):
  one unit, so the fixture is built once. Dealt out test by test, each of four workers
  built it for itself: on 2 cores the Ray cluster came up 4 times, the PTX fixtures were
  compiled 4 times over and test_ffi_lean's fixture took 250 s of set-up summed over
  three workers (issue 25: 798 s for the suite, /tmp/cpufast_dur.log).
* Every other test is a unit of its own.

Units are handed out costliest first (``RECORDED_S``): a 200 s test dealt out last ran
alone while the other workers were idle. Before them, the latency-bound units
(``LATENCY_BOUND``): the processes they start talk in chains of short messages, and a
worker lowers its own priority before its first other test (``lower_priority_once``).
Unknown tests cost nothing and keep their collection order, so a stale record only
orders worse, never drops or repeats a test."""

from __future__ import annotations

import os
import zlib

#: Node-id prefixes of tests whose time is wake-up latency, not CPU: a Ray cluster's
#: driver, GCS, raylets and actors pass thousands of short messages, and each hop waits for
#: a CPU. Beside CPU-bound work on the 2-core machine they ran 10-35x slower: three of
#: them took 7.8 / 4.6 / 2.2 s alone, 112 / 97 / 74 s beside four busy loops, 20 / 13 /
#: 10 s beside the same loops at nice 10 (in the suite: 90 / 48 / 42 s, the critical path).
LATENCY_BOUND: tuple[str, ...] = ("tests/test_ray_build.py",)
#: How far a worker lowers its priority before its first test outside ``LATENCY_BOUND``.
NICE_STEP = 10

#: unit name -> node-id prefixes (a file, ``file::function``, or one parametrized case).
#: Keep each unit to the tests that use the shared fixture: a unit runs serially.
SHARED_FIXTURE_UNITS: dict[str, tuple[str, ...]] = {
    # module fixture `ray_cluster` (a two-node Ray cluster). Not the default manifest's
    # build through it: the longest test of the suite (its 51 compiles on two one-CPU
    # actors took 325 s of a 524 s run under the other workers' load), it starts first on
    # a cluster of its own rather than stretch this unit past the rest of the suite.
    "ray-cluster": tuple(
        f"tests/test_ray_build.py::{t}"
        for t in (
            "test_actor_killed_mid_compile_is_retried_on_another_actor",
            "test_failing_config_exit_1_with_compiler_message_keep_going_builds_the_rest",
            "test_ctrl_c_kills_the_actors_and_leaves_no_partial_entry",
            "test_a_cluster_build_fills_the_signed_remote_cache",
            "test_compile_past_the_time_out_kills_its_actor_and_fails_the_key",
            "test_toolchain_stamp_mismatch_is_refused_naming_both",
        )
    ),
    # module fixtures `built` / `runs` (a compile, then three fresh interpreters)
    "ffi-lean": ("tests/test_ffi_lean.py",),
    # session fixture `session_ptx` (tests/kernels/_fixtures.py: every module's PTX cases,
    # 16 cases of 15 kernels, in one batch): the tests that use it, in their three files
    "ptx": (
        "tests/kernels/test_generated_code_cpu.py",
        "tests/kernels/test_gemm_store_cpu.py::test_epilogue_stores_are_vectorized_then_tma",
        "tests/kernels/test_gemm_cpu.py::test_ping_pong_ordering_barrier_phase_flips_every_tile",
        "tests/kernels/test_gemm_cpu.py::test_activation_epilogues_are_short_and_use_no_ieee_division",
        "tests/kernels/test_gemm_fp8_cpu.py::test_promoted_fp8_adds_each_stage_into_an_fp32_total_after_its_mmas",
    ),
    # module fixture `candidates_built` (`quack tune --compile-only` of every candidate)
    "search-space-built": (
        "tests/kernels/test_search_space_cpu.py::test_search_space_candidates_compile_for_sm90",
    ),
    # module fixture `built` (tests/third_party_support.py: the example's `quack build`)
    "third-party-built": ("tests/test_third_party_example.py",),
    # module fixtures `default_wheel` (`quack bundle`) and `installed` (a fresh venv)
    "bundle-default-wheel": tuple(
        f"tests/test_bundles_e2e.py::{t}"
        for t in (
            "test_every_default_configuration_loads_from_the_bundle_empty_cache",
            "test_every_default_configuration_loads_with_the_cache_disabled",
            "test_every_default_configuration_loads_with_a_read_only_cache",
            "test_tampered_wheel_entry_refused_and_verify_fails",
            "test_two_bundles_with_the_same_keys_both_checked",
            "test_uninstalled_bundle_entries_disappear",
        )
    ),
}

#: node-id prefix -> seconds one test matching it took (the longest prefix wins), from
#: `python -m pytest --quack-prebuilt -n auto -q -p no:cacheprovider --durations=120` on
#: the 2-core CI machine (set-up included). Only the order matters.
RECORDED_S: dict[str, float] = {
    "tests/test_ray_build.py::test_default_manifest_through_ray_is_bit_identical_to_local": 45,
    "tests/test_ray_build.py::test_executor_ray_from_the_setting_starts_a_local_instance_with_preload_and_stops_it": 60,
    "tests/test_ray_build.py": 25,
    "tests/test_ffi_lean.py": 15,
    "tests/kernels/test_generated_code_cpu.py": 5,
    "tests/kernels/test_gemm_store_cpu.py": 15,
    "tests/kernels/test_search_space_cpu.py::test_search_space_candidates_compile_for_sm90": 3,
    "tests/test_packaging.py::test_non_editable_install_next_to_huggingface_kernels": 60,
    "tests/test_bundles_e2e.py": 20,
    "tests/test_third_party_example.py": 8,
    "tests/test_reliability_concurrency.py::test_clean_while_eight_processes_load_and_build": 40,
    "tests/test_reliability_concurrency.py::test_runtime_processes_share_compiles": 24,
    "tests/test_failpaths_runtime.py::test_stampede_counts_one_compile_and_the_waits": 35,
    "tests/test_reliability_crash.py::test_ctrl_c_of_quack_build": 30,
    "tests/test_reliability_crash.py::test_sigkill_during_export_loop": 24,
    "tests/test_cli_verify_prewarm.py::test_verify_all_good": 25,
    "tests/test_cli_verify_prewarm.py::test_verify_jobs_reports_are_identical_in_request_order": 20,
    "tests/test_cli_build.py::test_failure_fail_fast_keep_going_and_log": 23,
    "tests/test_cli_build.py::test_two_builds_at_once_compile_each_key_once": 17,
    "tests/test_plugin.py": 12,
    "tests/test_coldstart.py": 15,
    "tests/test_reliability_faults.py::test_real_full_tmpfs": 18,
    "tests/test_writing_kernels_doc.py::test_writing_kernels_example_builds_and_loads": 17,
    # Added in session 5 from a run with per-test start times: the tune test below, not
    # listed, was dealt out last and ran 28 s alone at the end (the suite's tail).
    "tests/test_tune_crash_cpu.py::test_tune_goes_on_past_crashing_candidates_and_keeps_the_old_winner": 28,
    "tests/test_tune_crash_cpu.py": 8,
    "tests/test_cli_verify_prewarm.py": 10,
    "tests/test_fingerprint_sources.py": 7,
    "tests/test_remote_build.py": 7,
    "tests/test_interrupts.py::test_a_thread_stuck_at_exit_cannot_keep_the_build_alive": 9,
    "tests/kernels/test_reference_hooks.py::test_verify_run_without_gpu_says_kernels_were_not_run": 8,
    "tests/test_failpaths_cache.py": 5,
    # session 6: each compiles GEMM PTX (three kernels / one) through the test-ptx cache
    "tests/kernels/test_gemm_cpu.py::test_activation_epilogues_are_short_and_use_no_ieee_division": 8,
    "tests/kernels/test_gemm_cpu.py::test_ping_pong_ordering_barrier_phase_flips_every_tile": 5,
}


def _matches(nodeid: str, prefix: str) -> bool:
    return nodeid == prefix or nodeid.startswith((prefix + "::", prefix + "["))


def shared_unit(nodeid: str, shared=None) -> str | None:
    """The ``SHARED_FIXTURE_UNITS`` (or ``shared``) name the test belongs to, if any."""
    for name, prefixes in (SHARED_FIXTURE_UNITS if shared is None else shared).items():
        if any(_matches(nodeid, p) for p in prefixes):
            return name
    return None


def gpu_file(nodeid: str) -> bool:
    """A test file whose tests launch kernels: named ``*_gpu.py`` or ``test_gpu_*.py``.
    The scheduler sees node ids only, so the file name is the contract."""
    name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return name.endswith("_gpu.py") or name.startswith("test_gpu_")


def unit_of(nodeid: str, n_gpus: int, shared=None) -> str:
    """The xdist unit (scope) of a test."""
    if gpu_file(nodeid):
        return f"gpu{zlib.crc32(nodeid.split('::', 1)[0].encode()) % max(1, n_gpus)}"
    name = shared_unit(nodeid, shared)
    return f"shared:{name}" if name else nodeid


def recorded_s(nodeid: str, recorded=None) -> float:
    recorded = RECORDED_S if recorded is None else recorded
    best = max((p for p in recorded if _matches(nodeid, p)), key=len, default=None)
    return recorded[best] if best else 0.0


def latency_bound(nodeid: str) -> bool:
    return any(_matches(nodeid, p) for p in LATENCY_BOUND)


def order(units: dict[str, dict[str, bool]], recorded=None) -> list[str]:
    """Unit names in the order workers get them: GPU units first (on a GPU host the
    longest by far), then the latency-bound units (each worker's first, so that it runs
    them before ``lower_priority_once`` lowers its priority), then by recorded cost,
    costliest first; ties keep their order."""
    cost = {u: sum(recorded_s(n, recorded) for n in tests) for u, tests in units.items()}
    slow = {u: all(latency_bound(n) for n in tests) for u, tests in units.items()}
    pos = {u: i for i, u in enumerate(units)}
    return sorted(units, key=lambda u: (not u.startswith("gpu"), not slow[u], -cost[u], pos[u]))


_lowered = False


def lower_priority_once(nodeid: str) -> bool:
    """In an xdist worker, before its first test outside ``LATENCY_BOUND``: nice the worker
    (and what it starts from now on) by ``NICE_STEP``, once; True when it did. The
    latency-bound tests' processes keep the normal priority they were started at, so the
    kernel runs them as soon as they wake. CPU time is not lost, only ordered: the
    CPU-bound tests take what those leave. Irreversible without privileges, hence after
    the latency-bound units, which ``order`` deals out first."""
    global _lowered
    if _lowered or latency_bound(nodeid) or not os.environ.get("PYTEST_XDIST_WORKER"):
        return False
    _lowered = True
    try:
        os.nice(NICE_STEP)
    except OSError:  # a sandbox that refuses it: the suite is slower, not wrong
        return False
    return True


def unmatched_prefixes(names: dict[str, set[str]]) -> list[str]:
    """Prefixes of ``SHARED_FIXTURE_UNITS`` whose function is not defined in its test
    file, among the files collected (``names``: file -> names its module defines): a
    renamed test would silently leave its unit (and build the fixture once per worker
    again). Not the collected node ids: `pytest FILE::TEST` collects one test only."""
    out = []
    for prefixes in SHARED_FIXTURE_UNITS.values():
        for p in prefixes:
            file, _, func = p.partition("::")
            if file in names and func and func.split("[", 1)[0] not in names[file]:
                out.append(p)
    return out


def make_scheduler(config, log, n_gpus: int, shared=None, recorded=None):
    """xdist's LoadScopeScheduling over the units above, handed out in ``order``.
    ``shared`` / ``recorded`` replace the tables (tests/test_xdist_units.py)."""
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        _ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid, n_gpus, shared)

        def _assign_work_unit(self, node):
            # The first hand-out comes right after schedule() filled the queue in
            # collection order: reorder it once (a crashed node's units, re-queued
            # later, go to the end as before).
            if not self._ordered:
                self._ordered = True
                q = self.workqueue
                self.workqueue = type(q)((u, q[u]) for u in order(q, recorded))
            super()._assign_work_unit(node)

    return Units(config, log)
