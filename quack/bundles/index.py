"""The index of a deployment bundle: what a bundle package holds, in one JSON file.

A bundle package (``quack bundle`` writes it into a wheel) is a directory::

    <pkg>/__init__.py                     INDEX: the path of index.json (importing it is never needed)
    <pkg>/index.json                      this module's format
    <pkg>/index.json.sig                  optional: Ed25519 signature of index.json's bytes
    <pkg>/v1/<stamp>/<kernel>/<srcfp>/<key>.o|.json|.so|.so.json    the store's layout

index.json::

    {"format": 1, "name": "myapp-kernels", "version": "1.0", "created": 1764...,
     "quack": "0.1.0", "entries": [
       {"key": 64 hex, "kernel": "rmsnorm_fwd", "arch": "sm_90a", "stamp": "py3.11-...-sm_90a",
        "srcfp": 16 hex, "params": {...}, "file": "v1/.../<key>.o", "sha256": hex, "size": n,
        "so": {"file": "v1/.../<key>.so", "sha256": hex, "size": n} | null}]}

Paths are never taken from the index: they are rebuilt from the entry's validated
fields (``EntryRef`` refuses anything that could leave the package), and ``file``
must equal the rebuilt path or the entry is refused. Pure Python, no quack imports
beyond the store's path rules: the runtime reads it at its first bundle lookup."""

from __future__ import annotations

import dataclasses
import json
import re

from quack.cache import keys
from quack.errors import BundleError, ParamError

INDEX_NAME = "index.json"
SIG_NAME = "index.json.sig"
INDEX_FORMAT = 1
LAYOUT = "v1"
ENTRY_POINT_GROUP = "quack.bundles"
NAME_RE = re.compile(r"^[a-z0-9](?:[a-z0-9._-]{0,62}[a-z0-9])?$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


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

    def to_bytes(self) -> bytes:
        doc = {
            "format": INDEX_FORMAT,
            "name": self.name,
            "version": self.version,
            "created": self.created,
            "quack": self.quack,
            "entries": [e.to_json() for e in self.entries],
        }
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
    if not _HEX64.fullmatch(sha) or size < 0:
        raise BundleError(f"{where}: sha256/size malformed")
    so = raw.get("so")
    so_sha = so_size = None
    if so is not None:
        if (
            not isinstance(so, dict)
            or not isinstance(so.get("sha256"), str)
            or not _HEX64.fullmatch(so["sha256"])
            or not isinstance(so.get("size"), int)
        ):
            raise BundleError(f"{where}.so is malformed")
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


def parse(data: bytes) -> Index:
    """Parse and validate index.json. Raises BundleError naming the bad field."""
    try:
        doc = json.loads(data)
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
    created = doc.get("created", 0)
    return Index(
        name,
        version,
        float(created) if isinstance(created, (int, float)) else 0.0,
        str(doc.get("quack", "")),
        tuple(_entry(i, r) for i, r in enumerate(raw)),
    )
