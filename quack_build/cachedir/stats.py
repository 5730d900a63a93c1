"""What ``quack cache stats`` shows: the cache's files summarized from
quack_build.cachedir.walk's walk (per fingerprint, stamp and kernel; debris; planted
links), and the usage journal summarized per kernel with the slowest compiles."""

from __future__ import annotations

import time
from pathlib import Path

from quack.cache import orphans
from quack_build.cachedir.walk import (
    SCRATCH_MAX_AGE,
    planted,
    quarantine_files,
    scratch_files,
    stamp_is_current,
    walk,
)


def summarize(root: Path, current_srcfp: dict[str, str] | None = None) -> dict:
    """Everything ``quack cache stats`` shows about the files (the journal is separate)."""
    now = time.time()
    fps = []
    kernels: dict[str, dict] = {}
    totals = {
        "entries": 0,
        "bytes": 0,
        "current_entries": 0,
        "current_bytes": 0,
        "stale_entries": 0,
        "stale_bytes": 0,
        "unknown_entries": 0,
        "unknown_bytes": 0,
    }
    debris = {
        "tmp_files": 0,
        "tmp_bytes": 0,
        "orphan_objects": 0,
        "orphan_bytes": 0,
        "orphan_so_files": 0,
        "orphan_so_bytes": 0,
    }
    for d in walk(root, current_srcfp):
        n, b = d.entries, d.bytes
        fps.append(
            {
                "stamp": d.stamp,
                "kernel": d.kernel,
                "srcfp": d.srcfp,
                "status": d.status,
                "why": d.why,
                "entries": n,
                "bytes": b,
            }
        )
        totals["entries"] += n
        totals["bytes"] += b
        totals[f"{d.status}_entries"] += n
        totals[f"{d.status}_bytes"] += b
        k = kernels.setdefault(d.kernel, {"current": 0, "stale": 0, "unknown": 0, "bytes": 0})
        k[d.status] += n
        k["bytes"] += b
        for t in d.tmps:
            if orphans.tmp_is_orphan(t[1], t[3], now):
                debris["tmp_files"] += 1
                debris["tmp_bytes"] += t[2]
        for kf in d.keys.values():
            if ".o" in kf.sizes and ".json" not in kf.sizes:
                debris["orphan_objects"] += 1
                debris["orphan_bytes"] += kf.sizes[".o"]
            elif ".so" in kf.sizes and ".so.json" not in kf.sizes:  # an interrupted link
                debris["orphan_so_files"] += 1
                debris["orphan_so_bytes"] += kf.sizes[".so"]
    old_scratch = [x for x in scratch_files(root) if now - x[2] > SCRATCH_MAX_AGE]
    debris["scratch_files"] = len(old_scratch)
    debris["scratch_bytes"] = sum(x[1] for x in old_scratch)
    q = quarantine_files(root)
    debris["quarantined_files"] = len(q)
    debris["quarantined_bytes"] = sum(x[1] for x in q)
    per_stamp: dict[str, dict] = {}
    for f in fps:
        stamp = str(f["stamp"])
        s = per_stamp.setdefault(
            stamp,
            {"stamp": stamp, "current": stamp_is_current(stamp), "entries": 0, "bytes": 0, "fingerprints": 0},
        )
        s["entries"] += f["entries"]
        s["bytes"] += f["bytes"]
        s["fingerprints"] += 1
    return {
        "root": str(root),
        "totals": totals,
        "stamps": list(per_stamp.values()),
        "fingerprints": fps,
        "kernels": kernels,
        "debris": debris,
        "planted": [{"path": str(p), "what": w} for p, w in planted(root)],
    }


def journal_summary(records: list[dict], top: int = 10) -> dict:
    per_kernel: dict[str, dict] = {}
    slow: list[dict] = []
    for r in records:
        k = per_kernel.setdefault(
            str(r.get("kernel")),
            {
                "hits": 0,
                "misses": 0,
                "compiles": 0,
                "compile_s": 0.0,
                "waits": 0,
                "build_compiles": 0,
                "build_compile_s": 0.0,
                "keys": set(),
            },
        )
        for f in ("hits", "misses", "compiles", "waits"):
            v = r.get(f, 0)
            k[f] += v if isinstance(v, int) else 0
        cs = r.get("compile_s", 0.0)
        cs = cs if isinstance(cs, (int, float)) else 0.0
        k["compile_s"] += cs
        where = "build" if r.get("where") == "build" else "run"  # older records: run time
        if where == "build":
            c = r.get("compiles", 0)
            k["build_compiles"] += c if isinstance(c, int) else 0
            k["build_compile_s"] += cs
        k["keys"].add(r.get("key"))
        if r.get("compiles") and cs > 0:
            slow.append(
                {
                    "kernel": r.get("kernel"),
                    "params": r.get("params"),
                    "arch": r.get("arch"),
                    "compile_s": cs,
                    "t": r.get("t"),
                    "where": where,
                }
            )
    slow.sort(key=lambda x: -x["compile_s"])
    for k in per_kernel.values():
        k["keys"] = len(k["keys"])
        k["compile_s"] = round(k["compile_s"], 3)
        k["build_compile_s"] = round(k["build_compile_s"], 3)
    return {"records": len(records), "kernels": per_kernel, "slowest": slow[:top]}
