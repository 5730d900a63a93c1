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
import sys

# the name rule lives in a leaf module: settings parse [tune] gpu with it, and importing
# this package for it cost every process that sets QUACK_TUNE_GPU 8 ms (quack.tuning's
# table and config modules)
from quack.gpumodel import normalise_gpu


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
    NVML cannot tell (see ``host_gpu_why``). Asked once a process for each value of
    CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER (a launcher may set them after the first ask)."""
    return host_gpu_why()[0]


def host_gpu_why() -> tuple[str | None, str]:
    """(model, why): why names the source, or why there is no answer ("no NVIDIA driver",
    "mixed GPU models ...")."""
    env = (os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("CUDA_DEVICE_ORDER"))
    got = _HOST.get(env)
    if got is None:
        got = _HOST[env] = _asked_within(NVML_TIMEOUT_S, env)
    return got


# NVML is a blocking driver call with no time-out of its own: on a wedged driver, `quack
# build` would hang before building anything, deaf to Ctrl-C. Asked in a daemon thread; a
# question not answered in time is no answer (and is not asked again by this process).
NVML_TIMEOUT_S = 10.0


def _asked_within(timeout: float, env: tuple) -> tuple[str | None, str]:
    import threading

    box: list[tuple[str | None, str]] = []
    t = threading.Thread(target=lambda: box.append(_nvml_model(*env)), name="quack-nvml", daemon=True)
    t.start()
    t.join(timeout)  # interruptible: Ctrl-C ends the wait
    if box:
        return box[0]
    return None, f"NVML did not answer within {timeout:g} s: set [tune] gpu / QUACK_TUNE_GPU"


_HOST: dict[tuple, tuple[str | None, str]] = {}
_NVML = "this machine's GPU, through NVML"


def _nvml_model(visible: str | None, order: str | None = None) -> tuple[str | None, str]:
    """The model of the device CUDA would make device 0 under ``visible``
    (CUDA_VISIBLE_DEVICES) and ``order`` (CUDA_DEVICE_ORDER), and why.

    Every queryable device of one model (nearly every host) gives that model, whichever
    one CUDA picks; a device NVML cannot query (lost, no permission) is left out, not a
    reason to give up. On a host of mixed models the device is named by UUID, or by index
    only under CUDA_DEVICE_ORDER=PCI_BUS_ID (NVML's order): CUDA's default order, fastest
    first, is not NVML's, so an index there names an unknown device and nothing is guessed."""
    if not any(os.path.exists(p) for p in _DRIVER_PATHS):
        return None, "no NVIDIA driver here"  # and no pynvml import: 13 ms a process
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed: set [tune] gpu / QUACK_TUNE_GPU"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return None, f"NVML did not start ({e})"
    try:
        entries = [e.strip() for e in visible.split(",")] if visible is not None else ["0"]
        if not entries[0] or entries[0].startswith("-"):
            return None, f"no GPU visible (CUDA_VISIBLE_DEVICES={visible!r})"
        devices = _devices(pynvml)  # (index, uuid, model); unqueryable ones left out
        models = sorted({m for _, _, m in devices})
        if len(models) == 1:
            return models[0], _NVML
        if not models:
            return None, "NVML could query no GPU"
        first = entries[0]
        if first.upper().startswith("GPU-"):
            hit = [m for _, u, m in devices if u.upper().startswith(first.upper())]
        elif first.isdigit() and (order or "").upper() == "PCI_BUS_ID":
            hit = [m for i, _, m in devices if i == int(first)]
        else:
            hit = []
        if hit:
            return hit[0], _NVML
        return None, f"mixed GPU models ({', '.join(models)}): set [tune] gpu / QUACK_TUNE_GPU"
    except pynvml.NVMLError as e:
        return None, f"NVML failed ({e})"
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _devices(pynvml) -> list[tuple[int, str, str]]:
    out = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            out.append(
                (i, _text(pynvml.nvmlDeviceGetUUID(h)), normalise_gpu(_text(pynvml.nvmlDeviceGetName(h))))
            )
        except pynvml.NVMLError:  # a lost GPU, one this job may not query: the others decide
            continue
    return out


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
    return host_gpu_why()


def current_gpu(default: str | None) -> str | None:
    """The GPU model to look rows up for (see the module doc); ``default``: the table's."""
    from quack import settings

    s = settings.get()
    if s.tune_gpu:
        return s.tune_gpu
    return detected_gpu() or host_gpu() or default
