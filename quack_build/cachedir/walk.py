"""Walk the on-disk cache (docs/cache-layout.md) for ``quack cache stats|clean``
and ``quack verify``: entries, bytes, current vs stale fingerprints, debris.

No cutlass, no torch: a directory walk with one lstat per file (10,000
entries in well under 0.3 s). Current-ness is decided by the caller's
``current_srcfp`` map (kernel -> source fingerprint, from the registry) and
the toolchain stamp of this interpreter.

Summarizing it for ``quack cache stats`` is quack_build.cachedir.stats, removing from it
quack_build.cachedir.clean, parsing and printing sizes and ages quack_build.cachedir.units."""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from pathlib import Path
from typing import Iterator

from quack.cache import fsutil, keys
from quack.cache.journal import JOURNAL
from quack.cache.store import LAYOUT, SCRATCH
from quack.remote.stats import STATS_FILE

__all__ = [
    "DIRECTORY",
    "LOG_NAME",
    "SCRATCH_MAX_AGE",
    "FpDir",
    "KeyFiles",
    "disk_usage",
    "is_layout_name",
    "planted",
    "quarantine_files",
    "scratch_files",
    "stamp_is_current",
    "walk",
]

_TMP_RE = re.compile(r"^(?P<base>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]+$")
# The names quack's layout gives its directories (quack.cache.keys.toolchain_stamp, the
# registry's kernel names, 16-hex source fingerprints). The cache root may be shared with
# another tool that reads the same QUACK_CACHE_DIR (the reference QuACK library does):
# a directory or file under v1/ whose name does not fit is foreign, and stats, clean and
# verify neither count, remove nor report it (issue 27). Without this, a foreign folder
# in v1/ was taken for a stale toolchain stamp and deleted by `quack cache clean`.
_LAYOUT_NAMES = (
    re.compile(
        r"^py[0-9]+\.[0-9]+-cutlass[A-Za-z0-9._+]+-[A-Za-z0-9._+-]+-tvmffi[A-Za-z0-9._+]+-sm_[0-9]+[a-z]?$"
    ),
    re.compile(r"^[a-z][a-z0-9_]{0,63}$"),  # quack.registry.NAME_RE
    re.compile(r"^[0-9a-f]{16}$"),
)


_SCRATCH_NAME = re.compile(r"^cc[A-Za-z0-9]{6}\.[A-Za-z0-9]+$")
LOG_NAME = re.compile(r"^build-[0-9]{8}-[0-9]{6}-[0-9]+\.log$")  # the scheduler's failure logs


def is_layout_name(name: str, depth: int) -> bool:
    """Could quack have made ``name`` at ``depth`` under v1/ (0 stamp, 1 kernel, 2 fingerprint)?"""
    return bool(_LAYOUT_NAMES[depth].fullmatch(name))


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
    for st in _subdirs(base, 0, root):
        if st.name not in cur_stamp:
            cur_stamp[st.name] = stamp_is_current(st.name)
        for kd in _subdirs(Path(st.path), 1, root):
            for fd in _subdirs(Path(kd.path), 2, root):
                if not cur_stamp[st.name]:
                    status, why = "stale", "toolchain changed"
                elif kd.name not in current_srcfp:
                    status, why = "unknown", "kernel not registered in this project"
                elif current_srcfp[kd.name] != fd.name:
                    status, why = "stale", "kernel source changed"
                else:
                    status, why = "current", ""
                yield _scan(FpDir(Path(fd.path), st.name, kd.name, fd.name, status, why), root)


def _scandir(path, root: Path):
    """``os.scandir(path)``, or None when ``path`` is gone or not a directory (removed
    meanwhile; a planted file, which planted() names). A directory that can't be read
    (no permission) is a CacheError naming it (quack.cache.fsutil.reach_error): skipping
    it made stats report a smaller cache and clean leave it, silently; raising its
    PermissionError gave the CLI a traceback."""
    try:
        return os.scandir(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise fsutil.reach_error(Path(root), e) from None


def _subdirs(path: Path, depth: int, root: Path):
    """The layout's directories in ``path`` (foreign names skipped: ``is_layout_name``)."""
    it = _scandir(path, root)
    if it is None:
        return []
    with it:
        return sorted(
            (e for e in it if e.is_dir(follow_symlinks=False) and is_layout_name(e.name, depth)),
            key=lambda e: e.name,
        )


def _scan(d: FpDir, root: Path) -> FpDir:
    """Classify one directory's files (the hot loop of ``quack cache stats``: one
    lstat per file except lock files, which are empty)."""
    it = _scandir(d.path, root)
    if it is None:
        return d
    keys_ = d.keys
    with it:
        for e in it:
            name = e.name
            # Only regular files are ours (d_type: no extra stat). A symbolic link, FIFO,
            # socket or device at an entry's name is planted: reported by planted(),
            # removed by clean, never counted (a FIFO at <key>.json made the key look
            # complete), never opened (opening a FIFO blocks).
            if not e.is_file(follow_symlinks=False):
                continue
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


#: planted()'s word for a directory where the layout has a file (clean removes it whole)
DIRECTORY = "directory where a file belongs"


def _is_entry_file_name(name: str) -> bool:
    """``<key>.o``, ``.json``, ``.so``, ``.so.json``, ``.lock`` or a temp of one."""
    m = _TMP_RE.match(name)
    base = m.group("base") if m else name
    return any(base.endswith(suf) and len(base) > len(suf) for suf in _SUFFIXES)


def _odd_kind(mode: int) -> str:
    """What a planted non-regular file is, for the report."""
    if stat.S_ISFIFO(mode):
        return "named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device node"
    return "not a regular file"


def planted(root: Path) -> list[tuple[Path, str]]:
    """Things someone planted in the cache's layout, never followed nor opened: symbolic
    links anywhere in ``v1/`` (in place of a stamp, kernel or fingerprint directory, or
    of an entry or lock file), non-directories where the layout has directories, and
    directories, FIFOs, sockets and device nodes where it has files; ``v1/``, ``quarantine/``,
    ``logs/``, ``tmp/`` themselves as links or non-directories; the journal and the remote stats file as
    links or non-regular files. Each is (path, what it is). The store refuses to use
    them; ``quack cache clean`` removes them (with unlink: a link's target is never
    touched, a FIFO never opened, which would block; a directory with what it holds,
    following no link in it)."""
    out: list[tuple[Path, str]] = []
    root = Path(root)
    for name in (LAYOUT, "quarantine", "logs", SCRATCH):
        try:
            mode = os.lstat(root / name).st_mode
        except OSError:
            continue
        if stat.S_ISLNK(mode):
            out.append((root / name, "symbolic link"))
        elif not stat.S_ISDIR(mode):
            # A file at tmp/ made every link fail (the store refuses the scratch directory)
            # and every process load its kernels through the compiler's runtime: unreported,
            # and `clean` left it.
            out.append((root / name, "not a directory"))
    for name in (JOURNAL, STATS_FILE):
        try:
            mode = os.lstat(root / name).st_mode
        except OSError:
            continue
        if stat.S_ISLNK(mode):
            out.append((root / name, "symbolic link"))
        elif not stat.S_ISREG(mode):
            out.append((root / name, _odd_kind(mode)))

    def scan(d: str, depth: int) -> None:  # depth 0: stamps, 1: kernels, 2: fingerprints, 3: files
        it = _scandir(d, root)
        if it is None:
            return
        with it:
            for e in sorted(it, key=lambda e: e.name):
                if depth < 3 and not is_layout_name(e.name, depth):
                    continue  # foreign (another tool's): never ours to report or remove
                if e.is_symlink():
                    out.append((Path(e.path), "symbolic link"))
                elif depth < 3:
                    if e.is_dir(follow_symlinks=False):
                        scan(e.path, depth + 1)
                    else:
                        out.append((Path(e.path), "not a directory"))
                elif e.is_dir(follow_symlinks=False):
                    # A directory at one of an entry's file names: the store refuses it
                    # (and its quarantine removes it); unreported, `clean` never removed it.
                    # One under another name is not at a name of ours: left alone.
                    if _is_entry_file_name(e.name):
                        out.append((Path(e.path), DIRECTORY))
                elif not e.is_file(follow_symlinks=False):
                    try:
                        mode = e.stat(follow_symlinks=False).st_mode
                    except FileNotFoundError:
                        continue
                    out.append((Path(e.path), _odd_kind(mode)))

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
    it = _scandir(d, root)
    if it is None:
        return out
    with it:
        for e in it:
            # Only the linker's own names (gcc's mkstemp: cc + 6 characters + a suffix):
            # a shared root's tmp/ may hold another tool's files (issue 27).
            if e.is_file(follow_symlinks=False) and _SCRATCH_NAME.fullmatch(e.name):
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                out.append((Path(e.path), st.st_size, st.st_mtime))
    return out


def quarantine_files(root: Path) -> list[tuple[Path, int, float]]:
    out: list[tuple[Path, int, float]] = []
    d = Path(root) / "quarantine"
    if os.path.islink(d):
        return out  # planted (planted() names it, clean unlinks it): never listed through
    it = _scandir(d, root)
    if it is None:
        return out
    with it:
        for e in it:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            out.append((Path(e.path), st.st_size, st.st_mtime))
    return out


def disk_usage(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total
