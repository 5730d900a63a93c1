"""Installed bundles as a read-only cache tier (after the local cache, before compiling).

Discovery reads the ``quack.bundles`` entry points once per process, at the first
lookup that reaches this tier (a process that never misses its local cache, or never
asks for a kernel, pays nothing). A bundle's package is never imported: its
directory comes from the distribution that declared the entry point.

A bundle is refused as a whole (one warning) when its entry point does not name its
own package (``quack_bundle_<name>``) or its distribution's RECORD does not list that
package's index, when its index is unreadable, over the caps of quack.bundles.index
or malformed, or when trusted keys are configured and its index is unsigned or not
signed by one of them (checked over the raw bytes before they are parsed). An entry
is used only if its toolchain stamp, arch, kernel and source fingerprint are this
process's, its files are reached with no symlink on the way (quack.bundles.files),
their sizes and SHA-256 match the index and the entry's own metadata names the same
key, kernel and digest (a mismatch: one warning, never loaded; the next bundle holding
the key is tried)."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from pathlib import Path

from quack.bundles import files
from quack.bundles import index as _index
from quack.bundles.index import Index, IndexEntry
from quack.cache import keys
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
        tuned = ""
        if self.index is not None and self.index.tune_gpu is not None:
            models, _ = self.index.tune_gpu
            tuned = f", tuned for {'GPU ' + ', '.join(models) if models else 'each table default GPU'}"
        return f"{self.name} {self.version} ({cur} of {n} entries for this toolchain and {arch}{tuned})"


def open_bundle(
    name: str, dist: str, version: str, path: Path | None, trusted, *, problem: str = ""
) -> Bundle:
    """Read and check one bundle's index (no import of its package). Order (issue 30):
    the index's size from fstat (over MAX_INDEX_BYTES: refused unread), then, with
    trusted keys, its signature over the raw bytes, and only then the JSON parse."""
    b = Bundle(name, dist, version, path)
    if problem:
        b.problem = problem
        return b
    if path is None or not path.is_dir():
        b.problem = f"package directory {path} not found (broken install?)"
        return b
    where = path / _index.INDEX_NAME
    try:
        data = files.read_under(path, _index.INDEX_NAME, _index.MAX_INDEX_BYTES)
    except OSError as e:
        b.problem = f"cannot read {where} ({e.strerror or e})"
        return b
    except BundleError as e:
        b.problem = str(e)
        return b
    if trusted is not None:
        from quack.bundles import trust

        try:
            b.signer = trust.verify_index(data, path, trusted, bundle=name)
        except BundleError as e:
            b.problem = str(e)
            return b
    try:
        b.index = _index.parse(data)
    except BundleError as e:
        b.problem = f"{where} is malformed: {e}"
        return b
    b.version = b.index.version
    if b.index.name != name:
        b.problem = f"its index names bundle {b.index.name!r}, its entry point {name!r}"
        return b
    for ent in b.index.entries:
        b.by_key.setdefault(ent.key, []).append(ent)
    return b


def _dist_version(ep) -> str:
    """The version of the distribution that installed entry point ``ep`` ("?" if unknown)."""
    try:
        v = ep.dist.version if ep.dist is not None else None
    except Exception:  # noqa: BLE001 - broken METADATA: the version is only for the message
        v = None
    return v if isinstance(v, str) and v else "?"


def package_dir(ep) -> tuple[Path | None, str]:
    """(the package directory of entry point ``ep``, '' or why it is refused). The
    value must be the package ``quack bundle`` names (``quack_bundle_<name>``, one
    path component: issue 30, a value of ``..`` made the runtime read site/../), and
    the distribution's RECORD must list that package's index.json (the files pip
    installed for it, not another distribution's)."""
    pkg = ep.value.strip()
    try:
        want = _index.package_name(ep.name)
    except ValueError as e:
        return None, f"its entry point name is invalid: {e}"
    if pkg != want:
        return None, f"its entry point value {pkg!r} is not its package {want!r}"
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, "its entry point has no distribution (broken install?)"
    try:
        # RECORD's text searched for the line, not dist.files: parsing every line into
        # PackagePath objects took 118 ms for a 1,000-entry bundle, this ~2 ms. The
        # package's own paths have no character that CSV would quote.
        record = dist.read_text("RECORD") or ""
        path = Path(dist.locate_file(pkg))
    except Exception as e:  # noqa: BLE001 - a distribution whose files can't be listed
        return None, f"its distribution's RECORD can't be read ({e})"
    if f"\n{pkg}/{_index.INDEX_NAME}," not in "\n" + record:
        return None, (
            f"its distribution's RECORD does not list {pkg}/{_index.INDEX_NAME} "
            f"(files not installed by it; reinstall the bundle)"
        )
    return path, ""


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
        path, problem = package_dir(ep)
        if (ep.name, path) in seen:
            continue  # the same distribution reached twice through sys.path
        seen.add((ep.name, path))
        b = open_bundle(ep.name, ep.name, "?", path, trusted, problem=trust_problem or problem)
        if b.index is None:
            # Refused before its index gave a version: name it by its distribution's
            # ("bundle t1 ? refused" left the user guessing which install was meant).
            # Read only here, for refused bundles: METADATA parsing costs ~10 ms.
            b.version = _dist_version(ep)
        out.append(b)
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


def _read(b: Bundle, rel: str, cap: int) -> tuple[bytes | None, str]:
    assert b.path is not None
    try:
        return files.read_under(b.path, rel, cap), ""
    except BundleError as err:
        return None, str(err)
    except OSError as err:
        return None, f"{b.path / rel} unreadable ({err.strerror or err})"


def check_files(b: Bundle, e: IndexEntry) -> tuple[str, Path | None]:
    """('' or the problem, verified .so path or None) for one entry's files: read with
    no symlink on the way (quack.bundles.files), sizes and SHA-256 against the index,
    and the entry's own metadata against the index (another kernel's files, moved under
    this entry's name, carry their own key: refused)."""
    if b.path is None:
        return "the bundle's package directory was not found", None
    data, problem = _read(b, e.rel_obj, e.size)
    if data is None:
        return f"object: {problem}", None
    if len(data) != e.size:
        return f"object is {len(data)} bytes, the index says {e.size}", None
    if hashlib.sha256(data).hexdigest() != e.sha256:
        return "object checksum mismatch (altered after the bundle was built)", None
    meta, problem = _read(b, e.rel_meta, _index.MAX_META_BYTES)
    problem = problem or _index.check_meta(e, meta or b"")
    if problem:
        return f"metadata: {problem}", None
    if e.so_sha256 is None:
        return "", None
    sdata, problem = _read(b, e.rel_so, e.so_size or 0)
    if sdata is None:
        return f"shared object: {problem}", None
    if len(sdata) != e.so_size or hashlib.sha256(sdata).hexdigest() != e.so_sha256:
        return "shared object checksum mismatch (altered after the bundle was built)", None
    side, problem = _read(b, e.rel_so_meta, _index.MAX_META_BYTES)
    problem = problem or _index.check_so_meta(e, side or b"")
    if problem:
        return f"shared object: {problem}", None
    return "", b.path / e.rel_so


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

        found = tier().lookup(ref, self.settings)
        if found is None:
            return None
        entry, b = found
        assert b.path is not None  # lookup returns entries of usable bundles only
        rel = entry.obj_path.relative_to(b.path).as_posix()
        try:
            data = files.read_under(b.path, rel, int(entry.meta["size"]))
        except (OSError, BundleError):
            return None  # removed or replaced since lookup: a miss
        if hashlib.sha256(data).hexdigest() != entry.meta["sha256"]:
            return None  # replaced since lookup: a miss
        source = f"bundle:{b.name}"
        return Fetched(ref, data, {"params": entry.meta.get("params", {})}, source)

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
