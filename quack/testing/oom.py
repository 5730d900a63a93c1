"""CUDA out-of-memory retry: a test that failed with CUDA OOM runs once more,
after gc.collect() and torch.cuda.empty_cache(), holding its GPU exclusively
(GpuLock: every worker sharing the GPU holds it shared around each test)."""

from __future__ import annotations

import sys
from typing import Any, Callable

from quack.testing.gpus import GpuLock

NOTE = "retried once after CUDA out-of-memory (gc + torch.cuda.empty_cache, GPU held exclusively)"


def is_cuda_oom(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 8:
        if type(exc).__name__ == "OutOfMemoryError" and "torch" in type(exc).__module__:
            return True
        msg = str(exc)
        if (
            "CUDA out of memory" in msg
            or "CUDA_ERROR_OUT_OF_MEMORY" in msg
            or "cudaErrorMemoryAllocation" in msg
            or "CUDA error: out of memory" in msg
        ):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def free_gpu_memory() -> None:
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - best effort
            pass


def retry(
    attempt: Callable[[], tuple[Any, list]], shared_lock: GpuLock | None, gpu_name: str
) -> tuple[Any, list]:
    """Run ``attempt`` again with the GPU held exclusively; returns its result
    (pending, reports) with the retry noted on every report. ``shared_lock``: the
    lock this worker holds shared around each test (None if the GPU is its own)."""
    free_gpu_memory()
    lock = shared_lock or GpuLock(gpu_name)
    lock.exclusive()
    try:
        free_gpu_memory()
        pending, reports = attempt()
    finally:
        lock.release()
        if shared_lock is not None:
            shared_lock.shared()
    for r in reports:
        r.sections.append(("quack", NOTE))
        r.user_properties.append(("quack_oom_retry", True))
    return pending, reports
