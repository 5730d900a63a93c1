"""``quack prewarm``: rebuild, for the current fingerprint, the configurations the
usage journal shows were used recently (most used first), so the next run
after an edit starts warm; optionally write them out as a manifest."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

from quack import registry
from quack.cache import fsutil, journal
from quack.errors import OutputFileError, ParamError, UnknownKernel
from quack.settings import KNOWN_ARCHS
from quack_build.manifest.config import BuildConfig


def usage(records: list[dict]) -> list[dict]:
    """Aggregate journal records per (kernel, arch, params): uses, last seen, whether a
    call asked for the tuning table's configuration (``derived``) and a sized kernel's
    call sizes (``problems``, most used first, at most MAX_SIZES)."""
    from quack.runtime.loaded import MAX_SIZES

    agg: dict[tuple, dict] = {}
    for r in records:
        kernel, arch, params = r.get("kernel"), r.get("arch"), r.get("params")
        if not isinstance(kernel, str) or not isinstance(arch, str) or not isinstance(params, dict):
            continue
        if r.get("where") == "build":
            continue  # a `quack build` compile, not a use
        ident = (kernel, arch, repr(sorted(params.items())))
        a = agg.setdefault(
            ident,
            {
                "kernel": kernel,
                "arch": arch,
                "params": params,
                "uses": 0,
                "compiles": 0,
                "last": 0.0,
                "derived": False,
                "problems": [],
            },
        )
        for f in ("hits", "misses"):
            v = r.get(f, 0)
            a["uses"] += v if isinstance(v, int) else 0
        a["compiles"] += r.get("compiles", 0) if isinstance(r.get("compiles"), int) else 0
        t = r.get("t", 0.0)
        a["last"] = max(a["last"], t if isinstance(t, (int, float)) else 0.0)
        a["derived"] = a["derived"] or r.get("derived") is True
        for size in r.get("problems") or ():
            # a hand-edited or foreign journal: only lists of ints are sizes
            ok = isinstance(size, list) and size and all(type(v) is int and v >= 0 for v in size)
            if ok and size not in a["problems"] and len(a["problems"]) < MAX_SIZES:
                a["problems"].append(size)
    return sorted(agg.values(), key=lambda a: (-a["uses"], -a["last"]))


def _as_used(spec, u: dict, bound: dict) -> list[tuple[dict, tuple]]:
    """(params, sizes) to build for one journal aggregate: the configuration as used; or,
    where the calls asked for the tuning table's choice (``derived``), the table's choice
    of today (a re-tune since then changed the row: the next run asks for the new one),
    per recorded size for a sized kernel (the GEMM's m, n, k; ``sizes`` the
    (name, value) pairs). A sized kernel's record without sizes (a journal from before
    they were kept) builds the configuration as used."""
    names = list(spec.derived_params)
    if not (u.get("derived") and names):
        return [(bound, ())]
    if spec.problem:
        sizes = [tuple(zip(spec.problem, p)) for p in u.get("problems", ()) if len(p) == len(spec.problem)]
        if not sizes:
            return [(bound, ())]
    else:
        sizes = [()]
    return [(spec.bind_at(u["params"], bound, dict(sz), u["arch"], names), sz) for sz in sizes]


def configs_from_usage(used: list[dict]) -> tuple[list[BuildConfig], list[str]]:
    out: dict[str, tuple] = {}  # key -> (spec, params, arch, [sizes that chose it])
    skipped = []
    for u in used:
        if u["arch"] not in KNOWN_ARCHS:
            skipped.append(f"{u['kernel']}: unknown arch {u['arch']!r}")
            continue
        try:
            spec = registry.get(u["kernel"])
            bound = spec.bind((), u["params"])
            chosen = _as_used(spec, u, bound)
        except UnknownKernel:
            skipped.append(f"{u['kernel']}: no longer registered")
            continue
        except ParamError as e:
            skipped.append(f"{u['kernel']} {u['params']}: parameters no longer valid ({e})")
            continue
        for params, sz in chosen:
            sizes = out.setdefault(spec.key(params, u["arch"]), (spec, params, u["arch"], []))[3]
            if sz and sz not in sizes:  # the sizes whose table choice this is
                sizes.append(sz)
    configs = [
        BuildConfig(
            spec.name,
            params,
            arch,
            key,
            "journal",
            spec,
            tuple(sizes),
            tuple("x".join(str(v) for _, v in sz) for sz in sizes),
        )
        for key, (spec, params, arch, sizes) in out.items()
    ]
    return configs, skipped


def emit(path: Path, configs: list[BuildConfig]) -> None:
    """Write ``configs`` as a manifest at ``path`` (its missing directories created).
    Raises OutputFileError naming --emit-manifest when it can't be written: a directory
    there, a file on the way, no permission (these were IsADirectoryError and
    NotADirectoryError tracebacks)."""
    import tomli_w

    from quack.manifest_line import manifest_entries

    doc = manifest_entries((c.kernel, c.params, c.arch, [dict(p) for p in c.problems]) for c in configs)
    text = (
        "# Written by `quack prewarm --emit-manifest`: the configurations used recently,\n"
        "# most used first. Build with: quack build " + str(path) + "\n" + tomli_w.dumps(doc)
    )
    path = Path(path)
    try:
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        path.parent.mkdir(parents=True, exist_ok=True)
        fsutil.write_atomic(path.absolute(), text.encode(), fsync=False)
    except OSError as e:
        raise OutputFileError(str(path), _write_problem(path, e), option="--emit-manifest") from None


def emit_path_problem(path: Path) -> str:
    """'' or what is wrong with ``--emit-manifest PATH`` that shows before any work: a
    directory in its place, a file on its way (its missing directories are created).
    Found only when writing, these were exit 1 while the same mistake with ``--trace``
    was a usage error (2): the CLI checks this first."""
    path = Path(path)
    if os.path.isdir(path):
        return f"is a directory; give a file name (e.g. {path / 'prewarm.toml'})"
    for p in reversed(path.absolute().parents):  # the one nearest the root blocks
        if os.path.lexists(p) and not os.path.isdir(p):
            return f"{p} on its path is not a directory; give a path in a directory"
    return ""


def _write_problem(path: Path, e: OSError) -> str:
    """What is wrong with the output path ``path``, from the error writing it raised."""
    if isinstance(e, (IsADirectoryError, NotADirectoryError)) or e.errno == errno.EEXIST:
        # EEXIST: mkdir of a parent that is a file; the path changed since it was checked
        why = emit_path_problem(path)
        if why:
            return why
    return f"{e.strerror or e}; give a path you can write"


def prewarm(
    s,
    store,
    *,
    since_s: float | None,
    top: int | None,
    emit_manifest: Path | None,
    jobs: int,
    dry_run: bool,
    as_json: bool,
    console,
    emit_json,
) -> int:
    from quack_build.build import plan as planning
    from quack_build.build import progress as display
    from quack_build.build import results, scheduler

    t0 = time.time()
    records = journal.read(Path(s.cache_dir), since=(time.time() - since_s) if since_s else 0.0)
    used = usage(records)
    configs, skipped = configs_from_usage(used)
    if top:
        configs = configs[:top]
    for m in skipped:
        console.print(f"skipped: {m}", markup=False)
    if emit_manifest:
        if not configs:  # `kernel = []` is no manifest: nothing written, and say why
            console.print(
                f"prewarm: nothing to emit: the usage journal of {s.cache_dir} has no "
                f"configuration used"
                + (" in that period (--since)" if since_s else "")
                + f" ({len(records)} records); {emit_manifest} was not written",
                markup=False,
            )
            return 1
        emit(emit_manifest, configs)
        console.print(f"wrote {len(configs)} configurations to {emit_manifest}", markup=False)
    tasks = planning.plan(configs, store, dry_run=dry_run)  # a dry run leaves corrupt entries in place
    todo = [t for t in tasks if t.status != results.CACHED]
    if dry_run or not todo:
        if as_json:
            emit_json(
                {
                    "dry_run": dry_run,
                    "records": len(records),
                    "configurations": len(configs),
                    "cached": len(tasks) - len(todo),
                    "to_compile": len(todo),
                    "skipped": skipped,
                    "keys": [t.to_json() for t in tasks],
                }
            )
        else:
            for t in todo:
                bad = (
                    f"  (corrupt: {t.corrupt}; a build moves it to quarantine/ and rebuilds it)"
                    if t.corrupt
                    else ""
                )
                # the sizes whose tuned configuration this is (as quack build --dry-run says it)
                at = f"  for {', '.join(t.cfg.sizes)}" if t.cfg.sizes else ""
                console.print(f"rebuild  {t.cfg.label()}{at}{bad}", markup=False, soft_wrap=True)
            console.print(
                f"prewarm: {len(records)} journal records, {len(configs)} configurations used, "
                f"{len(tasks) - len(todo)} cached, {len(todo)} to rebuild"
                + (" (dry run)" if dry_run and todo else ""),
                markup=False,
            )
        return 0
    rep = display.make_reporter(console)
    remote = None
    if s.remote_url:  # what CI already built for the new fingerprint is pulled, not rebuilt
        from quack.remote import tier

        remote = tier.from_settings(s)
    try:
        res = scheduler.BuildSession(
            tasks,
            store,
            scheduler.BuildOptions(
                jobs=jobs,
                reporter=rep,
                keep_going=True,
                log_dir=Path(s.cache_dir) / "logs",
                plan_s=time.time() - t0,
                order="given",
                settings=s,
                remote=remote,
            ),
        ).run()
    finally:
        if remote is not None:
            remote.record(Path(s.cache_dir))
            remote.close()
    display.print_summary(console, res)
    if as_json:
        out = res.to_json()
        out["skipped"] = skipped
        emit_json(out)
    if res.interrupted:
        return 130
    return 0 if res.ok else 1
