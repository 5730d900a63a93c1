"""Sizes and ages as the CLI reads and prints them: ``--max-size 5G``, ``--older-than 30d``
(``parse_size``, ``parse_age``) and byte counts for people (``human_bytes``)."""

from __future__ import annotations

import re


def parse_size(text: str) -> int:
    """'5G', '500M', '1.5GiB', '1024' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*", text.lower())
    if not m:
        raise ValueError(f"{text!r} is not a size; use e.g. 500M, 5G, 1.5T or a byte count")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2)]
    return int(float(m.group(1)) * mult)


def parse_age(text: str) -> float:
    """'30d', '12h', '45m', '90s', '2w' -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text.lower())
    if not m:
        raise ValueError(f"{text!r} is not an age; use e.g. 30d, 12h, 45m, 2w")
    mult = {"": 86400, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}[m.group(2)]
    return float(m.group(1)) * mult


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover
