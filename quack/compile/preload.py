"""The modules of ``[build] preload`` (QUACK_PRELOAD): imported once in the compile
forkserver, after cutlass, so every worker forked from it starts with a heavy library
(a vendored GEMM package, torch) already imported instead of paying it on its first key
(issue 27: 22-24 s first keys against a 4.3 s median). Ray actors import them when they
start; spawn / fork workers (and QUACK_NO_PRELOAD) on their first task.

A module that fails to import is recorded, not raised, in the forkserver (it has no one
to tell); every task a worker forked from it gets then fails with PreloadError naming the
module and the quack.toml (or variable) that set it, before anything compiles."""

from __future__ import annotations

import importlib
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
