"""The layering rule import-linter cannot see: nothing in quack outside
quack.compile imports cutlass (or torch) at module level, so `quack --help`,
`quack cache stats` and loading a prebuilt kernel never pay for the compiler."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_CODE = r"""
import importlib, json, pkgutil, sys
import quack
names = sorted(m.name for m in pkgutil.walk_packages(quack.__path__, "quack.")
               if not m.name.startswith("quack.compile"))
for n in names:
    importlib.import_module(n)
print(json.dumps({"modules": names, "heavy": sorted(m for m in sys.modules
                  if m.split(".")[0] in ("cutlass", "torch", "tvm_ffi"))}))
"""


def test_no_module_outside_compile_imports_cutlass_or_torch(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", _CODE], capture_output=True, text=True, timeout=120, cwd=str(tmp_path)
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "quack.runtime.tiers" in out["modules"] and "quack.testing.plugin" in out["modules"]
    assert len(out["modules"]) >= 20
    assert out["heavy"] == [], out["heavy"]


# `quack --help` and the typer-free `quack cache stats` load only the modules they use
# (a slow --help, or a stats fast path that pulls in typer, is what this guards against).
_ROOT = Path(__file__).resolve().parents[1]
_LOADED = r"""
import contextlib, io, json, sys
from quack_build.cli.main import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main(sys.argv[1:])
    except SystemExit as e:
        assert not e.code, e.code
print(json.dumps(sorted(m for m in sys.modules if m.startswith("quack_build"))))
"""


@pytest.mark.parametrize(
    "args, loaded, not_loaded",
    [
        (
            ["--help"],
            {
                "quack_build.cli.app",
                "quack_build.cli.build",
                "quack_build.cli.cache",
                "quack_build.cli.bundle",
            },
            {"quack_build.verify.bundles", "quack_build.manifest.read", "quack_build.build.scheduler"},
        ),
        (
            ["cache", "stats", "--json"],
            {"quack_build.cachedir.stats", "quack_build.cachedir.walk"},
            {"quack_build.cli.app", "quack_build.cachedir.clean", "quack_build.cli.run"},
        ),
    ],
)
def test_help_and_stats_load_only_what_they_use(tmp_path, args, loaded, not_loaded):
    env = dict(os.environ, QUACK_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(_ROOT))
    r = subprocess.run(
        [sys.executable, "-c", _LOADED, *args],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    mods = set(json.loads(r.stdout.strip().splitlines()[-1]))
    assert loaded <= mods, loaded - mods
    assert not (not_loaded & mods), not_loaded & mods


def _cycles(graph, packages: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Pairs of modules that reach each other through imports (a strongly connected
    component of size > 1, listed whole). Lazy imports inside functions
    count too: a cycle that only a function-level import hides still couples the two."""
    mods = sorted(m for m in graph.modules if m.split(".")[0] in packages)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    counter = 0

    def edges(m: str) -> list[str]:
        # a package's __init__ importing its own submodules is how packages are made,
        # not a cycle between concerns: parent <-> child edges are left out.
        return sorted(
            d
            for d in graph.find_modules_directly_imported_by(m)
            if d.split(".")[0] in packages and not d.startswith(m + ".") and not m.startswith(d + ".")
        )

    for root in mods:  # iterative Tarjan (no recursion limit on a deep graph)
        if root in index:
            continue
        work = [(root, iter(edges(root)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        comps.append(sorted(comp))
            elif nxt not in index:
                index[nxt] = low[nxt] = counter
                counter += 1
                stack.append(nxt)
                on.add(nxt)
                work.append((nxt, iter(edges(nxt))))
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
    return [tuple(c) for c in comps]


def test_no_import_cycles_between_modules_of_quack_quack_build_and_quack_kernels():
    """jit <-> miss, pool <-> scope and scheduler <-> remote_sync each imported the other
    (issue 26): such a pair can only be read, tested and moved together. In the kernels a
    cycle also widens every source fingerprint: _ops <-> each family made every family's
    fingerprint cover all of quack_kernels (an edit to softmax.py moved every RMSNorm
    object). grimp reads imports inside functions too, and the kernels import their helpers
    there (the fingerprint walk follows them the same way)."""
    grimp = pytest.importorskip("grimp")  # import-linter's; the test extra brings it
    pkgs = ("quack", "quack_build", "quack_kernels")
    graph = grimp.build_graph(*pkgs, include_external_packages=False, exclude_type_checking_imports=True)
    assert _cycles(graph, pkgs) == []


def test_grimp_sees_the_kernels_function_local_imports():
    # The cycle check above guards quack_kernels only if grimp reads imports inside
    # functions: _ring_pipe imports its helpers nowhere else.
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("quack_kernels", include_external_packages=False)
    assert "quack_kernels._rowreduce" in graph.find_modules_directly_imported_by("quack_kernels._ring_pipe")


def test_the_cycle_check_finds_a_cycle():
    grimp = pytest.importorskip("grimp")
    graph = grimp.ImportGraph()
    for m in ("quack", "quack.a", "quack.b", "quack.c"):
        graph.add_module(m)
    graph.add_import(importer="quack.a", imported="quack.b")
    graph.add_import(importer="quack.b", imported="quack.a")
    graph.add_import(importer="quack.c", imported="quack")  # child -> parent: not a cycle
    graph.add_import(importer="quack", imported="quack.c")
    assert _cycles(graph, ("quack",)) == [("quack.a", "quack.b")]
