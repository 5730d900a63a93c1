"""GPU pinning of xdist workers and the GPU-wide lock of the OOM retry.

Each xdist worker gets one GPU, round-robin over the visible GPUs: with
workers <= GPUs every worker has its own; with more, the counts per GPU differ
by at most one (no GPU holds two workers while another holds none). The pin is
made in ``pytest_load_initial_conftests`` (before any conftest can initialise
CUDA), never when the plugin is merely imported."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import MutableMapping


@dataclasses.dataclass(frozen=True)
class Pin:
    gpu: str  # the CUDA_VISIBLE_DEVICES value given to this worker
    shared: bool  # more workers than GPUs: others share it (tests take the GPU lock)


#: This process's pin (set by ``pin_worker``), read by the runner.
current: Pin | None = None


def visible_gpus(env: MutableMapping[str, str] | None = None) -> list[str]:
    """The GPUs a process may use, found without initialising CUDA: the
    CUDA_VISIBLE_DEVICES list if set, else one per /dev/nvidiaN."""
    env = os.environ if env is None else env
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return [g.strip() for g in cvd.split(",") if g.strip() and g.strip() != "-1"]
    try:
        n = sum(1 for f in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", f))
    except OSError:
        n = 0
    return [str(i) for i in range(n)]


def worker_index(worker_id: str) -> int:
    """gw3 -> 3 (xdist's worker ids)."""
    m = re.search(r"(\d+)$", worker_id)
    return int(m.group(1)) if m else 0


def assign(index: int, workers: int, gpus: list[str]) -> Pin:
    """Worker ``index`` of ``workers``: its GPU, round-robin."""
    if not gpus:
        raise ValueError("no GPUs to assign")
    return Pin(gpus[index % len(gpus)], workers > len(gpus))


def pin_worker(
    env: MutableMapping[str, str], *, enabled: bool | None, project_uses_quack: bool
) -> Pin | None:
    """Pin this xdist worker (``PYTEST_XDIST_WORKER`` in ``env``) to one GPU by
    rewriting CUDA_VISIBLE_DEVICES in ``env``. ``enabled``: the
    ``pytest_gpu_pin`` setting (None = when the project uses quack). Also writes
    QUACK_PYTEST_GPU / QUACK_PYTEST_GPU_SHARED for the test's own processes."""
    global current
    wid = env.get("PYTEST_XDIST_WORKER")
    if not wid or enabled is False or (enabled is None and not project_uses_quack):
        return None
    gpus = visible_gpus(env)
    if not gpus:
        return None
    count = int(env.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    pin = assign(worker_index(wid), count, gpus)
    env["CUDA_VISIBLE_DEVICES"] = pin.gpu
    env["QUACK_PYTEST_GPU"] = pin.gpu
    env["QUACK_PYTEST_GPU_SHARED"] = "1" if pin.shared else "0"
    current = pin
    return pin


# A test holding its GPU longer than this is wedged (pytest-timeout ends a test at 600 s):
# a lock wait gives up after it, warns, and the test runs without the lock.
LOCK_WAIT_S = 900.0


class GpuLock:
    """Readers (every test on a shared GPU) and one writer (an OOM retry): a gate
    flock gives the writer priority, then the writer waits for running tests.

    Every wait is bounded (``wait_s``) and interruptible (a poll, not a blocking
    flock). A writer drops its own reader hold BEFORE queueing at the gate: two
    workers of one GPU that hit CUDA OOM at once otherwise deadlocked (each waited
    for the gate or for the other's reader hold)."""

    def __init__(self, gpu: str, wait_s: float = LOCK_WAIT_S):
        import tempfile

        self.base = os.path.join(tempfile.gettempdir(), f"quack-gpu-{os.getuid()}-{gpu}")
        self.wait_s = wait_s
        self.gate = os.open(self.base + ".gate", os.O_RDWR | os.O_CREAT, 0o600)
        self.main = os.open(self.base + ".lock", os.O_RDWR | os.O_CREAT, 0o600)

    def _take(self, fd: int, op: int, deadline: float, what: str) -> bool:
        import fcntl
        import time
        import warnings

        while True:
            try:
                fcntl.flock(fd, op | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                pass
            if time.monotonic() >= deadline:
                warnings.warn(
                    f"quack: GPU lock {self.base}.{what} still held by another test after "
                    f"{self.wait_s:g} s; running without it",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return False
            time.sleep(0.01)

    def shared(self) -> bool:
        import fcntl
        import time

        deadline = time.monotonic() + self.wait_s
        if self._take(self.gate, fcntl.LOCK_SH, deadline, "gate"):
            fcntl.flock(self.gate, fcntl.LOCK_UN)
        return self._take(self.main, fcntl.LOCK_SH, deadline, "lock")

    def exclusive(self) -> bool:
        import fcntl
        import time

        fcntl.flock(self.main, fcntl.LOCK_UN)  # our own reader hold first (see the class doc)
        deadline = time.monotonic() + self.wait_s
        if not self._take(self.gate, fcntl.LOCK_EX, deadline, "gate"):
            return False
        return self._take(self.main, fcntl.LOCK_EX, deadline, "lock")

    def release(self) -> None:
        import fcntl

        fcntl.flock(self.main, fcntl.LOCK_UN)
        fcntl.flock(self.gate, fcntl.LOCK_UN)
