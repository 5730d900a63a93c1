"""What a kernel's source fingerprint covers (keys.source_fingerprint), found without
importing anything.

Starting from the kernel's module (and the kernel's ``depends_on`` entries), every
module named by an import statement anywhere in a covered file (function-local imports
too: kernels import their helpers lazily) is classified:

* the Python standard library: not covered (the Python version is in the toolchain
  stamp);
* a module owned by an installed distribution (its file is listed in the RECORD of a
  ``*.dist-info`` of a search-path folder that holds it, as a regular ``pip install``
  leaves it): the distribution enters by name and version, its files are not read;
* anything else (the kernel's own package, a helper package beside it, a folder on
  ``PYTHONPATH``, an editable install's source tree): the file's bytes are hashed and
  its imports followed in turn;
* quack's own package when it is not an installed distribution (a development checkout):
  not covered; hashing it would move every object of the cache on any edit of quack.

Before this, only the kernel's own top-level package was followed: a helper package
beside it, or a vendored library, could be edited while the old object kept loading
(issue 24, item 3)."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import re
import site
import sys
from pathlib import Path

from quack.errors import KernelDependencyError

SELF = "quack"
# Launch-side frameworks: their tensors reach a kernel at call time only (compile functions
# are tensor-free: docs/writing-kernels.md), so their version never changes an object.
# Keyed on, torch would make every object a CI machine built (torch 2.13 here) a miss on a
# server that runs another torch (2.11 on the H200), and every installed bundle with it.
# A compile function that does use torch declares it: depends_on=["torch"].
LAUNCH_SIDE = frozenset({"torch"})
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ())) | frozenset(sys.builtin_module_names)
_MODNAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_SKIP_DIRS = ("__pycache__",)


@dataclasses.dataclass
class Coverage:
    """files: name -> file, hashed byte for byte (modules by their dotted name, files of a
    ``depends_on`` path as ``path:ENTRY[/REL]``, stable across checkouts).
    dists: distribution name -> (version, its METADATA file): by name and version.
    dirs: directories whose new entries could change the set beyond the files' own
    (a ``depends_on`` directory's subdirectories)."""

    files: dict[str, Path] = dataclasses.field(default_factory=dict)
    dists: dict[str, tuple[str, Path]] = dataclasses.field(default_factory=dict)
    dirs: set[Path] = dataclasses.field(default_factory=set)

    def watched(self) -> list[tuple[str, Path]]:
        """What a memo re-stats: every file hashed and every distribution's METADATA."""
        return sorted(self.files.items()) + sorted((f"dist:{n}", m) for n, (_, m) in self.dists.items())


# --- finding modules without importing them -------------------------------------


def spec(name: str):
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
        pspec = spec(parent)
        path = pspec.submodule_search_locations if pspec is not None else None
    if not path:
        return None
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is not None:
            s = find(name, list(path))
            if s is not None:
                return s
    return None


def module_file(name: str, *, py_only: bool = True) -> Path | None:
    """The file a module is loaded from (a .py, or with py_only=False any file: an
    extension module), or None (built in, frozen, a namespace package, not found)."""
    mod = sys.modules.get(name)
    f = getattr(mod, "__file__", None) if mod is not None else None
    if f is None:
        try:
            s = spec(name)
        except (ImportError, ValueError):
            return None
        f = s.origin if s is not None and s.has_location else None
    if not f or (py_only and not f.endswith(".py")) or not os.path.isfile(f):
        return None
    return Path(f)


def imported_names(path: Path, modname: str, is_pkg: bool) -> set[str]:
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


# --- installed distributions ----------------------------------------------------


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _headers(metadata: Path) -> tuple[str, str]:
    """(Name, Version) from METADATA's headers, read directly (the email parser costs
    milliseconds for a large METADATA)."""
    name = version = ""
    with open(metadata, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                break  # end of the headers
            if line.startswith("Name:"):
                name = line[5:].strip()
            elif line.startswith("Version:"):
                version = line[8:].strip()
    return re.sub(r"[-_.]+", "-", name).lower(), version


class _Owners:
    """Which installed distribution owns a file, for one walk (nothing outlives it: a
    long-lived process may see packages installed or upgraded)."""

    def __init__(self):
        roots = {os.path.abspath(p or os.curdir) for p in sys.path}
        try:
            roots.update(site.getsitepackages())
            roots.add(site.getusersitepackages())
        except AttributeError:  # a virtualenv's old site.py
            pass
        import sysconfig  # here: a memo hit never walks, and never pays this import

        roots.update(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
        self.roots = sorted((os.path.abspath(r) for r in roots), key=len, reverse=True)  # deepest first
        self._infos: dict[str, list[str]] = {}
        self._records: dict[str, str] = {}

    def _dist_infos(self, root: str) -> list[str]:
        got = self._infos.get(root)
        if got is None:
            try:
                got = sorted(e.name for e in os.scandir(root) if e.name.endswith(".dist-info") and e.is_dir())
            except OSError:
                got = []
            self._infos[root] = got
        return got

    def _lists(self, info: str, rel: str) -> bool:
        """Does the dist-info's RECORD list ``rel``? (A substring search of the text: a
        set of torch's 15k lines cost ~10 ms.)"""
        text = self._records.get(info)
        if text is None:
            try:
                with open(os.path.join(info, "RECORD"), encoding="utf-8", errors="replace") as f:
                    text = "\n" + f.read()
            except OSError:
                text = ""
            self._records[info] = text
        return f"\n{rel}," in text

    def owner(self, path: Path) -> tuple[str, str, Path] | None:
        """(name, version, METADATA) of the distribution whose RECORD lists ``path``."""
        p = os.path.abspath(path)
        for root in self.roots:
            if not p.startswith(root + os.sep):
                continue
            infos = self._dist_infos(root)
            if not infos:
                continue
            rel = os.path.relpath(p, root).replace(os.sep, "/")
            first = _norm(rel.split("/", 1)[0].split(".", 1)[0])
            # Likely owners first (torch -> torch-*.dist-info, nvidia_cutlass_dsl/... ->
            # nvidia_cutlass_dsl_libs_core-*): each RECORD read is a file read.
            ranked = sorted(infos, key=lambda i: not _norm(i.rsplit("-", 1)[0]).startswith(first))
            for info in ranked:
                full = os.path.join(root, info)
                if self._lists(full, rel):
                    meta = Path(full) / "METADATA"
                    name, version = _headers(meta)
                    return name or info.rsplit("-", 1)[0], version, meta
        return None


# --- depends_on -----------------------------------------------------------------


def check_entries(kernel: str, entries) -> tuple[str, ...]:
    """The entries' form (resolving them is ``resolve``'s): a list of strings, each a
    dotted module name or a path containing '/'. Raises KernelDependencyError."""
    if isinstance(entries, (str, bytes)) or not isinstance(entries, (list, tuple)):
        raise KernelDependencyError(
            kernel, repr(entries), "depends_on must be a list of strings (module names or paths)"
        )
    out: list[str] = []
    for e in entries:
        if not isinstance(e, str) or not e or "\0" in e:
            raise KernelDependencyError(kernel, repr(e), "each entry must be a non-empty string")
        if "/" not in e and os.sep not in e and not _MODNAME.fullmatch(e):
            raise KernelDependencyError(
                kernel,
                e,
                "neither a module name (dotted identifiers, e.g. 'qk.gemm') nor a path "
                "(containing '/', e.g. './tables/' or '../qk/gemm.py', relative to the kernel's module)",
            )
        if e not in out:
            out.append(e)
    return tuple(out)


def _entry_path(kernel: str, entry: str, base: Path) -> Path:
    p = Path(os.path.normpath(entry if os.path.isabs(entry) else base / entry))
    if not (p.is_file() or p.is_dir()):
        raise KernelDependencyError(kernel, entry, f"no such file or directory: {p}")
    return p


def _entry_modules(kernel: str, entry: str) -> list[str]:
    """The module and, for a package, every module under it (without importing them)."""
    try:
        s = spec(entry)
    except (ImportError, ValueError) as e:
        raise KernelDependencyError(kernel, entry, f"cannot be looked up: {e}") from None
    if s is None:
        raise KernelDependencyError(kernel, entry, "no module of this name is found on the search path")
    names = [entry]
    for loc in s.submodule_search_locations or ():
        for dirpath, dirnames, filenames in os.walk(loc):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
            rel = os.path.relpath(dirpath, loc)
            prefix = entry if rel == "." else entry + "." + rel.replace(os.sep, ".")
            names.extend(f"{prefix}.{f[:-3]}" for f in sorted(filenames) if f.endswith(".py"))
    return names


def resolve(kernel: str, entries: tuple[str, ...], base: Path) -> None:
    """Check that every entry exists (at registration: a typo fails at import, naming the
    kernel and the entry, instead of at the first call)."""
    for e in entries:
        if "/" in e or os.sep in e:
            _entry_path(kernel, e, base)
        else:
            _entry_modules(kernel, e)


def _add_path(cov: Coverage, kernel: str, entry: str, base: Path) -> None:
    p = _entry_path(kernel, entry, base)
    if p.is_file():
        cov.files[f"path:{entry}"] = p
        return
    for dirpath, dirnames, filenames in os.walk(p):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        cov.dirs.add(Path(dirpath))
        for f in sorted(filenames):
            fp = Path(dirpath) / f
            if f.startswith(".") or f.endswith(".pyc") or not fp.is_file():
                continue
            cov.files[f"path:{entry}/{fp.relative_to(p).as_posix()}"] = fp


# --- the walk -------------------------------------------------------------------


def coverage(module: str, depends_on: tuple[str, ...] = (), *, kernel: str = "") -> Coverage:
    """Every file and distribution the fingerprint of ``module`` (with ``depends_on``)
    covers: see the module's docstring."""
    cov = Coverage()
    own = module.split(".")[0]
    owners = _Owners()
    tops: dict[str, str] = {}  # top-level name -> "dist" | "skip" | "files" | "each"
    todo = [module]
    origin = module_file(module)
    base = origin.parent if origin is not None else Path.cwd()
    declared: set[str] = set()  # top-level names depends_on names: never LAUNCH_SIDE-skipped
    for e in depends_on:
        if "/" in e or os.sep in e:
            _add_path(cov, kernel, e, base)
        else:
            todo.extend(_entry_modules(kernel, e))
            declared.add(e.split(".")[0])
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        top = name.split(".")[0]
        if top != own and (top in _STDLIB or (top in LAUNCH_SIDE and top not in declared)):
            continue
        kind = tops.get(top)
        if kind is None:
            kind = tops[top] = "files" if top == own else _classify_top(top, owners, cov)
        if kind in ("dist", "skip"):
            continue
        path = module_file(name, py_only=False)
        if path is None:
            continue
        if kind == "each":  # a namespace package: its parts may come from several places
            got = owners.owner(path)
            if got is not None:
                cov.dists[got[0]] = (got[1], got[2])
                continue
        cov.files[name] = path
        parent = name.rpartition(".")[0]
        if parent:  # importing a.b runs a/__init__.py first
            todo.append(parent)
        if path.suffix == ".py":
            for dep in imported_names(path, name, path.name == "__init__.py"):
                if dep and dep not in seen:
                    todo.append(dep)
    return cov


def _classify_top(top: str, owners: _Owners, cov: Coverage) -> str:
    f = module_file(top, py_only=False)
    if f is None:
        try:
            s = spec(top)
        except (ImportError, ValueError):
            return "skip"
        # A namespace package (no file of its own): each part is classified alone.
        return "each" if s is not None and s.submodule_search_locations else "skip"
    got = owners.owner(f)
    if got is not None:
        cov.dists[got[0]] = (got[1], got[2])
        return "dist"
    return "skip" if top == SELF else "files"
