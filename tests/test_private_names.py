"""House style: modules talk through public, typed names. Read from the sources (ast, no
imports, CPU only), two rules that used to be broken and must not come back:

* no module of quack, quack_build or quack_kernels uses another module's ``_private``
  name (``from m import _x``, ``m._x`` through an imported module or name), and a
  ``_private`` module is imported only from inside its own package;
* a name is imported from the module that defines it, never through a module that merely
  imported it (a move shim: ``quack.cache.store`` re-exported ``EntryRef`` and friends).
  A package's ``__init__`` is its public face and may re-export.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"quack": "quack", "quack_build": "quack_build", "quack_kernels": "kernels"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules(root: Path, packages: dict[str, str]) -> dict[str, Path]:
    mods = {}
    for pkg, folder in packages.items():
        base = root / folder
        for f in sorted(base.rglob("*.py")):
            parts = [pkg, *f.relative_to(base).with_suffix("").parts]
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _source_of(node: ast.ImportFrom, here: str, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = (here if is_pkg else here.rpartition(".")[0]).split(".")
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _private_module_outside(path: str, here: str) -> str | None:
    """The first ``_private`` segment of module ``path`` that ``here`` is not inside."""
    segs = path.split(".")
    for i, seg in enumerate(segs):
        if _private(seg) and not here.startswith(".".join(segs[:i]) + "."):
            return ".".join(segs[: i + 1])
    return None


def private_uses(root: Path, packages: dict[str, str]) -> list[str]:
    mods = _modules(root, packages)
    found = []
    for here, f in mods.items():
        tree = ast.parse(f.read_text(), str(f))
        is_pkg = f.name == "__init__.py"
        where = f"{f.relative_to(root)}"
        bound: dict[str, str] = {}  # local name -> the dotted name of what it is in our packages
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] not in packages:
                        continue
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                    bad = _private_module_outside(a.name, here)
                    if bad:
                        found.append(f"{where}:{node.lineno}: imports the private module {bad}")
            elif isinstance(node, ast.ImportFrom):
                src = _source_of(node, here, is_pkg)
                if src.split(".")[0] not in packages:
                    continue
                bad = _private_module_outside(src, here)
                if bad:
                    found.append(f"{where}:{node.lineno}: imports from the private module {bad}")
                for a in node.names:
                    full = f"{src}.{a.name}"
                    bound[a.asname or a.name] = full
                    if full in mods:  # a submodule: private only outside its package
                        bad = _private_module_outside(full, here)
                        if bad:
                            found.append(f"{where}:{node.lineno}: imports the private module {bad}")
                    elif _private(a.name) and src != here:
                        found.append(f"{where}:{node.lineno}: from {src} import {a.name}")
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            chain, v = [], node.value
            while isinstance(v, ast.Attribute):
                chain.append(v.attr)
                v = v.value
            if isinstance(v, ast.Name) and v.id in bound:
                owner = ".".join([bound[v.id], *reversed(chain)])
                if owner != here and not (owner in mods and here.startswith(owner + ".")):
                    found.append(f"{where}:{node.lineno}: {owner}.{node.attr}")
    return found


def _defined(f: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(f.read_text(), str(f))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def reexport_uses(root: Path, packages: dict[str, str], files: list[Path]) -> list[str]:
    mods = _modules(root, packages)
    found = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if not (isinstance(node, ast.ImportFrom) and node.module and not node.level):
                continue
            src = mods.get(node.module)
            if src is None or src.name == "__init__.py":
                continue
            defined = _defined(src)
            for a in node.names:
                if a.name not in defined and f"{node.module}.{a.name}" not in mods:
                    found.append(f"{f.relative_to(root)}:{node.lineno}: {node.module} re-exports {a.name}")
    return found


def _tracked_python() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [ROOT / p for p in out.stdout.split() if (ROOT / p).exists()]


def test_no_module_uses_another_modules_private_name():
    assert private_uses(ROOT, PACKAGES) == []


def test_names_are_imported_from_the_module_that_defines_them():
    files = _tracked_python()
    assert len(files) > 100
    assert reexport_uses(ROOT, PACKAGES, files) == []


def test_the_scans_find_what_they_forbid(tmp_path):
    # The two rules' own check: a tree that breaks each in every form is reported line by line.
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from p.b import Thing\n_x = 1\n")
    (pkg / "b.py").write_text(
        "class Thing:\n    _k = 1\n_y = 2\nfrom p.a import _x\nfrom p import a\nz = a._x\n"
        "from p.sub import _hidden\nfrom p.sub._hidden import f\nw = Thing._k\n"
    )
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "_hidden.py").write_text("def f():\n    pass\n")
    (pkg / "sub" / "ok.py").write_text("from p.sub import _hidden\nfrom p.sub._hidden import f\n")
    (pkg / "c.py").write_text("from p.a import Thing\nv = Thing._k\n")
    assert private_uses(tmp_path, {"p": "p"}) == [
        "p/b.py:4: from p.a import _x",
        "p/b.py:7: imports the private module p.sub._hidden",
        "p/b.py:8: imports from the private module p.sub._hidden",
        "p/b.py:6: p.a._x",
        "p/c.py:2: p.a.Thing._k",
    ]
    assert reexport_uses(tmp_path, {"p": "p"}, [pkg / "c.py", pkg / "b.py"]) == [
        "p/c.py:1: p.a re-exports Thing",
    ]
