"""The typed launch configurations of the kernel families (docs/tuning.md).

Each field is a knob the compile function reads; ``None`` = the kernel's own heuristic
(the plan-derived default written beside the ``.get`` that reads it). The defaults come
from the tuning tables (``kernels/tuned/<arch>.toml`` through ``_tuning.default_config``);
``quack tune`` searches the candidates each family's ``search_space`` declares."""

import dataclasses

from quack.params import Bool, Choice, Int
from quack.tuning import TuneConfig, knob

_MB = Int(min=0, max=32)  # CTAs / SM asked of ptxas (0: none asked)
_WREGS = Choice(("w", "b", "wb"))
# cache hints of a load: "<L1 eviction>:<L2 policy>", either side may be empty (_cachehint)
_EVICT = ("", "first", "last", "no_allocate", "unchanged")
_L2 = ("", "evict_first", "evict_last", "normal")
HINTS = tuple(f"{e}:{p}" for e in _EVICT for p in _L2 if e or p)


def hint_spec(h):
    """A hint string ("last:evict_last") -> the ``_cachehint.io_copy`` spec dict, or None."""
    if h is None:
        return None
    e, p = h.split(":")
    return {k: v for k, v in (("evict", e), ("l2", p)) if v}


@dataclasses.dataclass(frozen=True)
class RingKnobs(TuneConfig):
    """The persistent ring forward's knobs (``_norm_fwd.ring_cfg``)."""

    ring: bool | None = knob(Bool(), "the ring forward at all (False: one row tile a CTA)")
    ring_min_cluster: int | None = knob(Int(min=2, max=16), "smallest cluster the ring is used for")
    ring_same: bool | None = knob(Bool(), "RMSNorm: the ring with same-width weights too")
    ring_clusterless: bool | None = knob(Bool(), "the ring for rows of one 256-thread CTA")
    stages: int | None = knob(Int(min=1, max=8), "x stages in shared memory (max)")
    smem_kb: int | None = knob(Int(min=16, max=227), "shared memory the ring is sized by (KiB)")
    wide_perm: bool | None = knob(Bool(), "conflict-free layout of a wide weight in shared memory")
    ring_clusters: int | None = knob(Int(min=1, max=1024), "a fixed grid of clusters")
    ring_pipe: bool | None = knob(Bool(), "two rows in flight a CTA (_ring_pipe)")
    ring_wregs: str | None = knob(_WREGS, "with ring_pipe: w / b slices kept in registers")
    ctas_per_sm: int | None = knob(Int(min=1, max=8), "ring CTAs per SM")
    ring_budget: int | None = knob(Int(choices=(32, 64, 128)), "ring elements a thread")
    ring_threads: int | None = knob(Int(choices=(256, 512)), "ring threads a CTA")


@dataclasses.dataclass(frozen=True)
class RmsNormFwdConfig(RingKnobs):
    stage_wb: bool | None = knob(Bool(), "w / b cp.async'ed into shared memory")
    min_blocks: int | None = knob(_MB, "CTAs / SM, staged path")
    late_min_blocks: int | None = knob(_MB, "CTAs / SM, element-wise wide weight path")
    x_smem: bool | None = knob(Bool(), "x through shared memory")
    x_smem_min_cluster: int | None = knob(Int(min=1, max=16), "x_smem from this cluster size up")
    x_smem_wide: bool | None = knob(Bool(), "x_smem with a weight wider than x")
    x_ca: bool | None = knob(Bool(), "x's cp.async through L1 (.ca)")
    x_w_regs: bool | None = knob(Bool(), "x_smem: the weight in registers")
    x_min_blocks: int | None = knob(_MB, "x_smem: CTAs / SM")
    x_rows: int | None = knob(Int(min=1, max=8), "x_smem: rows a CTA")


@dataclasses.dataclass(frozen=True)
class LayerNormFwdConfig(RingKnobs):
    threads: int | None = knob(Int(choices=(256, 512)), "the one-CTA row over this many threads")
    row_budget: int | None = knob(Int(choices=(16, 32, 64)), "row elements a thread of the plan")
    stage_wb: bool | None = knob(Bool(), "w / b cp.async'ed into shared memory")
    min_blocks: int | None = knob(_MB, "CTAs / SM, staged path")
    rt_min_blocks: int | None = knob(_MB, "CTAs / SM, register path")
    wb_vec: bool | None = knob(Bool(), "w / b / y one vector at a time (register path)")
    wb_ahead: int | None = knob(Int(min=0, max=8), "w / b vectors loaded ahead (x_rows > 1)")
    x_smem: bool | None = knob(Bool(), "x through shared memory")
    x_smem_cluster: bool | None = knob(Bool(), "x_smem on rows over a cluster too")
    x_ca: bool | None = knob(Bool(), "x's cp.async through L1 (.ca)")
    x_min_blocks: int | None = knob(_MB, "x_smem: CTAs / SM")
    x_rows: int | None = knob(Int(min=1, max=8), "x_smem: rows a CTA")


@dataclasses.dataclass(frozen=True)
class NormBwdConfig(TuneConfig):
    smem: bool | None = knob(Bool(), "the shared-memory backward at all")
    smem_kb: int | None = knob(Int(min=16, max=227), "shared memory the stages are sized by (KiB)")
    smem_min_n: int | None = knob(Int(min=0, max=262144), "the shared-memory path from this N up")
    stages: int | None = knob(Int(min=1, max=8), "pipeline depth (max)")
    w_perm: bool | None = knob(Bool(), "conflict-free layout of w in shared memory")
    w_smem: bool | None = knob(Bool(), "w staged in shared memory")


@dataclasses.dataclass(frozen=True)
class SoftmaxFwdConfig(TuneConfig):
    online: bool | None = knob(Bool(), "one cluster round trip of (max, sum exp) pairs")
    fwd_smem: bool | None = knob(Bool(), "x cp.async'ed into shared memory")
    fwd_min_blocks: int | None = knob(_MB, "CTAs / SM")


@dataclasses.dataclass(frozen=True)
class SoftmaxBwdConfig(TuneConfig):
    bwd_budget: int | None = knob(Int(choices=(8, 16, 32, 64, 128)), "row elements a thread")
    bwd_smem: bool | None = knob(Bool(), "dy / y cp.async'ed into shared memory")
    bwd_min_blocks: int | None = knob(_MB, "CTAs / SM")
    bwd_tpr: int | None = knob(Int(choices=(0, 256, 512, 1024)), "one CTA a row over this many threads")
    bwd_twopass: bool | None = knob(Bool(), "dy / y re-read after the reduction")
    bwd_ld: str | None = knob(Choice(HINTS), "cache hints of the first loads")
    bwd_ld2: str | None = knob(Choice(HINTS), "cache hints of the re-reads")


@dataclasses.dataclass(frozen=True)
class CrossEntropyFwdConfig(TuneConfig):
    stream: bool | None = knob(Bool(), "the streaming forward (_ce_stream)")
    tpr: int | None = knob(Int(choices=(32, 64, 128, 256, 512)), "stream: threads a row")
    cluster: int | None = knob(Int(choices=(1, 2, 4, 8)), "stream: CTAs a row")
    stages: int | None = knob(Int(min=1, max=8), "stream: shared-memory ring depth")
    ctas_per_sm: int | None = knob(Int(min=1, max=16), "stream: CTAs per SM")
    k: int | None = knob(Int(min=1, max=8), "stream: 16-byte vectors a thread a chunk")
    threads: int | None = knob(Int(choices=(128, 256, 512)), "stream: threads a CTA")
    min_n: int | None = knob(Int(min=1, max=262144), "stream: from this N up")
    min_blocks: int | None = knob(_MB, "register path: CTAs / SM on clusters")
    fwd_smem: bool | None = knob(Bool(), "register path: x through shared memory")


@dataclasses.dataclass(frozen=True)
class CrossEntropyBwdConfig(TuneConfig):
    bwd_budget: int | None = knob(Int(choices=(16, 32, 64, 128)), "row elements a thread")
    bwd_smem: bool | None = knob(Bool(), "x cp.async'ed into shared memory")
    bwd_min_blocks: int | None = knob(_MB, "CTAs / SM")


@dataclasses.dataclass(frozen=True)
class GemmConfig(TuneConfig):
    """The Hopper GEMM's launch configuration (``_gemm_plan.resolve``: None = heuristic)."""

    tile_m: int | None = knob(Int(choices=(128, 256)), "CTA tile rows")
    tile_n: int | None = knob(Int(choices=(128, 192, 256)), "CTA tile columns")
    cluster_m: int | None = knob(Int(choices=(1, 2)), "CTAs of a cluster along M (B multicast)")
    cluster_n: int | None = knob(Int(choices=(1, 2)), "CTAs of a cluster along N (A multicast)")
    schedule: str | None = knob(Choice(("coop", "ping")), "consumer warpgroups: one tile split, or ping-pong")
    stages: int | None = knob(Int(min=2, max=12), "A/B stages in shared memory (default: as many as fit)")
    raster_m: bool | None = knob(Bool(), "persistent tile order along M first (with swizzle > 1)")
    swizzle: int | None = knob(
        Int(choices=(1, 2, 4, 8)), "clusters a persistent tile-order swizzle groups (L2 reuse); 1: none"
    )
    stream_k: bool | None = knob(
        Bool(), "the last wave's tiles split along K over every cluster (stream-K; coop only)"
    )
