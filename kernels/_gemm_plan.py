"""The GEMM's launch plan in plain Python (no cutlass, no torch): the tile / cluster /
schedule a configuration resolves to, the shared-memory stage counts, the rules a
configuration must pass before anything compiles, and the heuristic default.

Shared memory on the H200 (sm_90a): 227 KiB a CTA (232448 bytes). A stage holds one
128-byte K slice of A and B (64 16-bit or 128 fp8 elements a row): (tile_m + tile_n) * 128
bytes. The epilogue buffer holds
``epi_stages`` subtiles of tile_m x 32 of D (ping-pong: one set per consumer warpgroup).
"""

import dataclasses
import math

SMEM_BYTES = 232448
BARRIER_BYTES = 1024  # mbarriers + alignment slack
K_BYTES = 128  # a stage's K slice, a row: the 128-byte swizzle atom of a K-major operand
TILE_K = 64  # K_BYTES of 16-bit elements (tile_k: of any operand dtype)
EPI_N = 32  # columns of an epilogue subtile
WG = 128  # threads of a warpgroup
# (tile_m, tile_n) the kernel is built for: the 128 x {128, 192, 256} and 256 x 128
TILES = ((128, 128), (128, 192), (128, 256), (256, 128))
CLUSTERS = ((1, 1), (2, 1), (1, 2))
SCHEDULES = ("coop", "ping")
# Tile orders `quack tune` tries for the large cooperative tiles (the persistent scheduler's
# swizzle, in clusters, along M or along N): at 8192 x 28672 the grid is 64 x 112 tiles and
# the unswizzled row-major order re-reads B from HBM for every row of tiles.
SWIZZLES = ((4, True), (4, False), (8, True), (8, False))
SWIZZLE_TILES = ((128, 256), (256, 128))
ACTIVATIONS = ("none", "relu", "gelu_tanh", "silu")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
AB_DTYPES = ("float16", "bfloat16", *FP8_DTYPES)
D_DTYPES = ("float16", "bfloat16", "float32")
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}
# a consumer thread's fp32 accumulator registers at most (of CONSUMER_REGS = 232): the rest
# holds addresses, the epilogue's fragments and the loop state
ACC_REGS_MAX = 192


def tile_k(dtype: str) -> int:
    """The K depth of a stage for operands of ``dtype``: K_BYTES of them (WGMMA's K is 16
    for 16-bit, 32 for fp8: 4 instructions a stage either way)."""
    return K_BYTES // DTYPE_BYTES[dtype]


def promotes(dtype: str, fast_accum: bool) -> bool:
    """Whether the mainloop promotes fp8 products into a second fp32 accumulator once a
    stage (every 128 K): Hopper's fp8 WGMMA adds into its accumulator with fewer mantissa
    bits than fp32 (about 14 kept: DeepSeek-V3, section 3.3.2), so a long K drifts from an
    fp32 sum. ``fast_accum`` (torch._scaled_mm's use_fast_accum) keeps the one accumulator:
    half the registers, larger tiles, the lower precision."""
    return dtype in FP8_DTYPES and not fast_accum


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    tile_m: int
    tile_n: int
    cluster_m: int
    cluster_n: int
    schedule: str  # "coop": 2 consumer warpgroups split a tile along M; "ping": one tile each
    stages: int  # A/B stages in shared memory
    epi_stages: int  # epilogue subtiles in flight (per consumer warpgroup under "ping")
    raster_m: bool  # persistent tile order: along M first (else along N); only with swizzle > 1
    swizzle: int = 1  # clusters grouped by the tile order's swizzle (1: none)
    stream_k: bool = False  # the last wave's tiles split along K over every cluster

    @property
    def threads(self) -> int:
        return 384  # one producer warpgroup + two consumer warpgroups

    def smem_bytes(self, d_dtype: str) -> int:
        return smem_bytes(self.tile_m, self.tile_n, self.schedule, self.stages, self.epi_stages, d_dtype)


def swizzled_cluster(j, mc, nc, swizzle: int, raster_m: bool, minimum=min):
    """The (m, n) cluster coordinates of the ``j``-th cluster (0 <= j < mc * nc) of a
    swizzled persistent tile order over an ``mc`` x ``nc`` grid of clusters: bands of
    ``swizzle`` cluster columns (``raster_m``; else rows), walked row by row (else column by
    column) inside a band, the last band as wide as what is left. A bijection onto the
    grid, so no index is wasted: cutlass.utils' StaticPersistentTileScheduler instead pads
    the grid to whole bands and hands the padding out as work, and the kernel ran whole
    mainloops on zeros for it (at M = 8448 on an order tuned at 8192, 33 cluster rows padded
    to 40: 1.22-1.36x the time for 1.03x the work). Plain integer arithmetic on ints or,
    in the kernel, on run-time Int32 values (``minimum``: cutlass.min there)."""
    if raster_m:
        band = swizzle * mc
        g = j // band
        width = minimum(swizzle, nc - g * swizzle)
        r = j - g * band
        return r // width, g * swizzle + r % width
    band = swizzle * nc
    g = j // band
    width = minimum(swizzle, mc - g * swizzle)
    r = j - g * band
    return g * swizzle + r % width, r // width


def cluster_tiles(plan: "GemmPlan", m: int, n: int, batch: int) -> int:
    """The cluster tiles of an m x n (x batch) output on ``plan``'s tiles and cluster."""
    mc = (-(-m // plan.tile_m) + plan.cluster_m - 1) // plan.cluster_m
    nc = (-(-n // plan.tile_n) + plan.cluster_n - 1) // plan.cluster_n
    return mc * nc * batch


def stream_k_grid(tiles: int, clusters: int) -> tuple[int, int]:
    """(the persistent grid's clusters, its stream-K tiles) for ``tiles`` cluster tiles and at
    most ``clusters`` clusters: one cluster a tile at most, as the kernel's scheduler
    launches (so a grid of fewer tiles than clusters is one wave and cuts nothing), and
    ``stream_k_tiles`` of that grid. The wrapper (gemm_fwd) and the tests take it from here."""
    grid = min(clusters, tiles)
    return grid, stream_k_tiles(tiles, grid)


def stream_k_tiles(tiles: int, clusters: int) -> int:
    """How many of a persistent grid's ``tiles`` (cluster tiles, the last ones of its order)
    the stream-K schedule splits along K over all ``clusters``: none when the waves come out
    whole; else the partial wave and one whole wave before it (each cluster then takes
    1-2 tiles' worth of K iterations, so a tile is cut into at most two pieces, where the
    partial wave alone cut a few tiles into many); all of them when there is no whole wave."""
    if tiles <= 0 or clusters <= 0:
        raise ValueError(f"tiles and clusters must be positive, got {tiles}, {clusters}")
    rest = tiles % clusters
    if rest == 0:
        return 0
    return rest + clusters if tiles >= rest + clusters else tiles


def stream_k_owner(x: int, clusters: int, iters: int) -> int:
    """The cluster whose share of the stream-K region's ``iters`` iterations holds iteration
    ``x``: the first ``iters % clusters`` shares are one iteration longer."""
    base, extra = divmod(iters, clusters)
    big = extra * (base + 1)
    return x // (base + 1) if x < big else extra + (x - big) // base


def stream_k_units(c: int, clusters: int, tiles: int, sk: int, k_tiles: int):
    """Cluster ``c``'s work, in order, as the kernel walks it (_gemm_sched's ``sk_unit``
    and ``sk_piece``: the same arithmetic on Int32): (tile, k_begin, k_end, head, pieces).
    First its data-parallel tiles (every ``clusters``-th of the first ``tiles - sk``),
    whole; then its even share of the stream-K region's ``sk * k_tiles`` iterations, cut
    at tile edges. A tile cut into ``pieces`` > 1 is held by the clusters ``head``,
    ``head + 1``, ... in K order: the head's last unit starts it, the others' first units
    go on with it. Whole tiles have ``head`` = c and ``pieces`` = 1."""
    out = []
    dp = tiles - sk
    out += [(j, 0, k_tiles, c, 1) for j in range(c, dp, clusters)]
    iters = sk * k_tiles
    base, extra = divmod(iters, clusters)
    u = c * base + min(c, extra)
    end = u + base + (1 if c < extra else 0)
    while u < end:
        kb = u % k_tiles
        ke = min(k_tiles, kb + end - u)
        head = stream_k_owner(u - kb, clusters, iters)
        pieces = stream_k_owner(u - kb + k_tiles - 1, clusters, iters) - head + 1
        out.append((dp + u // k_tiles, kb, ke, head, pieces))
        u += ke - kb
    return out


def acc_regs(tile_m: int, tile_n: int, schedule: str, promote: bool = False) -> int:
    """fp32 accumulator registers a consumer thread holds: a warpgroup (128 threads) owns
    half a tile (coop) or a whole one (ping); twice that when fp8 products are promoted
    (``promotes``: the stage's partial sums beside the total)."""
    rows = tile_m // 2 if schedule == "coop" else tile_m
    return rows * tile_n // 128 * (2 if promote else 1)


def smem_bytes(tile_m: int, tile_n: int, schedule: str, stages: int, epi_stages: int, d_dtype: str) -> int:
    ab = (tile_m + tile_n) * K_BYTES * stages
    epi = tile_m * EPI_N * DTYPE_BYTES[d_dtype] * epi_stages * (2 if schedule == "ping" else 1)
    return ab + epi + BARRIER_BYTES


def max_stages(tile_m: int, tile_n: int, schedule: str, epi_stages: int, d_dtype: str) -> int:
    per = (tile_m + tile_n) * K_BYTES
    return (SMEM_BYTES - smem_bytes(tile_m, tile_n, schedule, 0, epi_stages, d_dtype)) // per


def default_epi_stages(tile_m: int, schedule: str, d_dtype: str) -> int:
    # a tile_m x 32 subtile of fp32 at tile_m = 256 is 32 KiB: two in flight are enough to
    # overlap the TMA store of one with the conversion of the next
    big = tile_m * EPI_N * DTYPE_BYTES[d_dtype] * (2 if schedule == "ping" else 1) >= 16384
    return 2 if big else 4


def fits(tile: tuple, schedule: str, promote: bool = False) -> bool:
    """Whether a (tile, schedule) pair can be built: ping-pong gives one warpgroup a whole
    tile, so its accumulator must leave registers for the rest (<= 192 of 232); promoted
    fp8 holds two accumulators."""
    return tuple(tile) in TILES and acc_regs(tile[0], tile[1], schedule, promote) <= ACC_REGS_MAX


def resolve(knobs: dict, d_dtype: str, promote: bool = False) -> GemmPlan:
    """A GemmConfig's knobs (None = heuristic) -> the plan the kernel is built with."""
    tm, tn = knobs.get("tile_m", 128), knobs.get("tile_n", 256)
    schedule = knobs.get("schedule", "coop" if not fits((tm, tn), "ping", promote) or tn > 128 else "ping")
    epi = default_epi_stages(tm, schedule, d_dtype)
    stages = knobs.get("stages") or max_stages(tm, tn, schedule, epi, d_dtype)
    return GemmPlan(
        tile_m=tm,
        tile_n=tn,
        cluster_m=knobs.get("cluster_m", 2),
        cluster_n=knobs.get("cluster_n", 1),
        schedule=schedule,
        stages=stages,
        epi_stages=epi,
        raster_m=knobs.get("raster_m", True),
        swizzle=knobs.get("swizzle") or 1,
        stream_k=bool(knobs.get("stream_k")),
    )


def check_plan(knobs: dict, d_dtype: str, promote: bool = False) -> str | None:
    """Why a configuration cannot be built, or None when it can (``promote``: fp8 products
    promoted into a second accumulator, ``promotes``)."""
    tm, tn = knobs.get("tile_m", 128), knobs.get("tile_n", 256)
    if (tm, tn) not in TILES:
        return f"tile {tm}x{tn} is not one of {', '.join(f'{a}x{b}' for a, b in TILES)}"
    cl = (knobs.get("cluster_m", 2), knobs.get("cluster_n", 1))
    if cl not in CLUSTERS:
        return f"cluster {cl[0]}x{cl[1]} is not one of {', '.join(f'{a}x{b}' for a, b in CLUSTERS)}"
    plan = resolve(knobs, d_dtype, promote)
    if not fits((tm, tn), plan.schedule, promote):
        return (
            f"schedule {plan.schedule!r} with tile {tm}x{tn}{' and promoted fp8 sums' if promote else ''}: "
            f"a warpgroup would hold {acc_regs(tm, tn, plan.schedule, promote)} accumulator registers "
            f"(at most {ACC_REGS_MAX})"
        )
    if plan.stream_k and plan.schedule != "coop":
        return "stream-K (stream_k = true) needs schedule 'coop'"
    top = max_stages(tm, tn, plan.schedule, plan.epi_stages, d_dtype)
    if plan.stages < 2 or plan.stages > top:
        return f"stages={plan.stages}: tile {tm}x{tn} with D {d_dtype} fits 2..{top} in 227 KiB"
    return None


def heuristic(m: int, n: int, k: int, batch: int = 1, promote: bool = False) -> dict:
    """The default knobs for a problem (no tuning-table row): 128x256 cooperative tiles on a
    2x1 cluster for large problems (the tile cuBLAS picks for LLM shapes on the H200: fewest
    bytes loaded per FLOP that still fits four stages), 128x128 ping-pong when the grid of
    big tiles would leave most of the 132 SMs idle. Promoted fp8 (``promotes``: two
    accumulators) gets the largest tiles that hold both: 128x192 and 128x128 cooperative."""
    tiles_big = -(-m // 128) * -(-n // 256) * batch
    if promote:
        if tiles_big >= 132:
            return {"tile_m": 128, "tile_n": 192, "cluster_m": 2, "cluster_n": 1, "schedule": "coop"}
        return {"tile_m": 128, "tile_n": 128, "cluster_m": 1, "cluster_n": 1, "schedule": "coop"}
    if tiles_big >= 132:
        return {"tile_m": 128, "tile_n": 256, "cluster_m": 2, "cluster_n": 1, "schedule": "coop"}
    return {"tile_m": 128, "tile_n": 128, "cluster_m": 1, "cluster_n": 1, "schedule": "ping"}


def size_bucket(x: int) -> int:
    """The exponent of the power of two nearest ``x`` on a log scale: ``b`` with
    2^(b - 1/2) <= x < 2^(b + 1/2), computed exactly in integers (x^2 has bit length 2b or
    2b + 1). Nearest rather than floor: a tuned 4096 sits in the middle of its bucket
    (2897 .. 5792), so 4000 or 4200 reach its row, where floor(log2) put 4095 into the
    bucket of 2048 and 4096 at the very edge of its own."""
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ValueError(f"a GEMM size must be a positive integer, got {x!r}")
    return (x * x).bit_length() // 2


def bucket_range(b: int) -> tuple[int, int]:
    """The inclusive range of sizes whose ``size_bucket`` is ``b`` (a table row's N range)."""
    if b < 0:
        raise ValueError(f"a size bucket is >= 0, got {b}")
    lo = 1 if b == 0 else math.isqrt((1 << (2 * b - 1)) - 1) + 1
    return lo, math.isqrt((1 << (2 * b + 1)) - 1)


def _bucket_label(b: int) -> str:
    v = 1 << b
    return f"{v >> 10}k" if v >= 1024 else str(v)


def shape_class(m: int, n: int, k: int, batch: int = 1, fast: bool = False) -> str:
    """A problem's tuning-table class (docs/tuning.md "The GEMM's problem classes"): M, N and
    K each rounded to the nearest power of two on a log scale (``size_bucket``), e.g.
    8192 x 14336 x 4096 -> "m8k/n16k/k4k". Every goal shape of issue 28 has a class of its
    own; the old output-size / K-depth classes put 4096^3, 8192x4096x4096 and
    8192x4096x14336 into one ("mid/k" at N = 4096), so one winner served all three. A
    batch of L problems counts as L * M rows: the persistent grid walks L * ceil(M / tile_m)
    row tiles, as the heuristic counts them. ``fast``: fp8 with fast accumulation, whose
    winners (one accumulator: the large tiles) are no use to promoted fp8: "/fast" added."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"a GEMM batch must be a positive integer, got {batch!r}")
    bm, bn, bk = size_bucket(m * batch), size_bucket(n), size_bucket(k)
    cls = f"m{_bucket_label(bm)}/n{_bucket_label(bn)}/k{_bucket_label(bk)}"
    return cls + "/fast" if fast else cls


def class_n_range(n: int) -> tuple[int, int]:
    """The N range a winner's row covers: every N of its bucket (the class names the
    bucket already; the range makes the row readable and keeps it to that bucket)."""
    return bucket_range(size_bucket(n))
