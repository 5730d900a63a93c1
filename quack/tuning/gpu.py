"""Which GPU model's tuning-table rows apply (docs/tuning.md "Which GPU").

Build time and run time must agree, or a prebuilt object is never found: the model is the
``[tune] gpu`` setting (QUACK_TUNE_GPU) when set; else, in a process where CUDA is already
initialised (a run-time call with CUDA tensors), the detected device's name, normalised;
else the table's default GPU for the arch (``quack build`` on a CPU-only machine)."""

from __future__ import annotations

import re
import sys

_KNOWN = ("H200", "H100", "H800", "H20", "GH200", "B200", "B100", "GB200", "A100", "L40S", "L4")


def normalise_gpu(name: str) -> str:
    """'NVIDIA H200' / 'NVIDIA H100 80GB HBM3' -> 'H200' / 'H100'; other names: their first
    model-like word, upper-case, so one model always gives one table key."""
    up = name.upper().replace("NVIDIA", " ")
    words = re.findall(r"[A-Z0-9][A-Z0-9_.-]*", up)
    for w in words:
        if w in _KNOWN:
            return w
    for w in words:
        if any(c.isdigit() for c in w):
            return w
    return words[0] if words else "UNKNOWN"


def detected_gpu() -> str | None:
    """The current CUDA device's model when torch has CUDA initialised here, else None
    (never initialises CUDA: a build on a GPU machine keys like one without)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        dev = torch.cuda.current_device()
        name = _NAMES.get(dev)
        if name is None:  # a device's model does not change: asked once (every op call asks)
            name = _NAMES[dev] = normalise_gpu(torch.cuda.get_device_name(dev))
        return name
    except Exception:  # noqa: BLE001 - no usable CUDA: the setting / the table decide
        return None


_NAMES: dict[int, str] = {}  # CUDA device index -> its normalised model


def current_gpu(default: str | None) -> str | None:
    """The GPU model to look rows up for (see the module doc); ``default``: the table's."""
    from quack import settings

    s = settings.get()
    if s.tune_gpu:
        return s.tune_gpu
    return detected_gpu() or default
