"""The modules of ``[build] preload`` (QUACK_PRELOAD): imported once in the compile
forkserver, after cutlass, so every worker forked from it starts with a heavy library
(a vendored GEMM package, torch) already imported instead of paying it on its first key
(issue 27: 22-24 s first keys against a 4.3 s median). Ray actors import them when they
start; spawn / fork workers (and QUACK_NO_PRELOAD) on their first task.

A module that fails to import is recorded, not raised, in the forkserver (it has no one
to tell); every task a worker forked from it gets then fails with PreloadError naming the
module and the quack.toml (or variable) that set it, before anything compiles. Before
that, ``quack build`` calls :func:`check` in its own process: a module that cannot be
found stops the build before any worker starts (a worker finds out only after the
forkserver's cutlass import and warm-up compile, seconds later, and per key)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time
import traceback

from quack.errors import PreloadError

# What this process imported: modules done, seconds spent, the first failure. A forked
# worker inherits the forkserver's record.
_done: set[str] = set()
_seconds = 0.0
_error: PreloadError | None = None


def run(modules, source: str = "") -> None:
    """Import ``modules`` in order (those not done yet); record the time and the first
    failure (later modules are not tried: they may depend on it). Never raises."""
    global _seconds, _error
    if _error is not None:
        return
    t0 = time.perf_counter()
    try:
        for mod in modules:
            if mod in _done:
                continue
            try:
                importlib.import_module(mod)
            except BaseException as e:  # noqa: BLE001 - SystemExit / KeyboardInterrupt in an import too
                detail = "".join(traceback.format_exception(type(e), e, e.__traceback__))
                _error = PreloadError(mod, source, detail)
                return
            _done.add(mod)
    finally:
        _seconds += time.perf_counter() - t0


def ensure(modules, source: str = "") -> float:
    """Before a task: import what is not imported yet; raise the recorded PreloadError if
    any module failed (here or in the forkserver). Returns the seconds spent on preload
    imports in this process's line (the forkserver's, for a forked worker)."""
    run(modules, source)
    if _error is not None:
        raise _error
    return _seconds


def seconds() -> float:
    return _seconds


# The confirming child's code: the real find_spec (it runs the parent packages' __init__,
# which the build process must not: a vendored library's imports cutlass or torch).
_CONFIRM = """
import importlib.util, json, sys, traceback
sys.path[:] = json.loads(sys.argv[2])
try:
    found = importlib.util.find_spec(sys.argv[1]) is not None
    msg = "" if found else "ModuleNotFoundError: No module named %r" % sys.argv[1]
except ModuleNotFoundError as e:  # a parent missing: its one line, not importlib's frames
    msg = "ModuleNotFoundError: %s" % e
except BaseException as e:  # a parent package's __init__ failed: where, in its traceback
    msg = "".join(traceback.format_exception(type(e), e, e.__traceback__))
print(json.dumps(msg))
"""
CONFIRM_TIMEOUT_S = 120.0


def check(modules, source: str = "") -> None:
    """Raise PreloadError (``checked=True``) for the first of ``modules`` that cannot be
    imported from this process's ``sys.path`` (a worker's: the forkserver inherits it),
    without running any module: each is looked up through ``sys.meta_path`` as the import
    system would, parents by their spec's search locations. A module not found that way
    is confirmed by the real ``importlib.util.find_spec`` in a child process before it is
    an error, so a package that extends its ``__path__`` when it runs (pkgutil-style
    namespaces) is never refused here. A module that is found but raises when imported is
    left to the worker (it reports PreloadError for it before compiling)."""
    for mod in modules:
        if _found_statically(mod):
            continue
        detail = _confirm(mod)
        if detail:
            raise PreloadError(mod, source, detail, checked=True)


def _found_statically(name: str) -> bool:
    parts = name.split(".")
    search = None  # top level: sys.path
    try:
        for i in range(1, len(parts) + 1):
            sub = ".".join(parts[:i])
            loaded = sys.modules.get(sub)
            spec = getattr(loaded, "__spec__", None) if loaded is not None else None
            if spec is None:
                spec = next(
                    (
                        s
                        for f in sys.meta_path
                        if hasattr(f, "find_spec") and (s := f.find_spec(sub, search)) is not None
                    ),
                    None,
                )
            if spec is None:
                return False
            if i < len(parts):
                locs = (
                    getattr(loaded, "__path__", None)
                    if loaded is not None
                    else spec.submodule_search_locations
                )
                if not locs:
                    return False
                search = list(locs)
    except Exception:  # noqa: BLE001 - a finder's own error: let the child decide
        return False
    return True


def _confirm(name: str) -> str:
    """'' when the real find_spec finds ``name`` in a child process (or the child cannot
    say in time: the worker reports it then); else the error text."""
    try:
        r = subprocess.run(
            [sys.executable, "-c", _CONFIRM, name, json.dumps(sys.path)],
            capture_output=True,
            text=True,
            timeout=CONFIRM_TIMEOUT_S,
        )
        return str(json.loads(r.stdout.strip().splitlines()[-1]))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return ""
