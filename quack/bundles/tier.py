"""Installed bundles as a read-only cache tier (after the local cache, before compiling).

Discovery reads the ``quack.bundles`` entry points once per process, at the first
lookup that reaches this tier (a process that never misses its local cache, or never
asks for a kernel, pays nothing). A bundle's package is never imported: its
directory comes from the distribution that declared the entry point.

A bundle is refused as a whole (one warning) when its index is unreadable or
malformed, or when trusted keys are configured and its index is unsigned or not
signed by one of them. An entry is used only if its toolchain stamp, arch, kernel
and source fingerprint are this process's, and its files' sizes and SHA-256 match
the index (a mismatch: one warning, never loaded; the next bundle holding the key is
tried)."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from pathlib import Path

from quack.bundles import index as _index
from quack.bundles.index import Index, IndexEntry
from quack.cache import fsutil, keys
from quack.cache.entry import Entry, EntryRef
from quack.cache.problems import warn_once
from quack.errors import BundleError, KeyFileError

log = logging.getLogger("quack")


@dataclasses.dataclass
class Bundle:
    """One installed bundle, as discovery found it."""

    name: str  # the entry point's name (= the bundle name)
    dist: str  # distribution name (quack bundle makes it the bundle name)
    version: str
    path: Path | None  # the package directory
    index: Index | None = None
    problem: str = ""  # why the bundle is refused ("" = usable)
    signer: str = ""  # the trusted key that signed its index, if any
    by_key: dict = dataclasses.field(default_factory=dict)  # key -> [IndexEntry]

    @property
    def usable(self) -> bool:
        return not self.problem and self.index is not None

    def current_entries(self, arch: str) -> int:
        """Entries this process can use: built for ``arch`` with this interpreter's
        toolchain (the stamp names both)."""
        if self.index is None:
            return 0
        stamp = keys.toolchain_stamp(arch)
        return sum(1 for e in self.index.entries if e.stamp == stamp)

    def describe(self, arch: str) -> str:
        if self.problem:
            return f"{self.name} {self.version} (refused: {self.problem})"
        n = len(self.index.entries) if self.index else 0
        cur = self.current_entries(arch)
        return f"{self.name} {self.version} ({cur} of {n} entries for this toolchain and {arch})"


def open_bundle(
    name: str, dist: str, version: str, path: Path | None, trusted, *, trust_problem: str = ""
) -> Bundle:
    """Read and check one bundle's index (no import of its package)."""
    b = Bundle(name, dist, version, path)
    if trust_problem:
        b.problem = trust_problem
        return b
    if path is None or not path.is_dir():
        b.problem = f"package directory {path} not found (broken install?)"
        return b
    try:
        data = fsutil.read_nofollow(path / _index.INDEX_NAME)
        b.index = _index.parse(data)
    except OSError as e:
        b.problem = f"cannot read {path / _index.INDEX_NAME} ({e.strerror or e})"
        return b
    except BundleError as e:
        b.problem = f"{path / _index.INDEX_NAME} is malformed: {e}"
        return b
    b.version = b.index.version
    if b.index.name != name:
        b.problem = f"its index names bundle {b.index.name!r}, its entry point {name!r}"
        return b
    if trusted is not None:
        from quack.bundles import trust

        try:
            b.signer = trust.verify_index(data, path / _index.SIG_NAME, trusted, bundle=name)
        except BundleError as e:
            b.problem = str(e)
            return b
    for ent in b.index.entries:
        b.by_key.setdefault(ent.key, []).append(ent)
    return b


def discover(settings) -> list[Bundle]:
    """Every installed bundle, sorted by name then version (a stable search order)."""
    from importlib.metadata import entry_points

    from quack.bundles import trust

    trusted, trust_problem = None, ""
    try:
        trusted = trust.trusted_keys(settings)
    except (KeyFileError, OSError) as e:
        # Keys are configured but unusable: accepting unsigned bundles would be silent
        # downgrade, so every bundle is refused (and the warning says why).
        trust_problem = f"the trusted keys can't be loaded ({e})"
    out: list[Bundle] = []
    seen = set()
    for ep in entry_points(group=_index.ENTRY_POINT_GROUP):
        # Name and version come from the bundle's own index, not the distribution's
        # METADATA: parsing that imports the email package (~10 ms) for nothing.
        dist = getattr(ep, "dist", None)
        path = None
        if dist is not None:
            try:
                path = Path(dist.locate_file(ep.module))
            except Exception:  # noqa: BLE001 - a distribution we can't locate files of
                path = None
        if (ep.name, path) in seen:
            continue  # the same distribution reached twice through sys.path
        seen.add((ep.name, path))
        out.append(open_bundle(ep.name, ep.name, "?", path, trusted, trust_problem=trust_problem))
    out.sort(key=lambda b: (b.name, b.version))
    for b in out:
        if b.problem:
            warn_once(
                f"bundle:{b.name}:{b.version}",
                f"quack: bundle {b.name} {b.version} refused: {b.problem}; none of its kernels will be used",
                stacklevel=6,
            )
        else:
            log.debug(
                "quack: bundle %s %s at %s: %d entries",
                b.name,
                b.version,
                b.path,
                len(b.index.entries) if b.index is not None else 0,
            )
    return out


def check_files(b: Bundle, e: IndexEntry) -> tuple[str, Path | None]:
    """('' or the problem, verified .so path or None) for one entry's files."""
    if b.path is None:
        return "the bundle's package directory was not found", None
    obj = b.path / e.rel_obj
    try:
        data = fsutil.read_nofollow(obj)
    except OSError as err:
        return f"object {obj} unreadable ({err.strerror or err})", None
    if len(data) != e.size:
        return f"object is {len(data)} bytes, the index says {e.size}", None
    if hashlib.sha256(data).hexdigest() != e.sha256:
        return "object checksum mismatch (altered after the bundle was built)", None
    if e.so_sha256 is None:
        return "", None
    so = b.path / e.rel_so
    try:
        sdata = fsutil.read_nofollow(so)
    except OSError as err:
        return f"shared object {so} unreadable ({err.strerror or err})", None
    if len(sdata) != e.so_size or hashlib.sha256(sdata).hexdigest() != e.so_sha256:
        return "shared object checksum mismatch (altered after the bundle was built)", None
    return "", so


def summary(settings) -> list[dict]:
    """Installed bundles for ``quack cache stats``: name, version, entries, bytes, stamps,
    and whether this toolchain and target arch can use them (``current``)."""
    out = []
    for b in discover(settings):
        idx = b.index
        cur = b.current_entries(settings.arch)
        out.append(
            {
                "name": b.name,
                "version": b.version,
                "dist": b.dist,
                "path": str(b.path),
                "entries": len(idx.entries) if idx else 0,
                "current_entries": cur,
                "bytes": idx.bytes if idx else 0,
                "stamps": idx.stamps if idx else [],
                "current": bool(cur) and not b.problem,
                "signer": b.signer,
                "problem": b.problem,
            }
        )
    return out


class BundleTier:
    """The lookup through installed bundles; one per process (``tier()``)."""

    def __init__(self):
        self._bundles: list[Bundle] | None = None
        self._lock = threading.Lock()

    def bundles(self, settings=None) -> list[Bundle]:
        if self._bundles is None:
            with self._lock:
                if self._bundles is None:  # check, lock, check again
                    if settings is None:
                        from quack import settings as _settings

                        settings = _settings.get()
                    self._bundles = discover(settings)
        return self._bundles

    def lookup(self, ref: EntryRef, settings=None) -> tuple[Entry, Bundle] | None:
        """A verified entry for ``ref`` from the first bundle that holds a good one."""
        for b in self.bundles(settings):
            if not b.usable:
                continue
            for e in b.by_key.get(ref.key, ()):
                if (e.kernel, e.arch, e.stamp) != (ref.kernel, ref.arch, ref.stamp):
                    continue  # another toolchain or arch: never used here
                if e.srcfp != ref.srcfp:
                    log.debug(
                        "quack: bundle %s has %s key %s for kernel source %s, this one is %s",
                        b.name,
                        e.kernel,
                        e.key[:16],
                        e.srcfp,
                        ref.srcfp,
                    )
                    continue
                problem, so = check_files(b, e)
                if problem:
                    warn_once(
                        f"bundle-entry:{b.name}:{e.key}",
                        f"quack: bundle {b.name} {b.version}: entry {e.kernel} key {e.key[:16]} "
                        f"refused: {problem}; not loaded (reinstall the bundle: pip install "
                        f"--force-reinstall {b.dist})",
                        stacklevel=6,
                    )
                    continue
                meta = {
                    "format": 1,
                    "key": e.key,
                    "kernel": e.kernel,
                    "arch": e.arch,
                    "stamp": e.stamp,
                    "srcfp": e.srcfp,
                    "params": e.params,
                    "size": e.size,
                    "sha256": e.sha256,
                    "bundle": b.name,
                }
                log.debug("quack: %s key %s from bundle %s", e.kernel, e.key[:16], b.name)
                return Entry(ref, meta, b.path / e.rel_obj, so), b
        return None

    def searched(self, settings=None) -> tuple[str, ...]:
        if settings is None:
            from quack import settings as _settings

            settings = _settings.get()
        return tuple(b.describe(settings.arch) for b in self.bundles(settings))

    @property
    def discovered(self) -> bool:
        return self._bundles is not None


class BundleView:
    """The process's bundle tier seen with one Settings (trusted keys, arch): what
    quack.runtime.tiers registers as "bundles". An InPlaceTier (loaded where installed)
    and a ReadTier (``fetch``: the verified bytes, for a chain that copies)."""

    name = "bundles"

    def __init__(self, settings):
        self.settings = settings

    def open(self, ref: EntryRef) -> Entry | None:
        found = tier().lookup(ref, self.settings)
        if found is None:
            return None
        entry, b = found
        entry.meta["source"] = f"bundle:{b.name}"
        return entry

    def fetch(self, ref: EntryRef):
        from quack.cache.contract import Fetched

        entry = self.open(ref)
        if entry is None:
            return None
        try:
            data = fsutil.read_nofollow(entry.obj_path)
        except OSError:
            return None
        if hashlib.sha256(data).hexdigest() != entry.meta["sha256"]:
            return None  # replaced since open(): a miss
        return Fetched(ref, data, {"params": entry.meta.get("params", {})}, entry.meta["source"])

    def searched(self) -> tuple[str, ...]:
        return tier().searched(self.settings)


def view(settings) -> BundleView:
    return BundleView(settings)


_TIER = BundleTier()


def tier() -> BundleTier:
    return _TIER


def reset() -> None:
    """Forget what discovery found (tests; after installing or removing a bundle in-process)."""
    global _TIER
    _TIER = BundleTier()
