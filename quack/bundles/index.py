"""The index of a deployment bundle: what a bundle package holds, in one JSON file.

A bundle package (``quack bundle`` writes it into a wheel) is a directory::

    <pkg>/__init__.py                     INDEX: the path of index.json (importing it is never needed)
    <pkg>/index.json                      this module's format
    <pkg>/index.json.sig                  optional: Ed25519 signature of index.json's bytes
    <pkg>/v1/<stamp>/<kernel>/<srcfp>/<key>.o|.json|.so|.so.json    the store's layout

index.json::

    {"format": 1, "name": "myapp-kernels", "version": "1.0", "created": 1764...,
     "quack": "0.1.0", "tune_gpu": {"models": ["H100", ...], "source": "..."}, "entries": [
       {"key": 64 hex, "kernel": "rmsnorm_fwd", "arch": "sm_90a", "stamp": "py3.11-...-sm_90a",
        "srcfp": 16 hex, "params": {...}, "file": "v1/.../<key>.o", "sha256": hex, "size": n,
        "so": {"file": "v1/.../<key>.so", "sha256": hex, "size": n} | null}]}

Paths are never taken from the index: they are rebuilt from the entry's validated
fields (``EntryRef`` refuses anything that could leave the package), and ``file``
must equal the rebuilt path or the entry is refused. Pure Python, no quack imports
beyond the store's path rules: the runtime reads it at its first bundle lookup.

Caps (issue 30; a bundle is untrusted input until its signature checks): an index of
more than ``MAX_INDEX_BYTES`` is refused by its size, before it is read; one of more
than ``MAX_ENTRIES`` entries right after parsing, before any entry is validated; an
entry whose object or .so is over ``MAX_FILE_BYTES``, and a per-entry metadata file
or signature over ``MAX_META_BYTES`` / ``MAX_SIG_BYTES``, are refused unread. A 200 MB
index cost every process's first lookup 7 s and 850 MB before these."""

from __future__ import annotations

import dataclasses
import json
import re

from quack.cache import keys
from quack.errors import BundleError, ParamError
from quack.safejson import safe_loads

INDEX_NAME = "index.json"
SIG_NAME = "index.json.sig"
INDEX_FORMAT = 1
LAYOUT = "v1"
ENTRY_POINT_GROUP = "quack.bundles"
NAME_RE = re.compile(r"^[a-z0-9](?:[a-z0-9._-]{0,62}[a-z0-9])?$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
MIB = 1024 * 1024
# ~700 bytes an entry: 16 MiB holds 20,000 entries, 20x the largest bundle we ship
# (training + tests: 1,015). What a bundle may hold beyond that is not worth parsing.
MAX_INDEX_BYTES = 16 * MIB
MAX_ENTRIES = 20_000
# Kernel objects and their .so are ~40 KB; 64 MiB is far beyond any real one.
MAX_FILE_BYTES = 64 * MIB
MAX_META_BYTES = 64 * 1024  # one entry's <key>.json / <key>.so.json (~600 bytes)
MAX_SIG_BYTES = 64 * 1024  # index.json.sig (~150 bytes)
# The fields of an entry's <key>.json (the store's metadata, shipped as is) that must
# equal the index entry's: a file swapped in from another kernel or key names its own.
META_FIELDS = ("key", "kernel", "arch", "stamp", "srcfp", "sha256", "size")


@dataclasses.dataclass(frozen=True)
class IndexEntry:
    key: str
    kernel: str
    arch: str
    stamp: str
    srcfp: str
    params: dict
    sha256: str
    size: int
    so_sha256: str | None = None
    so_size: int | None = None

    @property
    def rel_dir(self) -> str:
        return f"{LAYOUT}/{keys.safe_component(self.stamp)}/{self.kernel}/{self.srcfp}"

    @property
    def rel_obj(self) -> str:
        return f"{self.rel_dir}/{self.key}.o"

    @property
    def rel_meta(self) -> str:
        return f"{self.rel_dir}/{self.key}.json"

    @property
    def rel_so(self) -> str:
        return f"{self.rel_dir}/{self.key}.so"

    @property
    def rel_so_meta(self) -> str:
        return f"{self.rel_dir}/{self.key}.so.json"

    def to_json(self) -> dict:
        so = (
            None
            if self.so_sha256 is None
            else {"file": self.rel_so, "sha256": self.so_sha256, "size": self.so_size}
        )
        return {
            "key": self.key,
            "kernel": self.kernel,
            "arch": self.arch,
            "stamp": self.stamp,
            "srcfp": self.srcfp,
            "params": self.params,
            "file": self.rel_obj,
            "sha256": self.sha256,
            "size": self.size,
            "so": so,
        }


@dataclasses.dataclass(frozen=True)
class Index:
    name: str
    version: str
    created: float
    quack: str
    entries: tuple[IndexEntry, ...]
    # The GPU models whose tuning rows chose its entries' configurations (none: each
    # table's default, a build without a GPU) and why: a process on another model asks for
    # other keys, and its misses say which models the bundle was made for. Optional (older
    # bundles have none).
    tune_gpu: tuple[tuple[str, ...], str] | None = None

    def to_bytes(self) -> bytes:
        doc: dict = {
            "format": INDEX_FORMAT,
            "name": self.name,
            "version": self.version,
            "created": self.created,
            "quack": self.quack,
            "entries": [e.to_json() for e in self.entries],
        }
        if self.tune_gpu is not None:
            doc["tune_gpu"] = {"models": list(self.tune_gpu[0]), "source": self.tune_gpu[1]}
        return json.dumps(doc, sort_keys=True, indent=1).encode()

    @property
    def stamps(self) -> list[str]:
        return sorted({e.stamp for e in self.entries})

    @property
    def bytes(self) -> int:
        return sum(e.size + (e.so_size or 0) for e in self.entries)


def check_name(name: str) -> str:
    """A bundle name: lowercase letters, digits, '.', '_', '-' (a valid distribution name)."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ValueError(
            f"bundle name {name!r} is invalid: use 1-64 lowercase letters, digits, "
            f"'.', '_' or '-', starting and ending with a letter or digit"
        )
    return name


def package_name(name: str) -> str:
    """The importable package a bundle's files live in."""
    return "quack_bundle_" + re.sub(r"[^a-z0-9]", "_", check_name(name))


def dist_name(name: str) -> str:
    """The distribution name as wheel file names spell it (PEP 427 escaping)."""
    return re.sub(r"[-_.]+", "_", check_name(name))


def _entry(i: int, raw) -> IndexEntry:
    where = f"entries[{i}]"
    if not isinstance(raw, dict):
        raise BundleError(f"{where} is not an object")

    def field(name, kind):
        v = raw.get(name)
        if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
            raise BundleError(f"{where}.{name} = {v!r} is missing or of the wrong type")
        return v

    key, kernel, arch, srcfp = (
        field("key", str),
        field("kernel", str),
        field("arch", str),
        field("srcfp", str),
    )
    stamp = field("stamp", str)
    try:
        from quack.cache.entry import EntryRef

        EntryRef(kernel, key, arch, srcfp)  # the store's path rules: no '..', '/', NUL
    except ParamError as e:
        raise BundleError(f"{where}: {e}") from None
    if keys.safe_component(stamp) != stamp or not stamp.endswith("-" + arch):
        raise BundleError(f"{where}.stamp = {stamp!r} is not a toolchain stamp for {arch}")
    sha, size = field("sha256", str), field("size", int)
    if not _HEX64.fullmatch(sha) or not 0 <= size <= MAX_FILE_BYTES:
        raise BundleError(f"{where}: sha256/size malformed (size: 0 to {MAX_FILE_BYTES} bytes)")
    so = raw.get("so")
    so_sha = so_size = None
    if so is not None:
        if (
            not isinstance(so, dict)
            or not isinstance(so.get("sha256"), str)
            or not _HEX64.fullmatch(so["sha256"])
            or not isinstance(so.get("size"), int)
            or isinstance(so["size"], bool)
            or not 0 <= so["size"] <= MAX_FILE_BYTES
        ):
            raise BundleError(f"{where}.so is malformed (sha256: 64 hex; size: 0 to {MAX_FILE_BYTES} bytes)")
        so_sha, so_size = so["sha256"], so["size"]
    params = raw.get("params", {})
    if not isinstance(params, dict):
        raise BundleError(f"{where}.params is not an object")
    ent = IndexEntry(key, kernel, arch, stamp, srcfp, params, sha, size, so_sha, so_size)
    if raw.get("file") != ent.rel_obj or (so is not None and so.get("file") != ent.rel_so):
        raise BundleError(
            f"{where}.file = {raw.get('file')!r} does not match the store layout ({ent.rel_obj})"
        )
    return ent


def too_large(what: str, size: int, cap: int) -> str:
    """The refusal for a file over its cap (one wording for the runtime and inspect)."""
    return f"{what} is {size} bytes, more than the {cap} a bundle allows (refused unread)"


def parse(data: bytes) -> Index:
    """Parse and validate index.json. Raises BundleError naming the bad field. The
    caller checks the signature first, when one is needed: this parses untrusted bytes,
    bounded by MAX_INDEX_BYTES and MAX_ENTRIES."""
    if len(data) > MAX_INDEX_BYTES:
        raise BundleError(too_large(INDEX_NAME, len(data), MAX_INDEX_BYTES))
    try:
        doc = safe_loads(data)
    except ValueError as e:
        raise BundleError(f"not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise BundleError("not a JSON object")
    if doc.get("format") != INDEX_FORMAT:
        raise BundleError(f"format = {doc.get('format')!r}; this quack reads format {INDEX_FORMAT}")
    name, version = doc.get("name"), doc.get("version")
    if not isinstance(name, str) or not isinstance(version, str):
        raise BundleError("name/version missing")
    raw = doc.get("entries")
    if not isinstance(raw, list):
        raise BundleError("entries is not a list")
    if len(raw) > MAX_ENTRIES:
        raise BundleError(f"entries has {len(raw)} items, more than the {MAX_ENTRIES} a bundle may hold")
    created = doc.get("created", 0)
    return Index(
        name,
        version,
        float(created) if isinstance(created, (int, float)) else 0.0,
        str(doc.get("quack", "")),
        tuple(_entry(i, r) for i, r in enumerate(raw)),
        _tune_gpu(doc.get("tune_gpu")),
    )


def _tune_gpu(v) -> tuple[tuple[str, ...], str] | None:
    """index.json's optional ``tune_gpu``: {"models": [model names], "source": text}.
    Anything else reads as absent: it only informs (messages, ``verify --bundles``), so a
    shape this quack does not know (a later one's) must not refuse the bundle's entries."""
    if not isinstance(v, dict):
        return None
    models, source = v.get("models"), v.get("source")
    if not isinstance(models, list) or len(models) > 64:
        return None
    if not all(isinstance(m, str) and _MODEL.fullmatch(m) for m in models):
        return None
    if not (isinstance(source, str) and len(source) <= 200):
        return None
    return tuple(models), source


_MODEL = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")


def check_meta(e: IndexEntry, data: bytes) -> str:
    """'' if ``data`` (the entry's ``<key>.json``) names the same key, kernel, arch,
    stamp, source, digest and size as the index entry; else the problem. Guards against
    an index entry pointed at another kernel's files (issue 30: with no trusted keys
    nothing else ties the object to what the index says it is)."""
    if len(data) > MAX_META_BYTES:
        return too_large("its metadata", len(data), MAX_META_BYTES)
    try:
        meta = safe_loads(data)
    except ValueError as err:
        return f"its metadata is not valid JSON ({err})"
    if not isinstance(meta, dict):
        return "its metadata is not a JSON object"
    want: dict[str, object] = {"key": e.key, "kernel": e.kernel, "arch": e.arch, "stamp": e.stamp}
    want.update(srcfp=e.srcfp, sha256=e.sha256, size=e.size)
    for f in META_FIELDS:
        if f not in meta:
            return f"its metadata has no {f} (the index says {want[f]!r})"
        if meta[f] != want[f]:
            return f"its metadata says {f}={meta.get(f)!r}, the index {want[f]!r} (another entry's files)"
    return ""


def check_so_meta(e: IndexEntry, data: bytes) -> str:
    """'' if ``data`` (the entry's ``<key>.so.json``) ties the .so to this entry's
    object and the index's .so digest; else the problem."""
    if len(data) > MAX_META_BYTES:
        return too_large("its .so metadata", len(data), MAX_META_BYTES)
    try:
        side = safe_loads(data)
    except ValueError as err:
        return f"its .so metadata is not valid JSON ({err})"
    if not isinstance(side, dict) or (side.get("o_sha256"), side.get("sha256")) != (e.sha256, e.so_sha256):
        return "its .so metadata does not match the index (another entry's .so)"
    return ""
