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

log = logging.getLogger("quack_kernels")

_PROBE = "quack_occupancy_probe"


def _ptx(major: int, minor: int) -> bytes:
    # PTX ISA 7.8 (CUDA 11.8) is the first with sm_90; any driver that runs sm_90 JITs it
    return (
        f".version 7.8\n.target sm_{major}{minor}\n.address_size 64\n"
        f".visible .entry {_PROBE}()\n{{\n  ret;\n}}\n"
    ).encode() + b"\0"  # the driver reads PTX as a C string


def _check(result):
    """cuda.bindings returns (CUresult, value...): raise on an error, return the value."""
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {int(err)}")
    return rest[0] if len(rest) == 1 else (rest or None)


def query_max_active_clusters(device_index: int, cluster_n: int, threads: int, smem_bytes: int) -> int:
    """``cuOccupancyMaxActiveClusters`` for clusters of ``cluster_n`` CTAs of ``threads``
    threads and ``smem_bytes`` of dynamic shared memory on CUDA device ``device_index``
    (the probe kernel; the primary context, pushed and popped). Raises on any failure."""
    from cuda.bindings import driver as cu

    _check(cu.cuInit(0))
    dev = _check(cu.cuDeviceGet(device_index))
    attr = cu.CUdevice_attribute
    major = _check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
    minor = _check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
    ctx = _check(cu.cuDevicePrimaryCtxRetain(dev))
    try:
        _check(cu.cuCtxPushCurrent(ctx))
        try:
            mod = _check(cu.cuModuleLoadData(_ptx(major, minor)))
            try:
                fn = _check(cu.cuModuleGetFunction(mod, _PROBE.encode()))
                fa = cu.CUfunction_attribute
                _check(
                    cu.cuFuncSetAttribute(fn, fa.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes)
                )
                if cluster_n > 8:  # 16-CTA clusters are "non-portable": opt in, as the kernels do
                    _check(
                        cu.cuFuncSetAttribute(fn, fa.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
                    )
                cfg = cu.CUlaunchConfig()
                cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = 1, cluster_n, 1
                cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = threads, 1, 1
                cfg.sharedMemBytes = smem_bytes
                val = cu.CUlaunchAttributeValue()
                val.clusterDim.x, val.clusterDim.y, val.clusterDim.z = 1, cluster_n, 1
                cl = cu.CUlaunchAttribute()
                cl.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                cl.value = val
                cfg.attrs = [cl]
                cfg.numAttrs = 1
                return int(_check(cu.cuOccupancyMaxActiveClusters(fn, cfg)))
            finally:
                cu.cuModuleUnload(mod)
        finally:
            cu.cuCtxPopCurrent()
    finally:
        cu.cuDevicePrimaryCtxRelease(dev)


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
