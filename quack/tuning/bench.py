"""GPU timing for ``quack tune`` (docs/tuning.md "How a candidate is measured").

``gpu_time(call)``: CUDA events around each of ``reps`` calls, the L2 cache flushed before
each (a write of twice its size, so no call reads its inputs from the previous one's L2),
after ``warmup`` calls; the median of the reps (a round). The engine
(``quack.compile.autotune``) ranks by the median of such rounds, interleaved between the
close candidates. torch is imported here, inside the functions only."""

from __future__ import annotations

import statistics
import time
from typing import Callable

_FLUSH: dict = {}
# torch.cuda._sleep spins for a number of GPU clock cycles: ~2 GHz on Hopper (H100 / H200
# boost 1.98 GHz); a slower clock only lengthens the spin, which is harmless.
_CYCLES_PER_S = 2.0e9


def _flush_buffer(device):
    import torch

    key = str(device)
    if key not in _FLUSH:
        l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (64 << 20))
        _FLUSH[key] = torch.empty(2 * l2 // 4, dtype=torch.int32, device=device)
    return _FLUSH[key]


def gpu_time(call: Callable[[], object], *, reps: int = 10, warmup: int = 2, device=None) -> float:
    """Seconds: the median over ``reps`` of one ``call()``, L2 flushed before each."""
    import torch

    if reps < 1 or warmup < 0:
        raise ValueError(f"gpu_time: reps (got {reps}) must be >= 1 and warmup (got {warmup}) >= 0")
    dev = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    buf = _flush_buffer(dev)
    t0 = time.perf_counter()
    for _ in range(warmup):
        buf.zero_()
        call()
    # this thread's time to queue one rep (50 us, a Python op's usual, without a warm-up)
    enqueue_s = (time.perf_counter() - t0) / warmup if warmup else 50e-6
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    # The GPU spins while this thread queues the reps, so a rep's start event is followed at
    # once by its kernel: descheduled between the two (a compile pool busy on every core), the
    # thread left the GPU idle inside the timed interval, and ~120 us kernels measured 90-144 us
    # on the H200. Sized from the warm-up's queueing time, 4x over, within [1, 50] ms.
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(int(_CYCLES_PER_S * min(0.05, max(0.001, 4 * reps * enqueue_s))))
    for i in range(reps):
        buf.zero_()  # L2 flushed; queued with the calls, so the GPU stays busy between them
        start[i].record()
        call()
        end[i].record()
    torch.cuda.synchronize(dev)
    return statistics.median(s.elapsed_time(e) for s, e in zip(start, end)) / 1e3
