"""Walk the on-disk cache (docs/cache-layout.md) for ``quack cache stats|clean``
and ``quack verify``: entries, bytes, current vs stale fingerprints, debris.

No cutlass, no torch: a directory walk with one lstat per file (10,000
entries in well under 0.3 s). Current-ness is decided by the caller's
``current_srcfp`` map (kernel -> source fingerprint, from the registry) and
the toolchain stamp of this interpreter."""

from __future__ import annotations

import dataclasses
import os
import re
import time
from pathlib import Path
from typing import Callable, Iterator

from quack.cache import keys, orphans
from quack.cache.store import LAYOUT, SCRATCH

_TMP_RE = re.compile(r"^(?P<base>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]+$")
_SUFFIXES = (".so.json", ".json", ".o", ".so", ".lock")  # longest first
# What counts as debris (temps of dead writers, objects without metadata) is
# decided by the one rule in quack.cache.orphans.


@dataclasses.dataclass
class KeyFiles:
    """The files of one key in one fingerprint directory."""

    key: str
    sizes: dict = dataclasses.field(default_factory=dict)  # suffix -> bytes
    mtimes: dict = dataclasses.field(default_factory=dict)  # suffix -> mtime

    @property
    def complete(self) -> bool:
        return ".o" in self.sizes and ".json" in self.sizes

    @property
    def bundle_so(self) -> bool:
        """A .so linked from an installed bundle's object (the object stays in the bundle)."""
        return ".so" in self.sizes and ".o" not in self.sizes and ".json" not in self.sizes

    @property
    def bytes(self) -> int:
        return sum(v for k, v in self.sizes.items() if k != ".lock")

    @property
    def last_use(self) -> float:
        return self.mtimes.get(".json") or max(
            (v for k, v in self.mtimes.items() if k != ".lock"), default=0.0
        )


@dataclasses.dataclass
class FpDir:
    """One <stamp>/<kernel>/<srcfp> directory."""

    path: Path
    stamp: str
    kernel: str
    srcfp: str
    status: str  # "current" | "stale" | "unknown" (kernel not registered here)
    why: str
    keys: dict = dataclasses.field(default_factory=dict)  # key -> KeyFiles
    tmps: list = dataclasses.field(default_factory=list)  # (path, pid, size, mtime)
    other: list = dataclasses.field(default_factory=list)  # (path, size) unrecognized files

    @property
    def entries(self) -> int:
        return sum(1 for k in self.keys.values() if k.complete)

    @property
    def bytes(self) -> int:
        return sum(k.bytes for k in self.keys.values()) + sum(t[2] for t in self.tmps)

    @property
    def arch(self) -> str:
        return self.stamp.rsplit("-", 1)[-1]


def stamp_is_current(stamp: str) -> bool:
    arch = stamp.rsplit("-", 1)[-1]
    return keys.safe_component(keys.toolchain_stamp(arch)) == stamp


def walk(root: Path, current_srcfp: dict[str, str] | None = None) -> Iterator[FpDir]:
    """Every fingerprint directory under ``root``, with its files classified."""
    base = Path(root) / LAYOUT
    current_srcfp = current_srcfp or {}
    cur_stamp: dict[str, bool] = {}
    for st in _subdirs(base):
        if st.name not in cur_stamp:
            cur_stamp[st.name] = stamp_is_current(st.name)
        for kd in _subdirs(Path(st.path)):
            for fd in _subdirs(Path(kd.path)):
                if not cur_stamp[st.name]:
                    status, why = "stale", "toolchain changed"
                elif kd.name not in current_srcfp:
                    status, why = "unknown", "kernel not registered in this project"
                elif current_srcfp[kd.name] != fd.name:
                    status, why = "stale", "kernel source changed"
                else:
                    status, why = "current", ""
                yield _scan(FpDir(Path(fd.path), st.name, kd.name, fd.name, status, why))


def _subdirs(path: Path):
    try:
        with os.scandir(path) as it:
            return sorted((e for e in it if e.is_dir(follow_symlinks=False)), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _scan(d: FpDir) -> FpDir:
    """Classify one directory's files (the hot loop of ``quack cache stats``: one
    lstat per file except lock files, which are empty)."""
    try:
        it = os.scandir(d.path)
    except OSError:
        return d
    keys_ = d.keys
    with it:
        for e in it:
            name = e.name
            if e.is_symlink():
                continue  # planted: reported by planted(), removed by clean, never counted
            if ".tmp-" in name:
                m = _TMP_RE.match(name)
                if m:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    d.tmps.append((Path(e.path), int(m.group("pid")), st.st_size, st.st_mtime))
                    continue
            if name.endswith(".json"):
                suf = ".so.json" if name.endswith(".so.json") else ".json"
            elif name.endswith(".o"):
                suf = ".o"
            elif name.endswith(".so"):
                suf = ".so"
            elif name.endswith(".lock"):
                suf = ".lock"
            else:
                suf = ""
            k = name[: -len(suf)] if suf else ""
            if not k:
                try:
                    d.other.append((Path(e.path), e.stat(follow_symlinks=False).st_size))
                except OSError:
                    pass
                continue
            kf = keys_.get(k)
            if kf is None:
                kf = keys_[k] = KeyFiles(k, {}, {})
            if suf == ".lock":
                kf.sizes[suf] = 0
                kf.mtimes[suf] = 0.0
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            kf.sizes[suf] = st.st_size
            kf.mtimes[suf] = st.st_mtime
    return d


def planted(root: Path) -> list[tuple[Path, str]]:
    """Things someone planted in the cache's layout, never followed: symbolic links
    anywhere in ``v1/`` (in place of a stamp, kernel or fingerprint directory, or of
    an entry or lock file) and non-directories where the layout has directories; and
    ``v1/``, ``quarantine/``, ``logs/``, ``tmp/`` themselves as links. Each is
    (path, what it is). The store refuses to use them; ``quack cache clean`` removes
    them (the link itself, with unlink: its target is never touched)."""
    out: list[tuple[Path, str]] = []
    root = Path(root)
    for name in (LAYOUT, "quarantine", "logs", "tmp"):
        if os.path.islink(root / name):
            out.append((root / name, "symbolic link"))

    def scan(d: str, depth: int) -> None:  # depth 0: stamps, 1: kernels, 2: fingerprints, 3: files
        try:
            it = os.scandir(d)
        except OSError:
            return
        with it:
            for e in sorted(it, key=lambda e: e.name):
                if e.is_symlink():
                    out.append((Path(e.path), "symbolic link"))
                elif depth < 3:
                    if e.is_dir(follow_symlinks=False):
                        scan(e.path, depth + 1)
                    else:
                        out.append((Path(e.path), "not a directory"))

    if not os.path.islink(root / LAYOUT):
        scan(str(root / LAYOUT), 0)
    return out


SCRATCH_MAX_AGE = 600.0  # a link takes about a second: a scratch file this old is a killed link's


def scratch_files(root: Path) -> list[tuple[Path, int, float]]:
    """Regular files in ``<root>/tmp`` (the linker's temp files), not following links."""
    out: list[tuple[Path, int, float]] = []
    d = Path(root) / SCRATCH
    if os.path.islink(d):
        return out
    try:
        with os.scandir(d) as it:
            for e in it:
                if e.is_file(follow_symlinks=False):
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    out.append((Path(e.path), st.st_size, st.st_mtime))
    except OSError:
        pass
    return out


def quarantine_files(root: Path) -> list[tuple[Path, int, float]]:
    out = []
    try:
        with os.scandir(Path(root) / "quarantine") as it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                out.append((Path(e.path), st.st_size, st.st_mtime))
    except OSError:
        pass
    return out


# --- stats ---------------------------------------------------------------------


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
    debris = {"tmp_files": 0, "tmp_bytes": 0, "orphan_objects": 0, "orphan_bytes": 0}
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


# --- clean ---------------------------------------------------------------------


@dataclasses.dataclass
class Removal:
    path: Path
    bytes: int
    why: str


@dataclasses.dataclass
class CleanReport:
    removed: list = dataclasses.field(default_factory=list)  # Removal
    busy: list = dataclasses.field(default_factory=list)  # (path, why) skipped: in use
    errors: list = dataclasses.field(default_factory=list)  # (path, error)

    @property
    def freed(self) -> int:
        return sum(r.bytes for r in self.removed)


class Cleaner:
    """Removes cache files safely while other processes use the cache.

    - An entry is removed only under its per-key lock, taken without waiting:
      a key being compiled or published is skipped ("busy"). Readers are safe
      anyway (an unlinked file stays readable through open descriptors).
    - Lock files are unlinked only in stale directories (a current
      fingerprint's lock may be waited on by a process about to compile).
    - Debris (temps of dead writers, objects without metadata) goes by the one
      rule of quack.cache.orphans."""

    def __init__(self, root: Path, *, dry_run: bool = False, log: Callable[[Removal], None] | None = None):
        self.root = Path(root)
        self.dry_run = dry_run
        self.report = CleanReport()
        self.log = log

    def _unlink(self, path: Path, size: int, why: str) -> None:
        if not self.dry_run:
            try:
                os.unlink(path)
            except FileNotFoundError:
                return
            except OSError as e:
                self.report.errors.append((path, str(e)))
                return
        r = Removal(path, size, why)
        self.report.removed.append(r)
        if self.log:
            self.log(r)

    def remove_key(self, d: FpDir, kf: KeyFiles, why: str, *, drop_lock: bool) -> bool:
        lock_path = d.path / f"{kf.key}.lock"
        lk = None
        if not self.dry_run:
            lk = orphans.try_lock(lock_path)
            if lk is None:
                self.report.busy.append((d.path / f"{kf.key}.o", "locked by another process"))
                return False
        try:
            # Metadata first: a reader never pairs stale metadata with a missing object.
            for suf in (".json", ".so.json", ".so", ".o"):
                if suf in kf.sizes:
                    self._unlink(d.path / f"{kf.key}{suf}", kf.sizes[suf], why)
            if drop_lock and (lk is not None or ".lock" in kf.sizes):
                self._unlink(lock_path, 0, why)
        finally:
            if lk is not None:
                lk.release()
        return True

    def remove_dir(self, d: FpDir, why: str) -> None:
        """A whole stale fingerprint directory: entries under their locks, then the rest."""
        now = time.time()
        all_done = True
        for kf in d.keys.values():
            all_done &= self.remove_key(d, kf, why, drop_lock=True)
        for path, pid, size, mtime in d.tmps:
            if orphans.tmp_is_orphan(pid, mtime, now):
                self._unlink(path, size, "orphaned temp file")
            else:
                all_done = False
                self.report.busy.append((path, f"temp file of live process {pid}"))
        if all_done and not self.dry_run:
            _rmdirs(d.path, self.root)

    def debris(self, d: FpDir, *, drop_locks: bool) -> None:
        """Temp files of dead writers, interrupted publishes (quack.cache.orphans),
        and with ``drop_locks`` lock files of keys that have no other file."""
        orphans.sweep_dir(d.path, remove=self._unlink)  # _unlink itself honours dry_run
        if not drop_locks:
            return
        for kf in list(d.keys.values()):
            if not [s for s in kf.sizes if s != ".lock"]:  # (a bundle's derived .so has data: kept)
                self._unlink(d.path / f"{kf.key}.lock", 0, "orphaned lock file")

    def quarantine(self) -> None:
        for path, size, _ in quarantine_files(self.root):
            self._unlink(path, size, "quarantined (corrupt) entry")
        if not self.dry_run:
            try:
                os.rmdir(self.root / "quarantine")
            except OSError:
                pass


def _rmdirs(path: Path, root: Path) -> None:
    """rmdir ``path`` and then its empty parents, up to the layout directory."""
    stop = (Path(root) / LAYOUT).resolve()
    p = Path(path)
    while p.resolve() != stop and stop in p.resolve().parents:
        try:
            os.rmdir(p)
        except OSError:
            return
        p = p.parent


def parse_size(text: str) -> int:
    """'5G', '500M', '1.5GiB', '1024' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*", text.lower())
    if not m:
        raise ValueError(f"{text!r} is not a size; use e.g. 500M, 5G, 1.5T or a byte count")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2)]
    return int(float(m.group(1)) * mult)


def parse_age(text: str) -> float:
    """'30d', '12h', '45m', '90s', '2w' -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text.lower())
    if not m:
        raise ValueError(f"{text!r} is not an age; use e.g. 30d, 12h, 45m, 2w")
    mult = {"": 86400, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}[m.group(2)]
    return float(m.group(1)) * mult


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def disk_usage(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


LOG_MAX_AGE = 7 * 86400.0


def clean(
    root: Path,
    current_srcfp: dict[str, str] | None = None,
    *,
    remove_all: bool = False,
    max_size: int | None = None,
    older_than: float | None = None,
    dry_run: bool = False,
    log: Callable[[Removal], None] | None = None,
) -> CleanReport:
    """``quack cache clean``: stale fingerprints, quarantine and debris by default;
    ``remove_all`` every entry; ``older_than`` entries unused for that many seconds;
    ``max_size`` least recently used entries until the cache fits."""
    c = Cleaner(root, dry_run=dry_run, log=log)
    now = time.time()
    # Planted links and files first (what the store refuses and its messages tell the
    # user to clean): unlinked, never followed; a planted directory is left (and reported).
    for path, what in planted(root):
        try:
            size = 0 if what == "symbolic link" else os.lstat(path).st_size
        except OSError:
            continue
        if what == "symbolic link" or not os.path.isdir(path):
            c._unlink(path, size, f"planted {what} (never followed)")
    kept: list[tuple[FpDir, KeyFiles]] = []
    for d in walk(root, current_srcfp):
        if d.status == "stale":
            c.remove_dir(d, f"stale fingerprint ({d.why})")
            continue
        c.debris(d, drop_locks=False)
        for kf in d.keys.values():
            if kf.bundle_so and (remove_all or older_than is not None and now - kf.last_use > older_than):
                c.remove_key(d, kf, "derived .so of a bundle entry (relinked on next use)", drop_lock=False)
            if not kf.complete:
                continue
            if remove_all:
                c.remove_key(d, kf, "--all", drop_lock=False)
            elif older_than is not None and now - kf.last_use > older_than:
                c.remove_key(d, kf, f"unused for {(now - kf.last_use) / 86400:.1f} days", drop_lock=False)
            else:
                kept.append((d, kf))
    c.quarantine()
    for path, size, mtime in scratch_files(root):
        if now - mtime > SCRATCH_MAX_AGE:
            c._unlink(path, size, "temp file of a killed link")
    logs = Path(root) / "logs"
    if logs.is_dir():
        for e in os.scandir(logs):
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if remove_all or now - st.st_mtime > LOG_MAX_AGE:
                c._unlink(Path(e.path), st.st_size, "old build log")
    if max_size is not None:
        total = sum(kf.bytes for _, kf in kept)
        for d, kf in sorted(kept, key=lambda x: x[1].last_use):
            if total <= max_size:
                break
            if c.remove_key(d, kf, "--max-size (least recently used)", drop_lock=False):
                total -= kf.bytes
    return c.report
