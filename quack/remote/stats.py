"""Remote-tier counters: one process's, and the totals ``quack cache stats``
reads from ``<cache>/remote-stats.jsonl`` (one line appended per process that
used a remote). Light on purpose: no network or crypto imports, so stats stay
fast."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

from quack.safejson import safe_loads

STATS_FILE = "remote-stats.jsonl"


@dataclasses.dataclass
class Counters:
    hits: int = 0
    misses: int = 0
    errors: int = 0
    rejected: int = 0
    pushed: int = 0
    push_exists: int = 0
    push_failed: int = 0
    replaced: int = 0  # pushes that replaced a refused object at the name (compare-and-swap)
    # A writer's pushes not tried: pushing was switched off (the remote full, a write
    # denied) or the remote was off (unreachable) after an earlier failure in the process.
    push_skipped: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    rejected_by_reason: Counter = dataclasses.field(default_factory=Counter)
    replaced_by_reason: Counter = dataclasses.field(default_factory=Counter)  # why it was refused

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        for k in _BY_REASON:
            d[k] = dict(getattr(self, k))
        return d

    def any(self) -> bool:
        return any(v for k, v in self.to_json().items() if k not in _BY_REASON)


_BY_REASON = ("rejected_by_reason", "replaced_by_reason")


def append_line(root: Path, line: str) -> None:
    """Append one process's line to ``<root>/remote-stats.jsonl``. Raises OSError
    (EINVAL for something that is not a regular file: a planted FIFO is refused, never
    waited on; quack.cache.fsutil.append_regular)."""
    from quack.cache import fsutil

    fsutil.append_regular(Path(root) / STATS_FILE, line.encode())


def read_stats(root: Path) -> dict:
    """Totals of ``remote-stats.jsonl``: per URL and overall."""
    total = Counters()
    per_url: dict[str, Counters] = {}
    from quack.cache import fsutil

    path = Path(root) / STATS_FILE
    # Regular file only, never blocking: a FIFO planted here hung `quack cache stats`.
    lines = fsutil.read_lines_regular(path, "the remote stats file", f"remote-stats:{path}")
    fields = [f.name for f in dataclasses.fields(Counters) if f.name not in _BY_REASON]
    for line in lines:
        try:
            r = safe_loads(line)
        except ValueError:
            continue  # a torn line
        if not isinstance(r, dict):
            continue
        for c in (total, per_url.setdefault(str(r.get("url")), Counters())):
            for k in fields:
                v = r.get(k)
                if isinstance(v, int):
                    setattr(c, k, getattr(c, k) + v)
            for field in _BY_REASON:
                reasons = r.get(field)
                if isinstance(reasons, dict):
                    getattr(c, field).update({str(k): v for k, v in reasons.items() if isinstance(v, int)})
    return {"total": total.to_json(), "per_url": {u: c.to_json() for u, c in per_url.items()}}
