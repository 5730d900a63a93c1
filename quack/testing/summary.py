"""The controller (single process, or the xdist controller): checks at session end
that every collected, non-deselected test reported, and prints one summary line
(keys submitted, failed, deferrals, compile seconds, OOM retries)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from quack.testing.deferral import MAX_DEFERS


class Controller:
    def __init__(self, config, async_on, local=None, note=None):
        self.config = config
        self.note = note  # said once, in the controller's report header
        self.max_defers = int(config.getoption("quack_max_defers", MAX_DEFERS))  # >= 0: checked
        self.async_on = async_on
        self.local = local
        self.collected: set[str] = set()
        self.reported: set[str] = set()
        self.worker_summaries: list[dict] = []
        self.workers_up = 0  # xdist workers started; each should send its summary at its end
        self.t_start = time.time()

    def pytest_report_header(self, config):
        return [self.note] if self.note else []

    def pytest_collection_finish(self, session):
        if self.local is not None:
            self.collected.update(i.nodeid for i in session.items)

    def pytest_xdist_node_collection_finished(self, node, ids):
        self.collected.update(ids)

    def pytest_testnodeready(self, node):
        self.workers_up += 1

    def pytest_testnodedown(self, node, error):
        out = getattr(node, "workeroutput", None) or {}
        if "quack" in out:
            self.worker_summaries.append(out["quack"])

    def pytest_runtest_logreport(self, report):
        self.reported.add(report.nodeid)

    def _total(self) -> dict:
        parts = list(self.worker_summaries)
        if self.local is not None:
            parts.append(self.local.summary())
        tot: dict[str, Any] = {
            "submitted": 0,
            "failed": 0,
            "compiled": 0,
            "compile_s": 0.0,
            "deferrals": 0,
            "forced_sync": 0,
            "timeouts": 0,
            "worker_deaths": 0,
            "awaited_external": 0,
        }
        oom, saved, errors, setup_errors, firsts = [], [], [], [], []
        for p in parts:
            for k in tot:
                tot[k] += p.get(k, 0)
            oom += p.get("oom_retried", [])
            saved += p.get("oom_saved", [])
            errors += p.get("errors", [])
            setup_errors += p.get("setup_errors", [])
            if p.get("t_first_test"):
                firsts.append(p["t_first_test"])
        tot.update(
            oom_retried=oom,
            oom_saved=saved,
            errors=errors,
            setup_errors=setup_errors,
            first_test_s=(min(firsts) - self.t_start) if firsts else None,
        )
        return tot

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        config = session.config
        self.integrity_missing = []
        if getattr(config.option, "collectonly", False) or exitstatus not in (0, 1):
            return
        if session.shouldstop or session.shouldfail:
            return
        missing = sorted(self.collected - self.reported)
        if missing:
            self.integrity_missing = missing
            session.exitstatus = 1
        if self._total()["setup_errors"]:
            session.exitstatus = 1

    def pytest_terminal_summary(self, terminalreporter):
        tr = terminalreporter
        tot = self._total()
        missing = getattr(self, "integrity_missing", [])
        if missing:
            tr.write_line(
                f"quack: INTEGRITY ERROR: {len(missing)} collected test(s) produced no report "
                f"(lost with a crashed worker?):",
                red=True,
                bold=True,
            )
            for n in missing[:20]:
                tr.write_line(f"  {n}", red=True)
        for e in tot["setup_errors"]:
            tr.write_line(f"quack: {e}", red=True)
        if not (self.async_on or tot["oom_retried"] or tot["submitted"]):
            return
        # A worker's counts come with its end-of-session message; after Ctrl-C (or a
        # crash) the controller no longer waits for it, and the line said "0 keys
        # submitted ... 0 deferrals" for a run that had submitted and deferred.
        unknown = self.workers_up - len(self.worker_summaries)
        if unknown > 0:
            why = "the session ended before they reported (interrupted, or a worker crashed)"
            if unknown >= self.workers_up:
                tr.write_line(f"quack: keys submitted, failed and deferrals unknown: {why}", yellow=True)
                return
            tr.write_line(
                f"quack: the counts of {unknown} of {self.workers_up} xdist workers are unknown: {why}"
            )
        line = (
            f"quack: {'at least ' if unknown > 0 else ''}{tot['submitted']} keys submitted ({tot['compiled']} compiled, "
            f"{tot['compile_s']:.1f} s compile), {tot['failed']} failed, "
            f"{tot['deferrals']} deferrals"
        )
        extra = []
        if tot["forced_sync"]:
            extra.append(f"{tot['forced_sync']} synchronous after {self.max_defers} deferrals")
        if tot["awaited_external"]:
            extra.append(f"{tot['awaited_external']} awaited from other processes")
        if tot["timeouts"]:
            extra.append(f"{tot['timeouts']} timed out")
        if tot["worker_deaths"]:
            extra.append(f"{tot['worker_deaths']} worker deaths")
        if tot["oom_retried"]:
            extra.append(
                f"{len(tot['oom_retried'])} retried after CUDA OOM "
                f"({len(tot['oom_saved'])} saved: passed on the retry)"
            )
        if extra:
            line += ", " + ", ".join(extra)
        bad = tot["failed"] or tot["oom_retried"]
        tr.write_line(line, yellow=bool(bad) and not tot["failed"], red=bool(tot["failed"]))
        saved_set = set(tot["oom_saved"])
        for n in tot["oom_retried"][:20]:
            how = "saved" if n in saved_set else "not saved"
            tr.write_line(f"  CUDA OOM retry: {n} ({how})", yellow=True)
        for e in tot["errors"][:5]:
            tr.write_line("  compile error: " + e.splitlines()[0][:300] if e else "", red=True)
