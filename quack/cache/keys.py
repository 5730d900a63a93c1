"""Cache keys, toolchain stamps and per-kernel source fingerprints.

A key is SHA-256 over a canonical JSON text (sorted keys, no whitespace,
ASCII only) of (kernel name, tagged parameters, arch, kernel version): the
same in every process and Python version, unlike pickle or hash()."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata as md
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Protocol

KEY_FORMAT = 1
_SAFE = re.compile(r"[^A-Za-z0-9._+-]")


def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def key_material(kernel: str, encoded_params: dict, arch: str, version: int = 0) -> str:
    return canonical_json(
        {"f": KEY_FORMAT, "kernel": kernel, "params": encoded_params, "arch": arch, "version": version}
    )


def make_key(kernel: str, encoded_params: dict, arch: str, version: int = 0) -> str:
    return hashlib.sha256(key_material(kernel, encoded_params, arch, version).encode()).hexdigest()


def _dist_version(name: str) -> str | None:
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        return None
    # The Version header, read directly: md.version parses the whole METADATA with the
    # email package (~3 ms for cutlass-dsl's, on every fresh process's first load).
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    for line in text.splitlines():
        if not line.strip():
            break  # end of the headers
        if line.startswith("Version:"):
            return line[len("Version:") :].strip()
    return dist.version


@functools.lru_cache(maxsize=None)
def toolchain() -> dict:
    """What changes every binary: Python, cutlass-dsl (and its CUDA flavour of
    libraries: cu12 and cu13 builds give different .o files), tvm-ffi."""
    flavour = "none"
    for f in ("cu13", "cu12"):
        if _dist_version(f"nvidia-cutlass-dsl-libs-{f}"):
            flavour = f
            break
    return {
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "cutlass_dsl": _dist_version("nvidia-cutlass-dsl") or "none",
        "libs": flavour,
        "tvm_ffi": _dist_version("apache-tvm-ffi") or "none",
    }


def toolchain_stamp(arch: str) -> str:
    """Readable directory name, e.g. ``py3.11-cutlass4.8.1-cu12-tvmffi0.1.15-sm_90a``."""
    return _SAFE.sub("_", f"{toolchain_tag()}-{arch}")


def toolchain_tag() -> str:
    """The toolchain part of the stamp, without the arch: ``py3.11-cutlass4.8.1-cu12-tvmffi0.1.15``."""
    t = toolchain()
    return _SAFE.sub("_", f"py{t['python']}-cutlass{t['cutlass_dsl']}-{t['libs']}-tvmffi{t['tvm_ffi']}")


# --- source fingerprints -------------------------------------------------------
# What a fingerprint covers is found by quack.cache.sources (imported on a memo miss
# only: a fresh process's hit reads the memo and parses nothing).


def source_files(module: str) -> dict[str, Path]:
    """The files the fingerprint of ``module`` hashes (name -> file): see coverage."""
    return coverage(module).files


def coverage(module: str, depends_on: tuple[str, ...] = (), kernel: str = ""):
    """Every file and installed distribution the fingerprint of ``module`` (and a
    kernel's ``depends_on``) covers: a quack.cache.sources.Coverage. Walks the imports."""
    from quack.cache import sources

    return sources.coverage(module, tuple(depends_on), kernel=kernel)


_FP_CACHE: dict[str, tuple[object, tuple, str]] = {}


def _stat_sig(cov) -> tuple:
    sig: list[tuple] = []
    for name, path in cov.watched():
        try:
            st = path.stat()
            sig.append((name, st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            sig.append((name, None))
    return tuple(sig)


class FingerprintMemo(Protocol):
    """A store of fingerprints that outlives the process (quack.cache.fpmemo).

    lookup: the coverage and fingerprint recorded for ``module`` (with ``depends_on``)
      whose file is ``origin``, or None when there is none or any recorded file,
      directory or distribution changed since (a miss; a damaged memo is a miss plus one
      warning). Never raises.
    record: remember a fingerprint computed from reading the files after ``started_ns``
      (time.time_ns()); skipped when a file may have changed since then. Never raises.
    """

    def lookup(
        self, module: str, origin: Path, depends_on: tuple[str, ...] = ()
    ) -> tuple[object, str] | None: ...
    def record(
        self, module: str, cov, fp: str, started_ns: int, depends_on: tuple[str, ...] = ()
    ) -> None: ...


def _hash(cov) -> str:
    """Files by name and bytes, then distributions by name and version."""
    h = hashlib.sha256()
    for name, path in sorted(cov.files.items()):
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    for name, (version, _) in sorted(cov.dists.items()):
        h.update(b"dist\0" + name.encode() + b"\0" + version.encode() + b"\0")
    return h.hexdigest()[:16]


def source_fingerprint(
    module: str, memo: FingerprintMemo | None = None, depends_on: tuple[str, ...] = (), kernel: str = ""
) -> str:
    """SHA-256 (first 16 hex digits) over what ``coverage(module, depends_on)`` covers.

    Memoized per process but re-checked against the files' stat signature: a
    long-lived process (a notebook, a compile worker) whose kernel source is
    edited must see the new fingerprint, or it would look for (and a worker
    would publish) entries under different directories. ``memo`` carries it
    across processes (same stat check), so a fresh process parses nothing.
    Raises KernelDependencyError for a ``depends_on`` entry that names nothing."""
    depends_on = tuple(depends_on)
    ident = module if not depends_on else module + "|" + "|".join(depends_on)
    hit = _FP_CACHE.get(ident)
    if hit is not None and _stat_sig(hit[0]) == hit[1]:
        return hit[2]
    origin = _module_file(module) if memo is not None else None
    if memo is not None and origin is not None:
        got = memo.lookup(module, origin, depends_on)
        if got is not None:
            cov, fp = got
            _FP_CACHE[ident] = (cov, _stat_sig(cov), fp)
            return fp
    started = time.time_ns()  # before any read: an edit from here on is never memoized
    cov = coverage(module, depends_on, kernel)
    sig = _stat_sig(cov)
    fp = _hash(cov)
    _FP_CACHE[ident] = (cov, sig, fp)
    if memo is not None and origin is not None:
        memo.record(module, cov, fp, started, depends_on)
    return fp


def changed_since(module: str, t_ns: int, depends_on: tuple[str, ...] = (), kernel: str = "") -> list[str]:
    """The names of the files (and distributions) the fingerprint of ``module`` covers
    whose status changed after ``t_ns`` (their ctime; a file gone counts as changed).
    Uses the coverage the last fingerprint here walked, else walks it."""
    depends_on = tuple(depends_on)
    ident = module if not depends_on else module + "|" + "|".join(depends_on)
    hit = _FP_CACHE.get(ident)
    cov: Any = hit[0] if hit is not None else coverage(module, depends_on, kernel)
    out = []
    for name, path in cov.watched():
        try:
            if path.stat().st_ctime_ns > t_ns:
                out.append(name)
        except OSError:
            out.append(name)
    return out


def _module_file(name: str) -> Path | None:
    from quack.cache import sources

    return sources.module_file(name)


source_fingerprint.cache_clear = _FP_CACHE.clear  # type: ignore[attr-defined]


def safe_component(text: str) -> str:
    """A path component made only of [A-Za-z0-9._+-], never '.' or '..'."""
    s = _SAFE.sub("_", text)[:100]
    return s if s.strip(".") else "_"
