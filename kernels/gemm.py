"""Hopper (sm_90a) GEMM: D = act(A @ B + bias + beta * C), persistent and warp-specialized
(``_gemm_kernel``: TMA loads, WGMMA, an mbarrier ring, cluster multicast, cooperative or
ping-pong consumers). One compiled object per configuration serves every M, N, K and batch
L whose strides are 16-byte aligned.

Compile parameters: ``dtype`` (A and B: float16 / bfloat16, or float8_e4m3fn /
float8_e5m2 with per-tensor scales), ``d_dtype`` (D and C), ``a_major`` ("k": A is (M, K)
row-major; "m": column-major), ``b_major`` ("k": B (K, N) is column-major, i.e. an (N, K)
row-major weight transposed; "n": row-major; fp8: both "k"), the fused epilogue
(``has_c``, ``has_bias``, ``activation``), fp8's ``fast_accum`` (_gemm_plan.promotes) and
the launch ``config`` (GemmConfig).

Top level imports only quack: torch and cutlass are imported inside functions.
"""

import dataclasses
import functools

from quack import jit_cache
from quack.params import Bool, Choice, Config, Dtype, Rule

from . import _tuning
from ._configs import GemmConfig
from ._gemm_plan import (
    AB_DTYPES,
    ACTIVATIONS,
    FP8_DTYPES,
    SWIZZLE_TILES,
    check_plan,
    class_n_range,
    cluster_tiles,
    heuristic,
    promotes,
    resolve,
    shape_class,
    stream_k_grid,
)

PROBLEM = ("m", "n", "k")  # a tuning problem's sizes (quack tune; manifests/tuning_gemm.toml)


def _promote(params: dict) -> bool:
    return promotes(params["dtype"], params.get("fast_accum", False))


def _shape_class(params: dict) -> str | None:
    """The table class of a problem: ``quack tune`` passes the compile parameters with the
    problem's m, n, k (its winner's row class); a bind's parameters carry no shape (None:
    the torch wrapper classifies, ``gemm_config``)."""
    if not all(d in params for d in PROBLEM):
        return None
    return shape_class(params["m"], params["n"], params["k"], fast=_fast(params))


def _fast(params: dict) -> bool:
    """fp8 with fast accumulation: rows of their own (its tiles are not promoted fp8's)."""
    return params["dtype"] in FP8_DTYPES and bool(params.get("fast_accum"))


def _n_range(params: dict) -> tuple[int, int]:
    return class_n_range(params["n"])


def _fallback(params: dict) -> GemmConfig:
    """The heuristic's configuration: for the problem's m, n, k (quack tune's current
    default), else (a manifest entry that names no shape) its choice for large problems."""
    m, n, k = (params.get(d, 8192) for d in PROBLEM)
    return GemmConfig(**heuristic(m, n, k, promote=_promote(params)))


def _plan_ok(p: dict) -> bool:
    cfg = p.get("config")
    return cfg is None or check_plan(cfg.knobs(), p["d_dtype"], _promote(p)) is None


_FP8_MAJOR = (
    "a row-major (M, K) and b column-major (K, N) (the transpose of a row-major (N, K) weight), "
    "the one order fp8 WGMMA takes from shared memory"
)


def _k_major(p: dict, name: str) -> bool:
    return p["dtype"] not in FP8_DTYPES or p[name] == "k"


def search_space(params: dict) -> list[GemmConfig]:
    """``quack tune``'s candidates: every tile x cluster x schedule the kernel builds, at
    the default stage count (as many as fit) and tile order; then the large cooperative
    tiles on each cluster with each swizzled tile order (``_gemm_plan.SWIZZLES``); then
    their stream-K twins. Promoted fp8 (two accumulators) holds 128x128 and 128x192
    cooperative tiles only: its large tile, the one swizzled and cut along K, is 128x192."""
    promote = _promote(params)
    big = PROMOTED_BIG if promote else SWIZZLE_TILES
    return [c for c in _candidates(big) if check_plan(c.knobs(), params["d_dtype"], promote) is None]


PROMOTED_BIG = ((128, 192),)  # promoted fp8's large cooperative tile (search_space)


@functools.lru_cache(maxsize=None)
def _candidates(big: tuple) -> tuple[GemmConfig, ...]:
    from ._gemm_plan import CLUSTERS, SCHEDULES, SWIZZLES, TILES, fits

    out = []
    for tm, tn in TILES:
        for cm, cn in CLUSTERS:
            for s in SCHEDULES:
                if fits((tm, tn), s):
                    out.append(GemmConfig(tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn, schedule=s))
    for tm, tn in big:
        for cm, cn in CLUSTERS:
            for sw, along_m in SWIZZLES:
                out.append(
                    GemmConfig(
                        tile_m=tm,
                        tile_n=tn,
                        cluster_m=cm,
                        cluster_n=cn,
                        schedule="coop",
                        swizzle=sw,
                        raster_m=along_m,
                    )
                )
    # stream-K twins of the large cooperative tiles: whether splitting the last wave along K
    # pays depends on the shape (H200: +1-4 % at 8192^3 and the N >= 14336 or K >= 28672
    # projections, -2 to -8 % at 4096^3 and 8192 x 4096 x {4096, 14336})
    out += [
        dataclasses.replace(c, stream_k=True)
        for c in out
        if c.schedule == "coop" and (c.tile_m, c.tile_n) in big
    ]
    return tuple(out)


@jit_cache(
    "gemm",
    params={
        "dtype": Dtype(choices=AB_DTYPES),
        "d_dtype": Dtype(),
        "a_major": Choice(("k", "m")),
        "b_major": Choice(("k", "n")),
        "has_c": Bool(),
        "has_bias": Bool(),
        "activation": Choice(ACTIVATIONS),
        "fast_accum": Bool(),
        "config": Config(
            GemmConfig,
            derive=_tuning.derive(
                "gemm", GemmConfig, _shape_class, _fallback, _n_range, classes=r"m\d+k?/n\d+k?/k\d+k?(/fast)?"
            ),
        ),
    },
    rules=[
        Rule(
            "arch", "the GEMM is Hopper-only (WGMMA, TMA multicast): sm_90a", lambda p: p["arch"] == "sm_90a"
        ),
        Rule("a_major", "fp8 A is read K-major only: " + _FP8_MAJOR, lambda p: _k_major(p, "a_major")),
        Rule("b_major", "fp8 B is read K-major only: " + _FP8_MAJOR, lambda p: _k_major(p, "b_major")),
        Rule(
            "fast_accum",
            "fast_accum applies to fp8 operands only (16-bit products accumulate in fp32 as they are)",
            lambda p: p["dtype"] in FP8_DTYPES or not p["fast_accum"],
        ),
        Rule(
            "config",
            "tile_m x tile_n in 128x128 / 128x192 / 128x256 / 256x128, cluster 1x1 / 2x1 / 1x2, "
            "schedule 'ping' only with 128x128 / 128x192, stream-K only with 'coop', "
            "stages within 227 KiB of shared memory; promoted fp8 (fast_accum off: two "
            "accumulators): 128x128 / 128x192 cooperative",
            _plan_ok,
        ),
    ],
    reference=f"{__package__}._verify_gemm:verify_gemm",
    search_space=search_space,
    bench=f"{__package__}._verify_gemm:bench_gemm",
    problem=PROBLEM,
)
def compile_gemm(
    dtype: str,
    d_dtype: str = "bfloat16",
    a_major: str = "k",
    b_major: str = "k",
    has_c: bool = False,
    has_bias: bool = False,
    activation: str = "none",
    fast_accum: bool = False,
    config: GemmConfig | None = None,
    arch: str = "sm_90a",
):
    """Runtime signature: fn(a, b, d, c, bias, scale_a, scale_b, beta, max_clusters, ws,
    flags, sk_tiles) with a (M, K, L), b (N, K, L), d and c (M, N, L) of ``d_dtype`` (N-major), bias (N,) float32;
    c and bias are never read unless ``has_c`` / ``has_bias`` (pass any tensor of the right
    dtype and rank); scale_a, scale_b (1,) float32, read only for fp8 (D = scale_a * scale_b
    * A @ B + ...; else any float32 tensor); max_clusters: resident clusters of the persistent grid. Stream-K
    (``config.stream_k``): ``sk_tiles`` of the grid's cluster tiles (``stream_k_tiles``),
    ws float32 (2 x clusters x CTAs a cluster x tile_m x tile_n: a cluster hands on at most
    two pieces), flags int32 (3 x clusters x CTAs a cluster: the slots' ready flags, then a
    count per cut tile) zeroed; without it sk_tiles 0 and any one-element tensors."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    from ._gemm_kernel import HopperGemm
    from ._launch import cutlass_dtype

    promote = promotes(dtype, fast_accum)
    plan = resolve(config.knobs(), d_dtype, promote)  # type: ignore[union-attr]  # derived by bind
    ab, dt = cutlass_dtype(dtype), cutlass_dtype(d_dtype)
    epi = {"has_c": has_c, "has_bias": has_bias, "activation": activation}
    kern = HopperGemm(plan, ab, dt, a_major, b_major, epi, promote)

    def stride(div):
        return cute.sym_int(64, divisibility=div)

    ab_v, d_v = 16 // (ab.width // 8), 16 // (dt.width // 8)  # elements in 16 bytes
    m, n, k, nl = (cute.sym_int() for _ in range(4))
    sa, sb = stride(ab_v), stride(ab_v)
    a = make_fake_tensor(
        ab,
        (m, k, nl),
        stride=(sa, 1, stride(ab_v)) if a_major == "k" else (1, sa, stride(ab_v)),
        assumed_align=16,
    )
    b = make_fake_tensor(
        ab,
        (n, k, nl),
        stride=(sb, 1, stride(ab_v)) if b_major == "k" else (1, sb, stride(ab_v)),
        assumed_align=16,
    )
    d = make_fake_tensor(dt, (m, n, nl), stride=(stride(d_v), 1, stride(d_v)), assumed_align=16)
    cm, cn, cl = (cute.sym_int() for _ in range(3))
    c = make_fake_tensor(dt, (cm, cn, cl), stride=(stride(1), 1, stride(1)), assumed_align=dt.width // 8)
    bias = make_fake_tensor(cutlass_dtype("float32"), (cute.sym_int(),), stride=(1,), assumed_align=4)
    scale_a, scale_b = (
        make_fake_tensor(cutlass_dtype("float32"), (1,), stride=(1,), assumed_align=4) for _ in range(2)
    )
    ws = make_fake_tensor(cutlass_dtype("float32"), (cute.sym_int(),), stride=(1,), assumed_align=16)
    flags = make_fake_tensor(cutlass.Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        kern, a, b, d, c, bias, scale_a, scale_b, 1.0, 1, ws, flags, 0, stream, options="--enable-tvm-ffi"
    )


def gemm_config(m: int, n: int, k: int, batch: int, dtype: str, fast_accum: bool = False) -> GemmConfig:
    """The configuration for a problem: the tuning table's row for its class (``shape_class``:
    the log-2 buckets of L * M, N and K) and N, else the heuristic (``_gemm_plan.heuristic``)."""
    arch = _tuning.runtime_arch()
    table = _tuning.active_table(arch)
    return _config_for(m, n, k, batch, dtype, fast_accum, arch, table, _tuning.gpu_of(table))


@functools.lru_cache(maxsize=4096)
def _config_for(
    m: int, n: int, k: int, batch: int, dtype: str, fast_accum: bool, arch: str, table, gpu
) -> GemmConfig:
    """``gemm_config``'s answer, once per problem and table in force: on every call the class,
    the heuristic and two validated configurations cost more host time than the launch
    (the fused op took ~270 us a call on the H200 where eager torch took ~50).
    ``table`` and ``gpu`` are in the key: ``use_table`` or another device answer anew."""
    params = {"dtype": dtype, "fast_accum": fast_accum}
    fb = GemmConfig(**heuristic(m, n, k, batch, promote=_promote(params)))
    cls = shape_class(m, n, k, batch, fast=_fast(params))
    return _tuning.default_config("gemm", GemmConfig, cls, dtype, n, arch, fb)


# --------------------------------------------------------------------------- torch-facing


def gemm_fwd(
    a,
    b,
    bias=None,
    activation: str = "none",
    out_dtype=None,
    c=None,
    beta: float = 1.0,
    *,
    clusters: int | None = None,
    scale_a=None,
    scale_b=None,
    fast_accum: bool = False,
):
    """D = act(a @ b + bias + beta * c) on the GPU (no autograd: ``quack_kernels.ops.gemm``);
    fp8 a and b: D = act(scale_a * scale_b * (a @ b) + bias + beta * c) (the
    ``quack_kernels.ops.scaled_gemm`` op; ``_gemm_args.check_scales``).

    a (M, K) or (L, M, K), b (K, N) or (L, K, N): float16 / bfloat16, one dtype, either
    major order (a row- or column-major, b likewise); every stride but the unit one and the
    data pointers 16-byte aligned (``_gemm_args`` names the argument that is not). bias (N,),
    c (M, N) or (L, M, N): any float dtype. out_dtype float16 / bfloat16 / float32 (default
    a's dtype). ``clusters``: the persistent grid's clusters at most (default: as many as
    the GPU holds at once); fewer leave SMs to concurrent work, more run in waves."""
    import torch

    from quack.tuning.override import override
    from quack.tuning.problem import at_problem

    from ._gemm_args import check, operand

    if clusters is not None and (isinstance(clusters, bool) or not isinstance(clusters, int) or clusters < 1):
        raise ValueError(f"clusters must be a positive int (the grid's clusters at most), got {clusters!r}")
    if isinstance(a, torch.Tensor) and not a.is_cuda:
        raise ValueError(f"a must be a CUDA tensor, got device {a.device}")
    g = check(a, b, bias, activation, out_dtype, c, beta, scale_a, scale_b, fast_accum)
    m, n, k, batch = g.m, g.n, g.k, g.batch
    d = torch.empty((batch, m, n), device=a.device, dtype=g.out_dtype)
    if m and n and not k:  # an empty reduction: TMA cannot describe a zero-extent operand
        pre = torch.zeros((batch, m, n), device=a.device, dtype=torch.float32)  # 0 * scales
        pre = (
            pre + (bias.float() if bias is not None else 0.0) + (beta * g.c.float() if c is not None else 0.0)
        )
        d.copy_(torch_activation(pre, activation))
    elif m and n:
        cfg = override("gemm") or gemm_config(m, n, k, batch, g.dtype, fast_accum)
        fast = bool(fast_accum)
        # the call's sizes, for a miss in prebuilt mode: it suggests an entry listing them
        # (a batch counts as L * M rows, as the table's classes count it)
        with at_problem(m=m * batch, n=n, k=k):
            fn = compile_gemm(
                g.dtype,
                g.d_dtype,
                g.a_major,
                g.b_major,
                c is not None,
                bias is not None,
                activation,
                fast,
                cfg,
            )
        plan, clusters = _launch_plan(cfg, g.d_dtype, promotes(g.dtype, fast), a.device.index, clusters)
        d3 = d.permute(1, 2, 0)
        c3 = operand(g.c, "c").permute(1, 2, 0) if c is not None else d3
        no_bias, ws, flags = _stand_ins(d.device)
        bias32 = bias.float().contiguous() if bias is not None else no_bias
        sa, sb = (scale_a, scale_b) if g.scaled else (no_bias, no_bias)  # read only for fp8
        sk_tiles = 0
        if plan.stream_k:
            ctas = plan.cluster_m * plan.cluster_n
            grid, sk_tiles = stream_k_grid(cluster_tiles(plan, m, n, batch), clusters)
            if sk_tiles:
                ws = d.new_empty((2 * grid * ctas * plan.tile_m * plan.tile_n,), dtype=torch.float32)
                flags = d.new_zeros((3 * grid * ctas,), dtype=torch.int32)
        fn(g.a3, g.b3, d3, c3, bias32, sa, sb, float(beta), clusters, ws, flags, sk_tiles)
    return d if a.dim() == 3 else d[0]


@functools.lru_cache(maxsize=None)
def _stand_ins(device):
    """The bias, workspace and flags a launch without a bias or without stream-K passes
    (never read or written: has_bias is a compile-time False, sk_tiles is 0), once a device:
    allocating them every call put allocations and a memset launch on every GEMM's host
    path."""
    import torch

    return (
        torch.empty((1,), device=device, dtype=torch.float32),
        torch.empty((4,), device=device, dtype=torch.float32),
        torch.zeros((1,), device=device, dtype=torch.int32),
    )


@functools.lru_cache(maxsize=1024)
def _launch_plan(cfg: GemmConfig, d_dtype: str, promote: bool, device: int, clusters: int | None):
    """A configuration's plan and persistent grid (``clusters``, else as many clusters as
    the device holds at once: the driver's answer) on ``device``, once per configuration:
    resolving the plan and asking the occupancy cache on every call cost more host time
    than the launch. A driver failure (OccupancyError) is raised, not kept."""
    from quack.runtime import max_active_clusters

    plan = resolve(cfg.knobs(), d_dtype, promote)
    if clusters is None:
        clusters = max_active_clusters(
            plan.cluster_m * plan.cluster_n, plan.threads, plan.smem_bytes(d_dtype), device=device
        )
    return plan, clusters


def torch_activation(x, activation: str):
    import torch

    if activation == "relu":
        return torch.relu(x)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(x, approximate="tanh")
    if activation == "silu":
        return torch.nn.functional.silu(x)
    return x
