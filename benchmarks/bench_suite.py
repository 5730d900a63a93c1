"""The project's test suite under quack's pytest plugin, side by side:

  cold serial        empty cache, plain pytest (misses wait for their compile)
  cold async         empty cache, --async-compile (misses defer, other tests run)
  cold async -n K    the same under xdist (with --xdist K)
  warm, no plugin    -p no:quack (the baseline for the overhead figure)
  warm, plugin       the plugin loaded, no flags
  warm, async        --async-compile on a warm cache (goal: < 1 % over the baseline)
  first test         seconds from pytest start to the first test starting / the first
                     test finishing, cold, with and without --quack-prewarm

    python benchmarks/bench_suite.py [--repeat 3] [--xdist 2] [-- PYTEST ARGS...]

Default pytest args: tests --ignore=tests/test_plugin.py (the plugin's own tests
start pytest subprocesses with private caches: a constant, not the suite)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = """
import json, os, time
_T = {}
def pytest_runtest_logstart(nodeid, location):
    _T.setdefault("first_start", time.time())
def pytest_runtest_logreport(report):
    if report.when == "call":
        _T.setdefault("first_done", time.time())
def pytest_unconfigure(config):
    p = os.environ.get("QUACK_BENCH_PROBE")
    if p and not hasattr(config, "workerinput"):
        with open(p, "w") as f:
            json.dump(_T, f)
"""


def run(args, cache: Path, probe_dir: Path, extra_env=None) -> dict:
    probe = probe_dir / f"probe-{time.time_ns()}.json"
    env = dict(
        os.environ,
        QUACK_CACHE_DIR=str(cache),
        QUACK_BENCH_PROBE=str(probe),
        PYTHONPATH=os.pathsep.join([str(probe_dir), os.environ.get("PYTHONPATH", "")]),
    )
    env.update(extra_env or {})
    t0 = time.time()
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "quack_bench_probe", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.time() - t0
    tail = r.stdout.strip().splitlines() or [""]
    summary = next((l for l in reversed(tail) if " in " in l and ("passed" in l or "failed" in l)), tail[-1])
    qline = next((l for l in tail if l.startswith("quack: ")), "")
    try:
        t = json.loads(probe.read_text())
    except (OSError, ValueError):
        t = {}
    return {
        "wall": wall,
        "rc": r.returncode,
        "summary": summary.strip("= "),
        "quack": qline,
        "first_start": t.get("first_start", t0) - t0 if t else None,
        "first_done": t.get("first_done", t0) - t0 if t else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="warm runs per variant (best of)")
    ap.add_argument("--xdist", type=int, default=0, help="also run cold async with -n K")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("pytest_args", nargs="*")
    a = ap.parse_args()
    targs = a.pytest_args or ["tests", "--ignore=tests/test_plugin.py"]
    work = Path(tempfile.mkdtemp(prefix="quack-bench-"))
    os.chmod(work, 0o700)
    (work / "quack_bench_probe.py").write_text(PROBE)
    rows = []

    def fresh() -> Path:
        d = work / f"cache-{time.time_ns()}"
        return d

    def add(name, res):
        rows.append((name, res))
        print(
            f"  {name:<28} {res['wall']:8.1f} s  rc={res['rc']}  {res['summary']}",
            file=sys.stderr,
            flush=True,
        )

    add("cold serial", run(targs, fresh(), work))
    add("cold --async-compile", run(targs + ["--async-compile"], fresh(), work))
    if a.xdist:
        add(f"cold serial -n {a.xdist}", run(targs + ["-n", str(a.xdist)], fresh(), work))
        add(f"cold async -n {a.xdist}", run(targs + ["--async-compile", "-n", str(a.xdist)], fresh(), work))
    warm = fresh()
    run(targs, warm, work)  # fill
    variants = {
        "warm, -p no:quack": ["-p", "no:quack"],
        "warm, plugin": [],
        "warm, --async-compile": ["--async-compile"],
    }
    best = {}
    for _ in range(a.repeat):
        for name, extra in variants.items():
            r = run(targs + extra, warm, work)
            if name not in best or r["wall"] < best[name]["wall"]:
                best[name] = r
    for name in variants:
        add(name, best[name])
    for pre in (False, True):
        name = "first test, cold" + (", --quack-prewarm" if pre else "")
        add(name, run(targs + ["--async-compile"] + (["--quack-prewarm"] if pre else []), fresh(), work))

    base = best["warm, -p no:quack"]["wall"]
    print()
    print(f"{'scenario':<36}{'wall s':>9}{'vs base':>9}{'1st test s':>11}{'1st done s':>11}  outcome")
    for name, r in rows:
        rel = f"{(r['wall'] / base - 1) * 100:+.1f}%" if name.startswith("warm") else ""
        fs = f"{r['first_start']:.2f}" if r["first_start"] is not None else "-"
        fd = f"{r['first_done']:.2f}" if r["first_done"] is not None else "-"
        print(f"{name:<36}{r['wall']:>9.1f}{rel:>9}{fs:>11}{fd:>11}  {r['summary']}")
        if r["quack"]:
            print(f"{'':<36}{r['quack']}")
    cold_s, cold_a = rows[0][1]["wall"], rows[1][1]["wall"]
    print(
        f"\ncold speed-up (--async-compile): {cold_s / cold_a:.2f}x; "
        f"warm vs cold serial: {cold_s / best['warm, --async-compile']['wall']:.1f}x; "
        f"plugin overhead on a warm run: {(best['warm, --async-compile']['wall'] / base - 1) * 100:+.2f}%"
    )
    if a.json:
        print(json.dumps({n: r for n, r in rows}, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
