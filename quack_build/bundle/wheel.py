"""``quack bundle``: prebuilt cache entries -> a pip-installable wheel (build time only).

The wheel holds one package, ``quack_bundle_<name>``, with the entries' files in the
store's layout (docs/cache-layout.md), an index (quack.bundles.index), optionally its
Ed25519 signature, and a ``quack.bundles`` entry point naming the package. The wheel
format (RECORD with every file's hash, the dist-info directory) is written by the
``wheel`` project's WheelFile; only METADATA, WHEEL and entry_points.txt are ours."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import sysconfig
import tempfile
import time
from pathlib import Path

from quack import __version__ as QUACK_VERSION
from quack.bundles import index as _index
from quack.bundles.index import Index, IndexEntry
from quack.cache import fsutil
from quack.errors import BundleError, LinkError
from quack.runtime import loader

# The runtime's own distribution: every bundle requires it (METADATA's Requires-Dist).
RUNTIME_DIST = "quack-cache"
GENERATOR = f"{RUNTIME_DIST} {QUACK_VERSION}"


@dataclasses.dataclass
class BundleFile:
    """One entry to ship: its index record and its bytes."""

    entry: IndexEntry
    obj: bytes
    meta: dict
    so: bytes | None = None


def platform_tag() -> str:
    """This machine's wheel platform tag (``linux_x86_64``): the objects are host code."""
    return sysconfig.get_platform().replace("-", "_").replace(".", "_")


def check_version(version: str) -> str:
    from packaging.version import InvalidVersion, Version

    try:
        return str(Version(version))
    except InvalidVersion:
        raise ValueError(
            f"bundle version {version!r} is not a valid version (PEP 440), e.g. 1.0 or 2026.12.1"
        ) from None


def canonical_name(name: str) -> str:
    """The distribution name as pip compares it (PEP 503): ``Quack_Cache`` is ``quack-cache``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def check_new_name(name: str) -> str:
    """``name`` for a bundle about to be written, or ValueError saying what is allowed.

    A bundle is a distribution: pip installs it in place of any distribution with the
    same name after PEP 503 normalisation. ``--name quack-cache`` (or ``quack_cache``,
    ``quack.cache``) wrote a wheel that required itself and, installed, uninstalled
    the quack runtime; ``--name torch`` or ``numpy`` would replace those. So the
    runtime's name is refused, and so is every installed distribution that is not a
    quack bundle (one declaring a ``quack.bundles`` entry point: its next version is
    fine)."""
    _index.check_name(name)
    canon = canonical_name(name)
    allowed = "use a name of your own that no installed package has, e.g. myapp-kernels"
    if canon == RUNTIME_DIST:
        raise ValueError(
            f"bundle name {name!r} is the quack runtime's own distribution ({RUNTIME_DIST}, as pip "
            f"normalises names): installing the bundle would uninstall quack; {allowed}"
        )
    from importlib.metadata import distributions

    for dist in distributions(name=canon):
        if not any(ep.group == _index.ENTRY_POINT_GROUP for ep in dist.entry_points):
            other = dist.metadata["Name"] or canon
            raise ValueError(
                f"bundle name {name!r} is the installed distribution {other} {dist.version} (as pip "
                f"normalises names), which is not a quack bundle: installing the bundle would "
                f"replace it; {allowed}"
            )
    return name


def wheel_name(name: str, version: str) -> str:
    return f"{_index.dist_name(name)}-{check_version(version)}-py3-none-{platform_tag()}.whl"


def collect(configs, store) -> tuple[list[BundleFile], list[str]]:
    """The store's verified entries for ``configs`` (BuildConfig), each with a .so (the
    store's, or linked now when it has none and a C compiler is here). Returns
    (files, problems); a configuration missing from the store is a problem."""
    from quack.compile import builder

    files: list[BundleFile] = []
    problems: list[str] = []
    seen = set()
    for c in configs:
        ref = builder.entry_ref(c.spec, c.params, c.arch)
        if ref.key in seen:
            continue
        seen.add(ref.key)
        entry = store.lookup(ref)
        if entry is None:
            problems.append(f"{c.label()}: not in the cache {store.root} (build it first)")
            continue
        obj = fsutil.read_nofollow(entry.obj_path)
        if hashlib.sha256(obj).hexdigest() != entry.meta["sha256"]:
            problems.append(f"{c.label()}: the cache entry changed while it was read; run again")
            continue
        so = fsutil.read_nofollow(entry.so_path) if entry.so_path is not None else None
        if so is None and loader.can_link():
            so = _link(entry.obj_path)
        ie = IndexEntry(
            ref.key,
            ref.kernel,
            ref.arch,
            ref.stamp,
            ref.srcfp,
            c.spec.plain(c.params),
            entry.meta["sha256"],
            len(obj),
            hashlib.sha256(so).hexdigest() if so is not None else None,
            len(so) if so is not None else None,
        )
        files.append(BundleFile(ie, obj, entry.meta, so))
    return files, problems


def _link(obj: Path) -> bytes | None:
    with tempfile.TemporaryDirectory(prefix="quack-bundle-") as d:
        out = Path(d) / "k.so"
        try:
            loader.link(obj, out)
        except (LinkError, OSError):
            return None
        return out.read_bytes()


def _metadata(name: str, version: str, idx: Index) -> str:
    stamps = ", ".join(idx.stamps) or "none"
    return (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        f"Summary: quack kernel bundle: {len(idx.entries)} prebuilt kernels ({stamps})\n"
        f"Requires-Dist: {RUNTIME_DIST}\n\n"
        f"Prebuilt CuTe DSL kernels for quack's runtime, written by `quack bundle`.\n"
        f"Installed, they are found through the `{_index.ENTRY_POINT_GROUP}` entry point group.\n"
    )


def _init_py(name: str, version: str) -> str:
    return (
        f'"""quack deployment bundle {name} {version}, written by `quack bundle`.\n\n'
        f"Data only: quack finds index.json through the {_index.ENTRY_POINT_GROUP} entry point and\n"
        f'never imports this package."""\nfrom pathlib import Path\n\n'
        f'INDEX = Path(__file__).with_name("{_index.INDEX_NAME}")\n'
    )


def wheelfile_api():
    """``(WheelFile, WheelError)`` of the optional 'wheel' package (the writer and
    ``bundle.inspect`` share it), or BundleError saying how to install it."""
    try:
        from wheel.wheelfile import WheelError, WheelFile
    except ImportError:
        raise BundleError(
            "quack bundle needs the 'wheel' package: pip install 'quack-cache[bundle]'"
        ) from None
    return WheelFile, WheelError


def _write_members(wf, files, name, version, pkg, distinfo, idx, index_bytes, signing_key) -> None:
    wf.writestr(f"{pkg}/__init__.py", _init_py(name, version))
    for f in files:
        e = f.entry
        wf.writestr(f"{pkg}/{e.rel_obj}", f.obj)
        wf.writestr(f"{pkg}/{e.rel_meta}", json.dumps(f.meta, sort_keys=True, indent=1))
        if f.so is not None:
            wf.writestr(f"{pkg}/{e.rel_so}", f.so)
            wf.writestr(f"{pkg}/{e.rel_so_meta}", json.dumps({"o_sha256": e.sha256, "sha256": e.so_sha256}))
    wf.writestr(f"{pkg}/{_index.INDEX_NAME}", index_bytes)
    if signing_key is not None:
        from quack.bundles import trust

        wf.writestr(f"{pkg}/{_index.SIG_NAME}", trust.signature_bytes(index_bytes, signing_key))
    wf.writestr(f"{distinfo}/METADATA", _metadata(name, version, idx))
    wf.writestr(
        f"{distinfo}/WHEEL",
        f"Wheel-Version: 1.0\nGenerator: {GENERATOR}\n"
        f"Root-Is-Purelib: false\nTag: py3-none-{platform_tag()}\n",
    )
    wf.writestr(f"{distinfo}/entry_points.txt", f"[{_index.ENTRY_POINT_GROUP}]\n{name} = {pkg}\n")


def _abandon(wf) -> None:
    """Close a wheel being written without finishing it. Issue 30: on a full disk,
    ``with WheelFile(...)`` re-ran close() (RECORD, central directory) into the same
    full disk, failed again, and left the file open, so ZipFile.__del__ tried once more
    at exit and printed a 20-line "Exception ignored" traceback. The half-written file
    is removed with its temp directory by the caller."""
    fp, wf.fp = wf.fp, None  # close() and __del__ do nothing once fp is None
    if fp is not None:
        with contextlib.suppress(OSError):  # flushing the buffer into a full disk fails again
            fp.close()


def write_wheel(
    files: list[BundleFile],
    *,
    name: str,
    version: str,
    out_dir: Path,
    signing_key=None,
    created: float | None = None,
    tune_gpu: tuple[tuple[str, ...], str] | None = None,
) -> tuple[Path, Index]:
    """Write ``out_dir/<name>-<version>-py3-none-<platform>.whl`` atomically (a temp
    directory beside it, then a rename). ``signing_key``: a quack.signing.SigningKey."""
    WheelFile, _ = wheelfile_api()

    check_new_name(name)
    version = check_version(version)
    pkg = _index.package_name(name)
    if created is None:
        # SOURCE_DATE_EPOCH (reproducible builds): WheelFile dates the members by it too,
        # so the same entries give a byte-identical wheel.
        sde = os.environ.get("SOURCE_DATE_EPOCH", "")
        created = float(sde) if sde.isdigit() else time.time()
    idx = Index(name, version, created, QUACK_VERSION, tuple(f.entry for f in files), tune_gpu)
    index_bytes = idx.to_bytes()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fname = wheel_name(name, version)
    distinfo = f"{_index.dist_name(name)}-{version}.dist-info"
    with tempfile.TemporaryDirectory(prefix=".quack-bundle-", dir=out_dir) as tmpd:
        tmp = Path(tmpd) / fname
        wf = WheelFile(tmp, "w")
        try:
            _write_members(wf, files, name, version, pkg, distinfo, idx, index_bytes, signing_key)
            wf.close()  # writes RECORD and the central directory: may fail too (disk full)
        except BaseException:
            _abandon(wf)
            raise
        os.replace(tmp, out_dir / fname)
    return out_dir / fname, idx
