"""``quack verify``: every configuration of the manifests is present for the
current fingerprint, its checksum intact, built for the requested arch (read
from the cubin embedded in the .o) and loadable in a fresh process that finds
the entry function; with ``--run`` (GPU) each kernel's reference hook runs.
Each entry also reports its kernels' registers and local-memory stack frame
(``resources``): a frame is a report, not a problem.

Read-only: a corrupt entry is reported, not quarantined. Each problem names its file
and the fix; ``--run`` counts the entries it ran and those it could not ("no reference
hook"), and one that ran none is no success."""

from __future__ import annotations

import dataclasses
import os
import stat
import time
from pathlib import Path

from quack.cache import fsutil
from quack.cache.contract import MISSING
from quack.cache.store import DiskStore
from quack.compile import builder
from quack.errors import CacheError
from quack_build.verify.cubin import arch_matches, gpu_codes
from quack_build.verify.loaders import load_fresh, start_loaders
from quack_build.verify.resources import resources

# What fixes each kind of problem (named in the problem itself, after the file's path).
REBUILD = "quack build moves the entry to quarantine/ and rebuilds it"
FORCE = "quack build --force rebuilds it"
RELINK = (
    "the runtime skips it (with a warning) and links a new one from the verified .o when the kernel "
    "next loads; or delete it and its .so.json"
)


def check_static(store: DiskStore, cfg) -> tuple[list[str], dict]:
    """Presence, checksum and arch of one configuration, and its kernels' registers and
    stack frames (``resources``), without touching the cache. Each problem names the
    file it is about and what fixes it. ``info``: "obj" (the object's path), "so" (the
    linked .so's path when there is one, damaged or not), "load_so" (the .so to load: a
    verified one only), "gpu_code", "resources"."""
    ref = builder.entry_ref(cfg.spec, cfg.params, cfg.arch)
    p = store.paths(ref)
    info: dict = {"obj": str(p["obj"]), "so": None, "load_so": None, "gpu_code": [], "resources": []}
    try:
        found = store.inspect(ref)
    except CacheError as e:  # a planted link or file on the entry's path: name it
        if e.path and Path(e.path) != Path(store.root):
            return [f"planted in the cache: {e}"], info
        raise
    lock = p["lock"]
    try:
        lock_mode = os.lstat(lock).st_mode
    except FileNotFoundError:
        lock_mode = stat.S_IFREG
    if not stat.S_ISREG(lock_mode):  # a symlink, or a FIFO that used to hang the runtime
        what = "a symbolic link (never followed)" if stat.S_ISLNK(lock_mode) else "not a regular file"
        return [
            f"planted in the cache: the lock file {lock} is {what}; "
            f"quack build refuses the key; quack cache clean removes it"
        ], info
    if found.status == MISSING:
        other = _elsewhere(store, ref)
        return [
            (
                "missing: not built for the current fingerprint"
                + (f" (a stale build exists: {other})" if other else "")
                + "; run quack build"
            )
        ], info
    if not found.ok:
        return [f"{found.problem}: {found.problem_file}; {REBUILD}"], info
    data = fsutil.read_nofollow(found.obj)
    codes = gpu_codes(data)
    info["gpu_code"] = [c.arch for c in codes]
    info["resources"] = [dataclasses.asdict(k) for k in resources(data)]
    problems = []
    if not codes:
        problems.append(f"no embedded GPU code found in the object {found.obj}; {FORCE}")
    elif not arch_matches(cfg.arch, codes):
        problems.append(
            f"built for {', '.join(c.arch for c in codes)}, expected {cfg.arch}: {found.obj}; {FORCE}"
        )
    if found.so_problem:
        problems.append(f"the linked kernel {p['so']} is damaged ({found.so_problem}); {RELINK}")
    info["load_so"] = str(found.so) if found.so else None
    info["so"] = str(p["so"]) if found.so or found.so_problem else None
    return problems, info


def _elsewhere(store: DiskStore, ref) -> str:
    d = store.entry_dir(ref)
    try:
        for fp in os.scandir(d.parent):
            if fp.name != d.name and os.path.exists(os.path.join(fp.path, ref.key + ".json")):
                return f"source fingerprint {fp.name}"
    except OSError:
        pass
    return ""


def verify(
    configs, store: DiskStore, *, load: bool = True, run: bool = False, console=None, jobs: int = 1
) -> dict:
    t0 = time.time()
    configs = list(configs)
    # The loaders start first: their imports (seconds) overlap the static checks below
    # (checksums of every object: ~1.2 s of 1,178 entries on the H200 host)
    started = start_loaders(max(1, min(jobs, len(configs))), run) if (load or run) and configs else None
    try:
        return _verify(configs, store, load, run, console, jobs, started, t0)
    finally:
        if started is not None:
            started.close()


def _verify(configs, store, load, run, console, jobs, started, t0) -> dict:
    rows = []
    for c in configs:
        problems, info = check_static(store, c)
        rows.append(
            {
                "kernel": c.kernel,
                "params": c.plain_params,
                "arch": c.arch,
                "key": c.key,
                "obj": info["obj"],
                "so": info["so"],
                "problems": problems,
                "gpu_code": info["gpu_code"],
                # per function: registers a thread and its local-memory stack frame (bytes)
                "resources": info["resources"],
                "_cfg": c,
                "_info": info,
            }
        )
    note = ""
    if (load or run) and rows:
        todo = [r for r in rows if not r["problems"]]
        reqs = [
            {
                "key": r["_cfg"].key,
                "obj": r["_info"]["obj"],
                "so": r["_info"]["load_so"],
                "kernel": r["_cfg"].kernel,
                "module": r["_cfg"].spec.module,
                "params": r["_cfg"].plain_params,
            }
            for r in todo
        ]

        def progress(i: int) -> None:
            if console is not None and len(todo) > 20 and i % 50 == 0:
                console.print(f"  loaded {i}/{len(todo)}", markup=False)

        answers, note = load_fresh(reqs, run=run, progress=progress, jobs=jobs, started=started)
        run = run and not note
        for r, req, a in zip(todo, reqs, answers):
            if not a.get("ok"):
                error = a.get("error", "load failed")
                if a.get("run") != "failed":  # it did not load: name the file it loaded
                    error += f" (loading {req['so'] or req['obj']})"
                r["problems"].append(error)
            if "how" in a:
                r["loaded"] = a["how"]
            if "run" in a:
                r["run"] = a["run"]
            if "seconds" in a:
                r["seconds"] = a["seconds"]
    ran, not_run = run_counts(rows)
    if run and not ran and not_run:
        note = no_run_note(not_run)
    bad = [r for r in rows if r["problems"]]
    for r in rows:
        r.pop("_cfg")
        r.pop("_info")
    ok = not bad and not note
    return {
        "ok": ok,
        "total": len(rows),
        "problems": len(bad),
        "loaded": load,
        "ran": run and ran > 0,
        "reference_runs": ran,
        "not_run": sum(len(ks) for ks in not_run.values()),
        "not_run_why": {why: len(ks) for why, ks in sorted(not_run.items())},
        "note": note,
        "seconds": round(time.time() - t0, 3),
        "entries": rows,
    }


def run_counts(rows: list[dict]) -> tuple[int, dict[str, list[str]]]:
    """--run's tally over report rows: how many ran their reference hook (passed or
    failed), and the kernels of those loaded but not run, by why ("no reference hook"):
    a --run that ran nothing is no success, and one that ran some says how many not."""
    ran = sum(1 for r in rows if r.get("run") in ("ok", "failed"))
    not_run: dict[str, list[str]] = {}
    for r in rows:
        if r.get("run") not in (None, "ok", "failed"):
            not_run.setdefault(r["run"], []).append(r["kernel"])
    return ran, not_run


def no_run_note(not_run: dict[str, list[str]]) -> str:
    """The line of a --run that ran no kernel: why, and for which kernels."""
    why = "; ".join(f"{w}: {', '.join(sorted(set(ks)))}" for w, ks in sorted(not_run.items()))
    return (
        f"--run ran no kernel ({why}); a kernel's reference= hook in its @jit_cache is what "
        f"--run calls (docs/writing-kernels.md)"
    )
