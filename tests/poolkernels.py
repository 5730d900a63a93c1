"""Kernels that misbehave in compile workers, for the pool's fault tests.

In the calling process (not a multiprocessing child) every mode compiles
normally, so the synchronous fall-back after a time-out succeeds."""

import multiprocessing
import os
import signal
import tempfile
import time

from quack import jit_cache
from quack.params import Choice, Int

MODES = ("ok", "raise", "wedge", "die", "selfkill", "slow")


def pid_file(tag: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"quack-pool-fault-{os.getuid()}-{tag}.pid")


@jit_cache("pool_fault", params={"mode": Choice(MODES), "tag": Int(min=0)})
def pool_fault(mode: str = "ok", tag: int = 0):
    from toykernels import toy_scale

    in_worker = multiprocessing.parent_process() is not None
    if mode == "raise":
        raise ValueError(f"pool_fault: deliberate compile failure (tag {tag})")
    if in_worker and mode in ("wedge", "die"):
        with open(pid_file(tag), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(3600)  # "die": the test kills us; "wedge": the pool's time-out does
    if in_worker and mode == "selfkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if in_worker and mode == "slow":
        time.sleep(1.5)
    return toy_scale.compile_uncached("float32", 32, False)
