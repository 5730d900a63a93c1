"""The usage journal: one JSON line per (process, key used), appended at exit
to <cache>/journal.jsonl. ``quack cache stats`` and ``quack prewarm`` read it."""

from __future__ import annotations

import json
import time
from pathlib import Path

from quack.safejson import safe_loads

JOURNAL = "journal.jsonl"

# The fields the readers use (quack_build.cachedir.stats, quack_build.build.prewarm) and
# the types they rely on; a record with one of another type is skipped like a torn line.
# One line with a "t" of "x" crashed `quack cache stats` and `prewarm` with a TypeError.
_NUMBER = (int, float)
_FIELDS: dict[str, type | tuple[type, ...]] = {
    "t": _NUMBER,
    "kernel": str,
    "key": str,
    "arch": str,
    "params": dict,
    "where": str,
    "hits": int,
    "misses": int,
    "compiles": int,
    "waits": int,
    "compile_s": _NUMBER,
    "derived": bool,  # the configuration was the tuning table's choice (quack prewarm)
    "problems": list,  # a sized kernel's call sizes, most used first (quack prewarm)
}


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
        fsutil.append_regular(path, lines.encode())  # a planted FIFO is refused, never waited on
    except OSError:
        pass  # a read-only or full cache must not fail the user's process at exit


def _well_formed(r: object) -> bool:
    if not isinstance(r, dict):
        return False
    for name, types in _FIELDS.items():
        v = r.get(name)
        if v is None:
            continue
        if types is bool:
            if not isinstance(v, bool):
                return False
        # bool is an int to isinstance, never a count or a time here
        elif not isinstance(v, types) or isinstance(v, bool):
            return False
    return True


def read(root: Path, since: float = 0.0) -> list[dict]:
    """The journal's well-formed records from ``since`` on. A journal that is missing
    reads as empty; one that can't be read, or is not a regular file (planted: never
    followed, a FIFO never waited on), reads as empty with one CacheWarning."""
    from quack.cache import fsutil

    path = Path(root) / JOURNAL
    out: list[dict] = []
    for line in fsutil.read_lines_regular(
        path, "the usage journal", f"journal:{path}", lost="was not read in full"
    ):
        try:
            r = safe_loads(line)
        except ValueError:
            continue  # a torn line from a crash: skip it
        if _well_formed(r) and r.get("t", 0) >= since:
            out.append(r)
    return out


def now() -> float:
    return time.time()
