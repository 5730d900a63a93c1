"""How many thread-block clusters of a launch shape a GPU holds at once, asked of the CUDA
driver's occupancy calculator (``cuOccupancyMaxActiveClusters``) without the CuTe DSL
compiler: a persistent kernel sizes its grid to exactly one wave of resident clusters.

cutlass's ``HardwareInfo`` answers this by compiling a probe kernel with the DSL, which
imports the compiler into a process that only loads prebuilt objects (issue 27). Here
the probe is an empty PTX kernel the driver JIT-compiles (no cutlass import), with the
launch's block size, cluster size and dynamic shared memory. SMs / cluster size
overestimates: clusters are placed within one GPC, and GPCs differ in SM count after
floor-sweeping (on the H200, clusters of 4: 28 resident, not 132 / 4 - 1 = 32).

Its registers are not the real kernel's: the answer is exact for kernels whose residency
is bounded by shared memory or threads (one big CTA per SM), an upper bound otherwise.

Public: ``quack.runtime.max_active_clusters``. cuda.bindings is imported on first call."""

from __future__ import annotations

import functools
import logging
import sys

from quack.errors import OccupancyError

log = logging.getLogger("quack")

_PROBE = "quack_occupancy_probe"


def probe_ptx(major: int, minor: int) -> bytes:
    """The occupancy probe kernel's PTX for sm_<major><minor>, NUL-terminated (public:
    a test assembles it with ptxas)."""
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
    from cuda.bindings import driver as cu  # type: ignore[import-untyped]

    _check(cu.cuInit(0))
    dev = _check(cu.cuDeviceGet(device_index))
    attr = cu.CUdevice_attribute
    major = _check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
    minor = _check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
    ctx = _check(cu.cuDevicePrimaryCtxRetain(dev))
    try:
        _check(cu.cuCtxPushCurrent(ctx))
        try:
            mod = _check(cu.cuModuleLoadData(probe_ptx(major, minor)))
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
def _cached(device: int, cluster_size: int, threads: int, smem_bytes: int) -> int:
    return query_max_active_clusters(device, cluster_size, threads, smem_bytes)


def _current_device() -> int:
    torch = sys.modules.get("torch")  # never imported here: a caller with tensors has it
    if torch is not None and torch.cuda.is_available():
        return int(torch.cuda.current_device())
    return 0


def _check_arg(name: str, value, lo: int, hi: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"max_active_clusters: {name} = {value!r} must be an integer {rng}")
    return value


def max_active_clusters(
    cluster_size: int,
    threads: int,
    smem_bytes: int = 0,
    *,
    device: int | None = None,
    fallback: int | None = None,
) -> int:
    """How many clusters of ``cluster_size`` CTAs, each of ``threads`` threads with
    ``smem_bytes`` of dynamic shared memory, CUDA device ``device`` (default: torch's
    current device, else 0) runs at once. Asked of the driver once per (device, shape)
    and cached; needs no CuTe DSL compiler, so it works in prebuilt mode.

    When the driver cannot answer (no GPU, no cuda.bindings, a driver error) or answers
    0 (the shape does not fit), raises OccupancyError; with ``fallback``, logs one
    warning per shape and returns ``fallback`` instead.

        clusters = quack.runtime.max_active_clusters(2, 384, smem_bytes=227 * 1024)
        fn(a, b, c, clusters, stream)  # a persistent kernel's grid: one wave"""
    _check_arg("cluster_size", cluster_size, 1, 16)
    _check_arg("threads", threads, 1, 1024)
    _check_arg("smem_bytes", smem_bytes, 0, None)
    dev = _current_device() if device is None else _check_arg("device", device, 0, None)
    try:
        n = _cached(dev, cluster_size, threads, smem_bytes)
        if n <= 0:
            raise RuntimeError("the driver answered 0: the shape does not fit on an SM")
    except Exception as e:  # noqa: BLE001 - any failure is one OccupancyError (or the fallback)
        err = OccupancyError(dev, cluster_size, threads, smem_bytes, f"{type(e).__name__}: {e}")
        if fallback is None:
            raise err from None
        _warn_once(str(err), fallback)
        return fallback
    return n


@functools.lru_cache(maxsize=None)
def _warn_once(message: str, fallback: int) -> None:
    log.warning("%s; using %d clusters", message, fallback)
