"""``quack build --trace``: a build's result as Chrome trace-event JSON (chrome://tracing,
ui.perfetto.dev), one row per worker."""

from __future__ import annotations

import json
from pathlib import Path

from quack_build.build.results import BuildResult


def write_trace(path: Path, res: BuildResult, t0: float) -> None:
    """Chrome trace-event JSON (chrome://tracing, ui.perfetto.dev): one row per worker."""
    ev = [
        {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "quack build"}},
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "scheduler"}},
    ]
    if res.plan_s:
        ev.append(
            {
                "name": "plan (expand, look up cache)",
                "cat": "plan",
                "ph": "X",
                "pid": 1,
                "tid": 0,
                "ts": 0,
                "dur": int(res.plan_s * 1e6),
            }
        )
    # One row per worker: a local pool's by pid; a cluster's by its lane (an actor's
    # node and pid: pids of different nodes may coincide).
    lanes = sorted({(t.lane, t.pid) for t in res.tasks if t.pid or t.lane}, key=lambda x: (x[0], x[1]))
    tids = {}
    for i, (lane, pid) in enumerate(lanes):
        tids[(lane, pid)] = tid = (pid if not lane else 100000 + i) or 100000 + i
        name = f"worker {i + 1} (pid {pid})" if not lane else lane
        ev.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}})
    for t in res.tasks:
        if not (t.pid or t.lane) or t.end <= 0:
            continue
        ev.append(
            {
                "name": t.cfg.kernel,
                "cat": t.status,
                "ph": "X",
                "pid": 1,
                "tid": tids[(t.lane, t.pid)],
                "ts": int((t.start - t0) * 1e6),
                "dur": max(1, int((t.end - t.start) * 1e6)),
                "args": {
                    "params": t.cfg.plain_params,
                    "arch": t.cfg.arch,
                    "key": t.cfg.key,
                    "status": t.status,
                    "compile_s": round(t.compile_s, 4),
                    **({"error": t.error} if t.error else {}),
                },
            }
        )
    doc = {
        "traceEvents": ev,
        "displayTimeUnit": "ms",
        "otherData": {
            "tool": "quack build",
            "summary": {k: v for k, v in res.to_json().items() if k != "keys"},
        },
    }
    Path(path).write_text(json.dumps(doc, indent=None), encoding="utf-8")
