"""Cache keys, toolchain stamps and per-kernel source fingerprints.

A key is SHA-256 over a canonical JSON text (sorted keys, no whitespace,
ASCII only) of (kernel name, tagged parameters, arch, kernel version): the
same in every process and Python version, unlike pickle or hash()."""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata as md
import importlib.util
import json
import re
import sys
import time
from pathlib import Path
from typing import Protocol

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


def _spec(name: str):
    """``name``'s module spec, found WITHOUT importing it or its parent packages (beyond
    what is imported already). ``importlib.util.find_spec("a.b.c")`` imports ``a.b``: for
    ``from .mod import name`` the fingerprint asks whether ``pkg.mod.name`` is a module,
    and that import ran ``pkg.mod`` (and its cutlass import) in a process that only loads
    prebuilt objects. A name under a plain module (not a package) is an attribute: None.
    The finders asked are the import system's own (``sys.meta_path``, with the parent's
    search path), as an import would ask them."""
    mod = sys.modules.get(name)
    if mod is not None:
        return getattr(mod, "__spec__", None)
    parent, _, _ = name.rpartition(".")
    if not parent:
        return importlib.util.find_spec(name)  # top level: searched, not imported
    pmod = sys.modules.get(parent)
    if pmod is not None:
        path = getattr(pmod, "__path__", None)
    else:
        pspec = _spec(parent)
        path = pspec.submodule_search_locations if pspec is not None else None
    if not path:
        return None
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is not None:
            spec = find(name, list(path))
            if spec is not None:
                return spec
    return None


def _module_file(name: str) -> Path | None:
    mod = sys.modules.get(name)
    f = getattr(mod, "__file__", None) if mod is not None else None
    if f is None:
        try:
            spec = _spec(name)
        except (ImportError, ValueError):
            return None
        f = spec.origin if spec is not None else None
    if not f or not f.endswith(".py"):
        return None
    return Path(f)


def _imported_names(path: Path, modname: str, is_pkg: bool) -> set[str]:
    """Module names imported anywhere in the file (function-local imports too,
    since kernels import their helpers lazily)."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    pkg = modname if is_pkg else modname.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                if node.level > 1:
                    base = base[: len(base) - node.level + 1]
                prefix = ".".join(base)
                mod = f"{prefix}.{node.module}" if node.module else prefix
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def source_files(module: str) -> dict[str, Path]:
    """The kernel's module plus the modules of its own top-level package that it
    imports, transitively: editing softmax.py leaves rmsnorm's set alone."""
    top = module.split(".")[0]
    seen: dict[str, Path] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = _module_file(name)
        if path is None:
            continue
        seen[name] = path
        for dep in _imported_names(path, name, path.name == "__init__.py"):
            if dep.split(".")[0] == top and dep not in seen and _module_file(dep) is not None:
                todo.append(dep)
    return seen


_FP_CACHE: dict[str, tuple[dict, tuple, str]] = {}


def _stat_sig(files: dict[str, Path]) -> tuple:
    sig: list[tuple] = []
    for name, path in sorted(files.items()):
        try:
            st = path.stat()
            sig.append((name, st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            sig.append((name, None))
    return tuple(sig)


class FingerprintMemo(Protocol):
    """A store of fingerprints that outlives the process (quack.cache.fpmemo).

    lookup: the fingerprint and files recorded for ``module`` whose file is ``origin``,
      or None when there is none or any recorded file or directory changed since (a
      miss; a damaged memo is a miss plus one warning). Never raises.
    record: remember a fingerprint computed from reading the files after ``started_ns``
      (time.time_ns()); skipped when a file may have changed since then. Never raises.
    """

    def lookup(self, module: str, origin: Path) -> tuple[dict[str, Path], str] | None: ...
    def record(self, module: str, files: dict[str, Path], fp: str, started_ns: int) -> None: ...


def _hash_files(files: dict[str, Path]) -> str:
    h = hashlib.sha256()
    for name, path in sorted(files.items()):
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def source_fingerprint(module: str, memo: FingerprintMemo | None = None) -> str:
    """SHA-256 (first 16 hex digits) over the names and bytes of source_files(module).

    Memoized per process but re-checked against the files' stat signature: a
    long-lived process (a notebook, a compile worker) whose kernel source is
    edited must see the new fingerprint, or it would look for (and a worker
    would publish) entries under different directories. ``memo`` carries it
    across processes (same stat check), so a fresh process parses nothing."""
    hit = _FP_CACHE.get(module)
    if hit is not None and _stat_sig(hit[0]) == hit[1]:
        return hit[2]
    origin = _module_file(module) if memo is not None else None
    if memo is not None and origin is not None:
        got = memo.lookup(module, origin)
        if got is not None:
            files, fp = got
            _FP_CACHE[module] = (files, _stat_sig(files), fp)
            return fp
    started = time.time_ns()  # before any read: an edit from here on is never memoized
    files = source_files(module)
    sig = _stat_sig(files)
    fp = _hash_files(files)
    _FP_CACHE[module] = (files, sig, fp)
    if memo is not None and origin is not None:
        memo.record(module, files, fp, started)
    return fp


source_fingerprint.cache_clear = _FP_CACHE.clear  # type: ignore[attr-defined]


def safe_component(text: str) -> str:
    """A path component made only of [A-Za-z0-9._+-], never '.' or '..'."""
    s = _SAFE.sub("_", text)[:100]
    return s if s.strip(".") else "_"
