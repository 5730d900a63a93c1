"""First key per worker against the median key, with and without ``[build] preload``
(issue 27's goal: first key <= 1.2x the median with preload). Builds this example's
manifest (or MANIFEST) with --force into a temporary cache, twice, and prints per run:
the median compile time of a key, each worker's first key, and their ratio.

    python bench_first_key.py [--jobs 16] [--repeat 3] [MANIFEST]

Run it from anywhere; it runs `quack build` in a copy of this folder."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build(proj: Path, cache: Path, jobs: int, manifest: str | None) -> dict:
    trace = cache.with_name(cache.name + "-trace.json")
    cmd = [sys.executable, "-m", "quack_build", "build", "--json", "--force", "--jobs", str(jobs)]
    cmd += ["--trace", str(trace)]
    cmd += [manifest] if manifest else []
    r = subprocess.run(
        cmd,
        cwd=proj,
        capture_output=True,
        text=True,
        timeout=3600,
        env={**__import__("os").environ, "QUACK_CACHE_DIR": str(cache)},
    )
    if r.returncode != 0:
        raise SystemExit(f"quack build failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    res = json.loads(r.stdout)
    # When each key started: the trace's compile events (the JSON lists keys in plan
    # order, which is not the order workers took them once past compile times reorder it).
    events = json.loads(trace.read_text())["traceEvents"]
    res["starts"] = {
        e["args"]["key"]: e["ts"] for e in events if e.get("ph") == "X" and "key" in e.get("args", {})
    }
    return res


def first_key_ratios(res: dict) -> tuple[float, list[float]]:
    """(median compile_s, each worker's first key / median): a worker's first key is the
    one it started first (the trace's start times)."""
    keys = [k for k in res["keys"] if k["status"] == "compiled"]
    med = statistics.median(k["compile_s"] for k in keys)
    first: dict[int, float] = {}
    for k in sorted(keys, key=lambda k: res["starts"][k["key"]]):
        first.setdefault(k["worker"], k["compile_s"])
    return med, [v / med for v in first.values()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("manifest", nargs="?")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="quack-bench-") as d:
        for label, keep in (("with preload", True), ("without preload", False)):
            proj = Path(d) / label.replace(" ", "_")
            shutil.copytree(HERE, proj, ignore=shutil.ignore_patterns("__pycache__"))
            if not keep:
                toml = proj / "quack.toml"
                toml.write_text(
                    "".join(ln for ln in toml.read_text().splitlines(True) if not ln.startswith("preload"))
                )
            for i in range(a.repeat):
                res = build(proj, Path(d) / f"cache-{label.replace(' ', '_')}-{i}", a.jobs, a.manifest)
                med, ratios = first_key_ratios(res)
                print(
                    f"{label:16s} run {i + 1}: median key {med:.2f}s; first key per worker / median: "
                    f"max {max(ratios):.2f}x, mean {statistics.mean(ratios):.2f}x ({len(ratios)} workers); "
                    f"start-up {res['pool_start_s']:.1f}s (preload {res['preload_s']:.1f}s)"
                )


if __name__ == "__main__":
    main()
