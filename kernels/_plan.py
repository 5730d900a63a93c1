"""Launch planning for the row-wise kernels: pure Python, no torch, no cutlass.

A row of N elements is split over ``threads_per_row`` threads of one CTA and,
for the largest rows, over ``cluster_n`` CTAs of a thread-block cluster
(Hopper distributed shared memory carries the partial reductions). Each thread
keeps its share of the row in registers, loaded with 128-bit vector accesses.

Strategy by N (16-bit dtypes; 32-bit ones use the same element budget):

=================  ===============  ===========  =========
N                  threads / row    CTA threads  cluster
=================  ===============  ===========  =========
<= 64·vec          8 / 16 (sub-warp, several rows per warp; N = 1 .. 255 too)
<= 3072            32 (one warp)    128          1
<= 6144            64               128          1
<= 8192            128              128          1
<= 16384           256 (one block)  256          1
> 16384            256              256          2 .. 16 (DSMEM reduction)
=================  ===============  ===========  =========
"""

from __future__ import annotations

import dataclasses
import functools
import math

from quack.params import Dtype

N_MIN = 1
N_MAX = 262144
WIDTHS = {"float32": 32, "float16": 16, "bfloat16": 16}


def io_width(*dtypes) -> int:
    """Bits of the widest of ``dtypes`` (names; None and "same" are skipped): the plan's
    vector width when every tensor of the row tiling must move in <= 128-bit vectors
    (cross-entropy's fp32 class weights). The norms size their plan by the rows' dtype
    alone: a wider weight is read element-wise (``RowTiles.load_bcast``)."""
    return max(WIDTHS[d] for d in dtypes if d not in (None, "same"))


class WeightDtype(Dtype):
    """The weight / bias dtype of a norm kernel: ``"same"`` (the input's dtype, the
    default) or one of float32 / float16 / bfloat16. The torch wrappers pass "same"
    when the weight's dtype equals the input's, so one configuration has one key."""

    def check(self, name, value):
        if value is None or value == "same":
            return "same"
        return super().check(name, value)

    def describe(self):
        return '"same" (the input dtype) or ' + super().describe()


def resolve_weight_dtype(dtype: str, weight_dtype: str) -> str:
    return dtype if weight_dtype in (None, "same") else weight_dtype


@dataclasses.dataclass(frozen=True)
class RowPlan:
    n: int  # row length (static)
    vec: int  # elements per vector access (<= 128 bits of the widest dtype)
    threads_per_row: int  # threads of one CTA sharing a row
    num_threads: int  # threads per CTA
    cluster_n: int  # CTAs sharing a row (1 = no cluster)
    nvec: int  # vector accesses per thread per row

    @property
    def rows_per_cta(self) -> int:
        return self.num_threads // self.threads_per_row

    @property
    def warps_per_row(self) -> int:
        return max(self.threads_per_row // 32, 1)

    @property
    def tile_n(self) -> int:
        """Columns covered by one CTA."""
        return self.vec * self.threads_per_row * self.nvec

    @property
    def elems_per_thread(self) -> int:
        return self.vec * self.nvec

    @property
    def even(self) -> bool:
        """True when the CTA tiles cover the row exactly (no column predicate)."""
        return self.tile_n * self.cluster_n == self.n


# Memoized: every eager call of a kernel's torch wrapper plans its launch (a RowPlan is
# frozen, and a pure function of these integers).
@functools.lru_cache(maxsize=4096)
def plan_rows(n: int, width: int, *, budget: int = 64, max_cluster: int = 16) -> RowPlan:
    """Pick the launch shape for rows of ``n`` elements of ``width`` bits (the widest
    dtype read or written). ``budget`` caps the row elements one thread keeps in
    registers (fp32 after conversion), so a kernel holding two rows (backward)
    passes a smaller budget."""
    if not (N_MIN <= n <= N_MAX):
        raise ValueError(f"n={n} out of range [{N_MIN}, {N_MAX}]")
    vec = math.gcd(n, 128 // width)
    nvecs = -(-n // vec)  # vector accesses in the whole row
    # Smallest power-of-two thread count that keeps a thread's share <= budget,
    # at least a quarter warp, at most 256 threads per CTA.
    tpr = 8
    while tpr < 256 and -(-nvecs // tpr) * vec > budget:
        tpr *= 2
    # Prefer whole warps once the row has enough vectors: fewer idle lanes in shuffles.
    if nvecs >= 32 * 4 and tpr < 32:
        tpr = 32
    cluster_n = 1
    if tpr == 256:
        while cluster_n < max_cluster and -(-nvecs // (256 * cluster_n)) * vec > budget:
            cluster_n *= 2
    num_threads = 256 if tpr >= 256 else 128
    nvec = -(-nvecs // (tpr * cluster_n))
    # Never let a CTA of the cluster own an empty tile.
    while cluster_n > 1 and (cluster_n - 1) * tpr * nvec * vec >= n:
        cluster_n //= 2
        nvec = -(-nvecs // (tpr * cluster_n))
    return RowPlan(n=n, vec=vec, threads_per_row=tpr, num_threads=num_threads, cluster_n=cluster_n, nvec=nvec)


def smem_bcast_ok(plan: RowPlan, width: int, count: int, max_bytes: int = 72 * 1024) -> bool:
    """Stage ``count`` broadcast vectors (weight / bias) of ``width`` bits in shared
    memory with cp.async? Only for one row per CTA split over a cluster (the large-N
    paths), vector accesses of >= 4 bytes (cp.async sizes), and a shared-memory tile
    small enough to keep 2+ CTAs per SM."""
    return (
        plan.cluster_n > 1
        and plan.rows_per_cta == 1
        and 32 <= plan.vec * width <= 128
        and count * plan.tile_n * width // 8 <= max_bytes
    )


def size_class(dtype: str, n: int) -> str:
    """The row-length class of softmax's and cross-entropy's tuning-table rows (and the
    norm backwards'): "small" (4096 <= N <= 8192: one CTA of 64-128 threads a row), "mid"
    (8192 < N <= 16384: one 256-thread CTA, or 2 with the softmax backward's budget),
    "cluster" (16384 < N <= 131072), "large" (N > 131072: clusters of 16), "tiny" (N <
    4096); float32 rows their own classes ("f32/<class>"), so a 16-bit row never reaches
    them. Every problem has a class, so ``quack tune`` can write any winner; a class
    without a row for a kernel keeps that kernel's own default."""
    if 4096 <= n <= 8192:
        cls = "small"
    elif 8192 < n <= 16384:
        cls = "mid"
    elif n > 131072:
        cls = "large"
    else:
        cls = "cluster" if n > 16384 else "tiny"
    return f"f32/{cls}" if dtype == "float32" else cls
    if 4096 <= n <= 8192:
        return "small"
    if 8192 < n <= 16384:
        return "mid"
    if n > 131072:
        return "large"
    return None
