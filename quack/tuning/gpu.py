"""Which GPU model's tuning-table rows apply (docs/tuning.md "Which GPU").

Build time and run time must agree, or a prebuilt object is never found: the model is the
``[tune] gpu`` setting (QUACK_TUNE_GPU) when set; else, in a process where CUDA is already
initialised (a run-time call with CUDA tensors), the current device's name, normalised;
else the model of the GPU this process would use, as NVML (nvidia-ml-py) names it without
initialising CUDA (``quack build`` on a GPU machine); else the table's default GPU for the
arch (a machine without a GPU or driver: set ``[tune] gpu`` there to build for another model).

Why NVML and not "CUDA initialised" alone: a build never initialises CUDA, so on an H100 it
keyed every configuration for the table's default model (H200) while the tests run after it,
with CUDA up, asked for the H100's: README command 2 on an H100 failed 179 tests with
KernelNotPrebuilt (session 21)."""

from __future__ import annotations

import os
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
        if w.split("-")[0] in _KNOWN:  # 'A100-SXM4-80GB' (torch's and NVML's A100 name)
            return w.split("-")[0]
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


def host_gpu() -> str | None:
    """The normalised model of the GPU this process would run on, read through NVML without
    initialising CUDA (so a build's parent stays CUDA-free for its forkserver); None where
    there is no NVML library, driver or visible GPU. Asked once a process."""
    global _HOST
    if _HOST is _UNASKED:
        _HOST = _nvml_model(os.environ.get("CUDA_VISIBLE_DEVICES"))
    return _HOST  # type: ignore[return-value]


_UNASKED = object()
_HOST: object = _UNASKED


def _nvml_model(visible: str | None) -> str | None:
    """The model of the first device ``visible`` (CUDA_VISIBLE_DEVICES's value) names: by
    index or UUID; every device when unset. All visible devices of one model (nearly every
    host) give that model whatever order CUDA enumerates them in (its default, fastest
    first, is not NVML's PCI order); a mixed host gives the first one named."""
    if not any(os.path.exists(p) for p in _DRIVER_PATHS):
        return None  # no NVIDIA driver here: pynvml's import alone is 13 ms a process
    try:
        import pynvml
    except ImportError:  # an install without nvidia-ml-py: the table's default applies
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no driver / library: a CPU-only machine
        return None
    try:
        entries = [e.strip() for e in visible.split(",")] if visible is not None else None
        if entries is not None and (not entries[0] or entries[0].startswith("-")):
            return None  # CUDA_VISIBLE_DEVICES="" or "-1": no GPU for this process
        names = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            names.append((str(i), _text(pynvml.nvmlDeviceGetUUID(h)), _text(pynvml.nvmlDeviceGetName(h))))
        if not names:
            return None
        if entries is None:
            chosen = names[0][2]
        else:
            first = entries[0]
            hit = [n for i, u, n in names if first == i or (first.startswith("GPU-") and u.startswith(first))]
            if not hit:  # MIG-... or an entry NVML does not list: one model on the host decides
                models = {normalise_gpu(n) for _, _, n in names}
                return models.pop() if len(models) == 1 else None
            chosen = hit[0]
        return normalise_gpu(chosen)
    except pynvml.NVMLError:  # a device that cannot be queried: the table's default applies
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


# Present wherever NVML can answer: the driver's procfs (Linux, containers given GPUs),
# its control device, WSL2's GPU device.
_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg")


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def gpu_choice() -> tuple[str | None, str]:
    """(model, why) as ``current_gpu`` decides it, for a build's report; model None: each
    table's ``default_gpu``."""
    from quack import settings

    s = settings.get()
    if s.tune_gpu:
        return s.tune_gpu, "[tune] gpu / QUACK_TUNE_GPU"
    cuda = detected_gpu()
    if cuda:
        return cuda, "this process's CUDA device"
    host = host_gpu()
    if host:
        return host, "this machine's GPU, through NVML"
    return None, "no GPU here"


def current_gpu(default: str | None) -> str | None:
    """The GPU model to look rows up for (see the module doc); ``default``: the table's."""
    from quack import settings

    s = settings.get()
    if s.tune_gpu:
        return s.tune_gpu
    return detected_gpu() or host_gpu() or default
