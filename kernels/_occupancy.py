"""How many thread-block clusters of a launch shape the GPU holds at once, from the CUDA
driver's occupancy calculator (``cuOccupancyMaxActiveClusters``), for the persistent
kernels whose grid must be exactly one wave.

Clusters are placed within one GPC (graphics processing cluster), and GPCs of one chip
have different SM counts after floor-sweeping: SMs / cluster size overestimates. On the
H200, the one-CTA-per-SM ring forward with clusters of 4 ran as two waves with a grid of
SMs / 4 - 1 = 32 clusters (LayerNorm 2.32 TB/s vs 3.88 with 28): the clusters past the
co-resident ones ran afterwards, alone. The answer depends on the chip, not the model,
so it is asked at run time, once per (device, shape).

The calculator needs a kernel: a probe kernel (empty, loaded from PTX by the driver's
JIT: no CuTe DSL compiler at run time) with the launch's block size, cluster size and
dynamic shared memory. Its registers do not matter for the kernels that use this: they
run one 256-thread CTA per SM by shared memory (> half an SM's), and a 256-thread CTA
fits in the register file at any register count ptxas allows (<= 255 a thread).

Imported only from inside the torch wrappers (cuda.bindings is imported inside).
"""

from __future__ import annotations

import functools
import logging

# The driver query is quack's public runtime helper (quack.runtime.max_active_clusters);
# this module keeps the kernels' own cached wrapper (its fallback and warning) as it was.
from quack.runtime.occupancy import query_max_active_clusters

log = logging.getLogger("quack_kernels")


@functools.lru_cache(maxsize=None)
def max_active_clusters(
    device_index: int, cluster_n: int, threads: int, smem_bytes: int, fallback: int
) -> int:
    """``query_max_active_clusters``, cached per (device, shape); ``fallback`` (and one
    warning per shape) when the driver cannot answer (no cuda.bindings, a driver error)
    or answers 0 (the shape does not fit: the launch itself will say why)."""
    try:
        n = query_max_active_clusters(device_index, cluster_n, threads, smem_bytes)
    except Exception as e:  # noqa: BLE001 - any failure: keep the launch going with the estimate
        log.warning(
            "quack_kernels: occupancy query failed for clusters of %d x %d threads, %d B shared memory "
            "(%s: %s); using %d clusters",
            cluster_n,
            threads,
            smem_bytes,
            type(e).__name__,
            e,
            fallback,
        )
        return fallback
    return n if n > 0 else fallback
