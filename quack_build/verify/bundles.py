"""``quack verify --bundles``: check every installed bundle (refused or not; each entry's
checksums, arch, toolchain stamp and kernel source against this project's; a load in a
fresh process); quack_build.cli.verify_view prints the report."""

from __future__ import annotations

import contextlib
import time
from typing import Any


def _gpu_note(b) -> str:
    """Where a default call here would miss: for each entry of a tuned kernel (one whose
    configuration a tuning table derives) built for this toolchain, the configuration this
    machine's GPU model asks for with the same other parameters, by key, among the bundle's
    entries. A key missing names the kernel: its configurations were chosen for the
    bundle's models, not this one. Said, not counted as a problem: the entries are sound."""
    from quack import registry
    from quack import settings as qs
    from quack.cache import keys
    from quack.tuning import gpu_choice

    if b.index is None or b.index.tune_gpu is None:
        return ""
    here, why = gpu_choice()
    have = {e.key for e in b.index.entries}
    missing: set[str] = set()
    for e in b.index.entries:
        spec = registry.all_specs().get(e.kernel)
        if spec is None or e.stamp != keys.toolchain_stamp(e.arch) or e.kernel in missing:
            continue
        tuned = spec.derived_params
        if not tuned:
            continue  # its keys do not depend on the GPU model
        params = {k: v for k, v in e.params.items() if k not in tuned}
        try:
            with qs.override(tune_gpu=here) if here else contextlib.nullcontext():
                key = spec.key(spec.bind((), params, arch=e.arch), e.arch)
        except Exception:  # noqa: BLE001 - a parameter set this project no longer takes: said elsewhere
            continue
        if key not in have:
            missing.add(e.kernel)
    if not missing:
        return ""
    made, _ = b.index.tune_gpu
    mine = f"GPU {here}'s ({why})" if here else f"each table default GPU's ({why})"
    return (
        f"a default call of {', '.join(sorted(missing))} here asks for configurations chosen by "
        f"{mine} tuning rows, which the bundle (tuned for "
        f"{'GPU ' + ', '.join(made) if made else 'each table default GPU'}) does not hold: "
        f"rebuild it adding --gpu {here or 'MODEL'}"
    )


def verify_bundles(s, *, load: bool = True, run: bool = False, jobs: int = 1) -> dict:
    """Every installed bundle: refused or not, each entry's checksums, arch (from the
    embedded cubin), toolchain stamp (which names the arch) and kernel source against
    this process's, and a load in a fresh process. A bundle none of whose entries this
    toolchain and target arch can use is a problem; entries for other toolchains or
    archs in a bundle that has some for this one are listed, not counted as problems."""
    from quack import registry
    from quack.bundles import files as bfiles
    from quack.bundles import tier as bt
    from quack.cache import keys
    from quack_build.verify.cubin import arch_matches, gpu_codes
    from quack_build.verify.loaders import load_fresh
    from quack_build.verify.manifest import no_run_note, run_counts

    t0 = time.time()
    bundles = bt.discover(s)
    srcfps = {}
    for kname, spec in registry.all_specs().items():
        try:
            srcfps[kname] = spec.source_fingerprint()
        except Exception:  # noqa: BLE001
            pass
    out, rows, loads = [], [], []
    for b in bundles:
        info: dict[str, Any] = {
            "name": b.name,
            "version": b.version,
            "dist": b.dist,
            "path": str(b.path),
            "signer": b.signer,
            "problems": [b.problem] if b.problem else [],
            "entries": 0,
            "current": 0,
            "other_toolchain": 0,
            "tune_gpu": (
                {"models": list(b.index.tune_gpu[0]), "source": b.index.tune_gpu[1]}
                if b.index is not None and b.index.tune_gpu is not None
                else None
            ),
            "gpu_note": _gpu_note(b),
        }
        out.append(info)
        if b.index is None or b.problem or b.path is None:
            continue
        for e in b.index.entries:
            info["entries"] += 1
            r: dict[str, Any] = {
                "bundle": b.name,
                "kernel": e.kernel,
                "params": e.params,
                "arch": e.arch,
                "key": e.key,
                "stamp": e.stamp,
                "problems": [],
                "note": "",
            }
            if keys.toolchain_stamp(s.arch) != e.stamp:
                info["other_toolchain"] += 1
                r["note"] = (
                    f"not used: built for {e.stamp}, this toolchain and arch are "
                    f"{keys.toolchain_stamp(s.arch)}"
                )
                rows.append(r)
                continue
            info["current"] += 1
            problem, so = bt.check_files(b, e)
            if problem:
                r["problems"].append(problem)
            else:
                codes = gpu_codes(bfiles.read_under(b.path, e.rel_obj, e.size))
                if not arch_matches(e.arch, codes):
                    r["problems"].append(
                        f"built for {', '.join(c.arch for c in codes) or 'no GPU code'}, "
                        f"the index says {e.arch}"
                    )
            if e.kernel in srcfps and srcfps[e.kernel] != e.srcfp:
                r["problems"].append(
                    f"kernel source differs from this project's ({e.srcfp} vs {srcfps[e.kernel]}): not used"
                )
            elif e.kernel not in srcfps:
                r["note"] = "kernel not registered in this project"
            if not r["problems"] and (load or run):
                kspec = registry.all_specs().get(e.kernel)
                loads.append(
                    (
                        r,
                        {
                            "key": e.key,
                            "obj": str(b.path / e.rel_obj),
                            "so": str(so) if so else None,
                            "kernel": e.kernel,
                            "module": kspec.module if kspec else "",
                            "params": e.params,
                            "run": run and kspec is not None,
                        },
                    )
                )
            rows.append(r)
        if info["current"] == 0 and info["entries"]:
            info["problems"].append(
                "none of its entries is for this toolchain and arch "
                f"({', '.join(b.index.stamps)}; this one: {keys.toolchain_stamp(s.arch)})"
            )
    note = ""
    if loads:
        answers, note = load_fresh([req for _, req in loads], run=run, jobs=jobs)
        for (r, _), a in zip(loads, answers):
            if not a.get("ok"):
                r["problems"].append(a.get("error", "load failed"))
            r["loaded"] = a.get("how", "")
            if "run" in a:
                r["run"] = a["run"]
            elif run and not note and a.get("ok"):  # --run, but this kernel is not registered here
                r["run"] = "kernel not registered in this project"
    ran, not_run = run_counts(rows)
    if run and loads and not note and not ran and not_run:
        note = no_run_note(not_run)
    bad = sum(1 for r in rows if r["problems"]) + sum(1 for b in out if b["problems"])
    if not bundles:
        # A deployment check that finds nothing to check must not pass quietly.
        note = "no quack bundles are installed (entry point group quack.bundles); pip install one"
    return {
        "ok": bad == 0 and not note,
        "bundles": out,
        "entries": rows,
        "problems": bad,
        "note": note,
        "loaded": load,
        "reference_runs": ran,
        "not_run": sum(len(ks) for ks in not_run.values()),
        "not_run_why": {why: len(ks) for why, ks in sorted(not_run.items())},
        "seconds": round(time.time() - t0, 3),
    }
