"""GPU model names as tuning-table rows spell them (``normalise_gpu``): a leaf module, so
the settings can normalise ``[tune] gpu`` without importing quack.tuning."""

from __future__ import annotations

import re

_KNOWN = ("H200", "H100", "H800", "H20", "GH200", "B200", "B100", "GB200", "A100", "L40S", "L4")


def normalise_gpu(name: str) -> str:
    """'NVIDIA H200' / 'NVIDIA H100 80GB HBM3' -> 'H200' / 'H100'; other names: their first
    model-like word, upper-case, so one model always gives one table key."""
    up = name.upper().replace("NVIDIA", " ")
    words = re.findall(r"[A-Z0-9][A-Z0-9_.-]*", up)
    for w in words:
        if w in _KNOWN:
            return w
        if w.split("-")[0] in _KNOWN:  # 'A100-SXM4-80GB' (torch's and NVML's A100 name)
            return w.split("-")[0]
    for w in words:
        if any(c.isdigit() for c in w):
            return w
    return words[0] if words else "UNKNOWN"
