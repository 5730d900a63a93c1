"""Planning a build: which configurations are cached already (``plan``), and the order
the rest compile in: longest first, from each key's last compile time (``PastTimes``:
the cache's metadata, else the usage journal) and the kernel's mean for unknown keys."""

from __future__ import annotations

import os
from pathlib import Path

from quack.cache import fsutil, journal
from quack.cache.contract import CORRUPT
from quack.cache.store import LAYOUT, DiskStore
from quack.compile import builder
from quack.safejson import safe_loads
from quack_build.build.results import CACHED, Task
from quack_build.manifest.config import BuildConfig


def plan(
    configs: list[BuildConfig], store: DiskStore, *, force: bool = False, dry_run: bool = False
) -> list[Task]:
    """A Task per config; cached ones (a valid entry for the current fingerprint) marked so.
    A corrupt entry is quarantined by the lookup and counts as missing; ``dry_run``: it is
    only inspected (``plan_one``), and the cache is left as it is."""
    return [plan_one(c, store, force=force, dry_run=dry_run) for c in configs]


def plan_one(c: BuildConfig, store: DiskStore, *, force: bool = False, dry_run: bool = False) -> Task:
    """``plan`` for one configuration. ``dry_run``: read-only (``store.inspect``: no
    quarantine, no lock, no directory created); a corrupt entry is a Task to compile whose
    ``corrupt`` says why, what a real build would move to quarantine/ and rebuild."""
    t = Task(c)
    if force:
        return t
    ref = builder.entry_ref(c.spec, c.params, c.arch)
    if dry_run:
        found = store.inspect(ref)
        if found.ok:
            t.status = CACHED
        elif found.status == CORRUPT:
            t.corrupt = f"{found.problem}: {found.problem_file}"
    elif store.lookup(ref) is not None:
        t.status = CACHED
    return t


class PastTimes:
    """key -> seconds its last compile took, looked up one key at a time (a streaming
    dry run asks as it goes): any fingerprint's metadata first (an edit changes the
    directory, not the key; the largest wins), else the usage journal. The directory
    listings and the journal are read once, when first needed."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._fp_dirs: dict[str, list[str]] = {}
        self._journal: dict[str, float] | None = None
        self._stamps: list[str] | None = None

    def _kernel_dirs(self, kernel: str) -> list[str]:
        if self._stamps is None:
            try:
                base = self.root / LAYOUT
                self._stamps = [e.path for e in os.scandir(base) if e.is_dir(follow_symlinks=False)]
            except OSError:
                self._stamps = []
        if kernel not in self._fp_dirs:
            out = []
            for st in self._stamps:
                try:
                    kd = os.path.join(st, kernel)
                    out += [e.path for e in os.scandir(kd) if e.is_dir(follow_symlinks=False)]
                except OSError:
                    continue
            self._fp_dirs[kernel] = out
        return self._fp_dirs[kernel]

    def get(self, kernel: str, key: str) -> float | None:
        best = None
        for fp in self._kernel_dirs(kernel):
            try:
                # No-follow, non-blocking, regular files only: a FIFO planted as an old
                # fingerprint's metadata hung `quack build` here before any compile.
                v = safe_loads(fsutil.read_nofollow(Path(fp, key + ".json"))).get("compile_s")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(v, (int, float)) and v > 0:
                best = max(best or 0.0, float(v))
        if best is not None:
            return best
        if self._journal is None:
            self._journal = {}
            for r in journal.read(self.root):
                rk = r.get("key")
                v = r.get("compile_s")
                if isinstance(rk, str) and r.get("compiles") and isinstance(v, (int, float)) and v > 0:
                    self._journal.setdefault(rk, float(v))
        return self._journal.get(key)


def past_compile_times(root: Path, todo: list[Task]) -> dict[str, float]:
    """key -> seconds its last compile took, for the keys of ``todo`` (see PastTimes)."""
    pt = PastTimes(root)
    out = {}
    for t in todo:
        v = pt.get(t.cfg.kernel, t.cfg.key)
        if v is not None:
            out[t.cfg.key] = v
    return out


def order_longest_first(todo: list[Task], known: dict[str, float]) -> list[Task]:
    """Known compile times first, longest first; unknown keys get their kernel's mean
    (else the overall mean), so one slow kernel family starts early."""
    per_kernel: dict[str, list[float]] = {}
    for t in todo:
        if t.cfg.key in known:
            per_kernel.setdefault(t.cfg.kernel, []).append(known[t.cfg.key])
    allv = [v for vs in per_kernel.values() for v in vs]
    overall = sum(allv) / len(allv) if allv else None
    for t in todo:
        if t.cfg.key in known:
            t.est_s = known[t.cfg.key]
        elif t.cfg.kernel in per_kernel:
            vs = per_kernel[t.cfg.kernel]
            t.est_s = sum(vs) / len(vs)
        else:
            t.est_s = overall
    idx = {id(t): i for i, t in enumerate(todo)}
    return sorted(todo, key=lambda t: (-(t.est_s or 0.0), t.cfg.key not in known, idx[id(t)]))
