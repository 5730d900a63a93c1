"""Does `quack tune` from an EMPTY table reproduce the checked-in table's speed? (issue 25's
goal: every problem of the tuning manifest within 2 % of the checked-in winner, the whole
tune in at most 10 minutes on the H200.) GPU only.

    python benchmarks/bench_tune.py [--manifest manifests/tuning.toml] [--jobs 16]
                                    [--rounds 7] [--fresh PATH] [--skip-tune] [--json OUT]

1. Runs `quack tune --from-empty --table FRESH MANIFEST` as a subprocess (the real command,
   timed as a whole: compiles, measurements, the table write).
2. Side by side in this process: for each problem, the configuration the checked-in table
   picks (BASE) and the one the fresh table picks (FRESH), timed interleaved (B, F, B, F,
   ...) with the tune's own method (``quack.tuning.bench.gpu_time``: CUDA events, L2 flushed
   before each call), ``--rounds`` rounds each, median of round medians. A fresh
   measurement, not the tune's own figures: the winner of a noisy search is biased low (the
   winner's curse), so the tune's times alone would flatter it.
Prints one row per problem (configurations, µs, FRESH/BASE time ratio) and the count within
2 %; a problem where both tables pick the same configuration is timed once (ratio 1)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_tune(manifest: str, fresh: Path, jobs: int) -> float:
    cmd = [
        sys.executable,
        "-m",
        "quack_build",
        "tune",
        "--from-empty",
        "--table",
        str(fresh),
        "-j",
        str(jobs),
    ]
    t0 = time.perf_counter()
    r = subprocess.run(cmd + [manifest], cwd=ROOT, timeout=3600)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"quack tune exited {r.returncode}")
    return dt


def config_from(table, spec, base: dict, arch: str):
    """The configuration the kernel derives for the problem with ``table`` in force (its row,
    else the kernel's heuristic: what a process running with that table would load)."""
    from quack.tuning import use_table

    with use_table(table):
        return spec.bind((), base, arch=arch)["config"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifest", default="manifests/tuning.toml")
    ap.add_argument("--base", default="kernels/tuned/sm_90a.toml", help="the checked-in table")
    ap.add_argument("--fresh", default=None, help="the fresh table (default: a temporary file)")
    ap.add_argument("--skip-tune", action="store_true", help="compare --fresh as it is")
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    fresh = Path(a.fresh) if a.fresh else Path(tempfile.mkdtemp(prefix="quack-tune-")) / "fresh.toml"
    tune_s = None if a.skip_tune else run_tune(a.manifest, fresh, a.jobs)

    import torch

    from quack.tuning import Table, use_config
    from quack.tuning.bench import gpu_time
    from quack_build.cli.context import cli_settings, load_kernels
    from quack_build.cli.tune import default_rows, problems

    s = cli_settings(None, a.jobs, None, [Path(a.manifest)])
    load_kernels(s)
    device = torch.device("cuda", torch.cuda.current_device())
    base_t, fresh_t = Table.load(ROOT / a.base), Table.load(fresh)
    rows, within = [], 0
    print(f"{'problem':40s} {'checked-in':34s} {'fresh':34s} {'us':>9s} {'us':>9s} ratio")
    for c, spec, base, _cands, _cur in problems(s, [Path(a.manifest)], None, 10000, from_empty=True):
        cb, cf = config_from(base_t, spec, base, c.arch), config_from(fresh_t, spec, base, c.arch)
        label = f"{c.kernel} n={base['n']}" + (
            f" w={base['weight_dtype']}" if base.get("weight_dtype", "same") != "same" else ""
        )
        m = default_rows(base["n"])
        mod, _, fn = spec.bench.partition(":")
        call = getattr(__import__(mod, fromlist=[fn]), fn)(spec.plain(dict(base, config=cb)), m, device)
        times: dict[str, list[float]] = {"base": [], "fresh": []}
        cands = [("base", cb)] if cb == cf else [("base", cb), ("fresh", cf)]
        for i in range(a.rounds):
            for name, cfg in cands if i % 2 == 0 else cands[::-1]:  # alternate: no position bias
                with use_config(c.kernel, cfg):
                    times[name].append(gpu_time(call, device=device))
        tb = statistics.median(times["base"])
        tf = tb if cb == cf else statistics.median(times["fresh"])
        ratio = tf / tb
        within += ratio <= 1.02
        rows.append(
            dict(
                problem=label,
                m=m,
                base=cb.label(),
                fresh=cf.label(),
                base_us=tb * 1e6,
                fresh_us=tf * 1e6,
                ratio=ratio,
                same=cb == cf,
            )
        )
        print(
            f"{label:40s} {cb.label():34s} {'(same)' if cb == cf else cf.label():34s} "
            f"{tb * 1e6:9.1f} {tf * 1e6:9.1f} {ratio:6.3f}",
            flush=True,
        )
    print(
        f"\n{within} of {len(rows)} problems within 2 % of the checked-in table"
        + (f"; quack tune --from-empty took {tune_s:.1f} s" if tune_s is not None else "")
    )
    if a.json:
        Path(a.json).write_text(json.dumps(dict(tune_s=tune_s, rows=rows, within=within), indent=1))


if __name__ == "__main__":
    main()
