"""Issue 16's check of GPU pinning on a real multi-GPU host, kept in the suite.

Each xdist worker that used CUDA records, at its session end, its
CUDA_VISIBLE_DEVICES, the UUID of the device it sees
(``torch.cuda.get_device_properties(0).uuid``) and its PID; the controller
collects the records (xdist's workeroutput) and checks at session end:

* workers <= GPUs: every worker has a distinct GPU;
* more workers: round-robin (no GPU holds two workers while another holds none).

A violation fails the session (exit status 1) with the records printed. Nothing
is checked (a no-op) without xdist, without pinning, or where no worker
initialised CUDA. The hooks are imported into tests/conftest.py."""

from __future__ import annotations

import os
import sys
from collections import Counter

import pytest

KEY = "quack_gpupin"


def record() -> dict | None:
    """This worker's record, or None if it cannot apply (no CUDA used here)."""
    torch = sys.modules.get("torch")
    wid = os.environ.get("PYTEST_XDIST_WORKER")
    if torch is None or not wid:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        uuid = str(torch.cuda.get_device_properties(0).uuid)
    except Exception:  # noqa: BLE001 - no usable GPU here: nothing to check
        return None
    from quack.testing import gpus

    return {
        "worker": wid,
        "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "uuid": uuid,
        "pid": os.getpid(),
        "pinned": gpus.current is not None,
        "workers": int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1),
    }


def check(records: list[dict], n_gpus: int, n_workers: int) -> list[str]:
    """Problems with the pinning the records show ([] = fine or not applicable)."""
    recs = [r for r in records if r.get("pinned")]
    if len(recs) < 2 or n_gpus < 1:
        return []
    from quack.testing.gpus import worker_index

    problems = []
    if n_workers <= n_gpus:
        by_uuid: dict[str, list[str]] = {}
        for r in recs:
            by_uuid.setdefault(r["uuid"], []).append(r["worker"])
        for uuid, ws in by_uuid.items():
            if len(ws) > 1:
                problems.append(
                    f"{len(ws)} workers share GPU {uuid} with {n_workers} workers on "
                    f"{n_gpus} GPUs: {', '.join(sorted(ws))}"
                )
        return problems
    # More workers than GPUs: workers i and j share a GPU exactly when i = j mod n_gpus.
    for a in recs:
        for b in recs:
            if a["worker"] >= b["worker"]:
                continue
            same = a["uuid"] == b["uuid"]
            want = worker_index(a["worker"]) % n_gpus == worker_index(b["worker"]) % n_gpus
            if same != want:
                problems.append(
                    f"{a['worker']} and {b['worker']} are {'on' if same else 'not on'} "
                    f"the same GPU; round-robin over {n_gpus} GPUs says otherwise"
                )
    if len(recs) == n_workers:
        counts = Counter(r["uuid"] for r in recs)
        if len(counts) < n_gpus or max(counts.values()) - min(counts.values()) > 1:
            problems.append(f"workers per GPU {dict(counts)}: not round-robin over {n_gpus} GPUs")
    return problems


# -- hooks (imported by tests/conftest.py) -----------------------------------------------------
_collected: list[dict] = []
_problems: list[str] = []


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if hasattr(config, "workerinput"):  # an xdist worker: hand our record to the controller
        r = record()
        if r is not None:
            config.workeroutput[KEY] = r
        return
    if not _collected:
        return
    from quack.testing.gpus import visible_gpus

    n_workers = max(r["workers"] for r in _collected)
    _problems[:] = check(_collected, len(visible_gpus()), n_workers)
    if _problems and session.exitstatus == 0:
        session.exitstatus = 1


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent under -p no:xdist
def pytest_testnodedown(node, error):
    r = (getattr(node, "workeroutput", None) or {}).get(KEY)
    if r is not None:
        _collected.append(r)


def pytest_terminal_summary(terminalreporter):
    if not _collected:
        return
    tr = terminalreporter
    tr.write_line(
        f"quack GPU pinning: {len(_collected)} workers on "
        f"{len({r['uuid'] for r in _collected})} GPUs" + ("" if not _problems else " -- PROBLEM"),
        red=bool(_problems),
    )
    for r in sorted(_collected, key=lambda r: r["worker"]):
        tr.write_line(f"  {r['worker']}: CUDA_VISIBLE_DEVICES={r['cvd']} uuid={r['uuid']} pid={r['pid']}")
    for p in _problems:
        tr.write_line(f"  {p}", red=True)
