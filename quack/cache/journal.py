"""The usage journal: one JSON line per (process, key used), appended at exit
to <cache>/journal.jsonl. ``quack cache stats`` and ``quack prewarm`` read it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

JOURNAL = "journal.jsonl"


def append(root: Path, records: list[dict]) -> None:
    if not records:
        return
    lines = "".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in records)
    path = Path(root) / JOURNAL
    try:
        if not Path(root).is_dir():
            return
        from quack.cache import fsutil

        fsutil.check_root(Path(root))  # never through a symlinked / unsafe root (CacheError)
        # O_APPEND writes land whole at the end even with several writers.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, lines.encode())
        finally:
            os.close(fd)
    except OSError:
        pass  # a read-only or full cache must not fail the user's process at exit


def read(root: Path, since: float = 0.0) -> list[dict]:
    path = Path(root) / JOURNAL
    out = []
    try:
        with open(path, "rb") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue  # a torn line from a crash: skip it
                if isinstance(r, dict) and r.get("t", 0) >= since:
                    out.append(r)
    except OSError:
        pass
    return out


def now() -> float:
    return time.time()
