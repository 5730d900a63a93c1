"""A build's failed keys: the one line shown for each (the compiler's first error) and the
build log that holds their full text (``<cache>/logs/build-<time>-<pid>.log``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from quack.errors import CacheError, CompileTimeout
from quack_build.build.executors.base import WorkersLost
from quack_build.build.results import Task


def cause(err) -> str:
    """What failed a key (``Task.failure``): "store" when the cache could not take an object
    that compiled (disk full, read-only: a CacheError), "lock" when another process held
    the key's lock past lock_timeout, "no_worker" when the executor lost every worker
    before it (never compiled: WorkersLost), else "compile" (held past compile_timeout,
    the smaller, is one: that process's compile of it ran that long; the error says so)."""
    if isinstance(err, CacheError):
        return "store"
    if isinstance(err, WorkersLost):
        return "no_worker"
    if isinstance(err, CompileTimeout) and err.external and getattr(err, "setting", "") != "compile_timeout":
        return "lock"
    return "compile"


def first_line(err) -> str:
    """The failure's one line: the compiler's own first error (not CuTe's closing advice,
    no ANSI codes); the full text goes to the build log."""
    from quack.compile.diagnostics import first_error_line

    if err is None:
        return "failed"
    detail = getattr(err, "detail", None)
    if detail:
        return first_error_line(str(detail))
    return first_error_line(f"{type(err).__name__}: {err}")


def log_with_content(log_path: Path | None) -> str:
    """The build log's path when it holds something, else "": with the log in a full cache
    its writes fail, and the summary pointed at a 0-byte "full compiler output"."""
    try:
        return str(log_path) if log_path is not None and log_path.stat().st_size > 0 else ""
    except OSError:
        return ""


def log_failure(log_dir: Path | None, log_path: Path | None, t: Task) -> Path | None:
    """Append a failed compile's full error text to this build's log file."""
    if log_dir is None:
        return log_path
    try:
        if log_path is None:
            log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            log_path = log_dir / time.strftime(f"build-%Y%m%d-%H%M%S-{os.getpid()}.log")
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(f"=== {t.cfg.label()}  key {t.cfg.key}\n--- {t.error}\n{t.detail}\n\n")
    except OSError:
        return log_path
    return log_path
