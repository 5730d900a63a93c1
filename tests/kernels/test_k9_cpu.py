"""CPU tier: round 9's pipelined ring forward (issue 14 part 6; kernels/_ring_pipe.py, the
sweeps benchmarks/prof_k9.py at commit 499a617). Which LayerNorm rows it reaches
(``_ln_row.ROW_CLUSTER`` / ``ROW_CLUSTER_BY_N``), its configuration (``_norm_fwd.ring_cfg``:
knobs "ring_pipe" / "ring_wregs", the reducer's 8 stages, 3+ x stages, what shared memory
holds), the knobs' errors, the occupancy query's shared-memory share, and the compiled
kernel (sm_90a PTX): one thread's partials pushed to the 16 CTAs of the cluster, the bias in
registers, the weight in shared memory."""

import os
import re

import pytest
from _cases import layernorm_fwd_ptx

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from quack_kernels import _ln_row, layernorm, rmsnorm  # noqa: E402
from quack_kernels._norm_fwd import SMEM_MAX, reducer_bytes, ring_cfg, ring_plan  # noqa: E402
from quack_kernels._plan import plan_rows  # noqa: E402

CLASS16 = [n for n in range(131072 + 8, 262145, 8192) if plan_rows(n, 16).cluster_n == 16] + [262144]


def _pipe(kn):
    return bool(kn.get("ring_pipe"))


def test_fp32_weight_rows_over_16_ctas_take_the_pipelined_ring():
    for dt in ("bfloat16", "float16"):
        for n in CLASS16:
            kn = _ln_row.fwd_knobs(dt, n, "float32", {})
            assert _pipe(kn) and kn["ring_wregs"] == "b" and kn["stages"] == 3, (dt, n)
            # where the ring does not apply (uneven tiling), the two-row x-in-shared-memory kernel
            assert kn["x_rows"] == 2 and kn["x_smem_cluster"]
    # the same-dtype rows: only N = 262144 (measured: slower at 196608, no faster at 163840)
    reached = {
        (dt, n)
        for dt in ("bfloat16", "float16")
        for n in CLASS16
        if _pipe(_ln_row.fwd_knobs(dt, n, "same", {}))
    }
    assert reached == {("bfloat16", 262144), ("float16", 262144)}
    assert _ln_row.fwd_knobs("bfloat16", 262144, "same", {})["stages"] == 4
    assert "ring_wregs" not in _ln_row.fwd_knobs("bfloat16", 262144, "same", {})
    # not for fp32 rows, shorter rows, a bf16 weight beside fp16 rows at other N, or RMSNorm
    assert not _pipe(_ln_row.fwd_knobs("float32", 262144, "same", {}))
    assert not _pipe(_ln_row.fwd_knobs("bfloat16", 65536, "float32", {}))
    assert not _pipe(_ln_row.fwd_knobs("float16", 196608, "bfloat16", {}))
    # RMSNorm: below 262144 (rmsnorm.WIDE_FWD_BY_N, the last test) the one-row ring
    assert rmsnorm.fwd_ring_cfg("bfloat16", 196608, True, False, False, "float32")["pipe"] is False
    # the benchmarks' baseline switch still leaves it out
    assert not _pipe(_ln_row.fwd_knobs("bfloat16", 262144, "float32", {"row_cta": False}))


@pytest.mark.parametrize(
    ("w", "b", "wdt", "smem_wb"),
    [
        (True, True, "float32", 1),
        (True, False, "float32", 1),
        (False, True, "float32", 0),
        (True, True, "same", 2),
    ],
)
def test_ring_cfg_of_the_defaults(w, b, wdt, smem_wb):
    """The LayerNorm configuration the forward compiles: the pipeline, 8 reducer stages (4 rows of
    (mean, M2) pairs in flight), and shared memory = reducer + the slices kept there (the
    fp32 weight; not the bias, in registers) + x stages, within one CTA an SM."""
    cfg = layernorm.fwd_ring_cfg("bfloat16", 262144, w, b, wdt)
    assert cfg["pipe"] is True and cfg["red_stages"] == 8 and cfg["ctas_per_sm"] == 1
    assert cfg["wregs"] == ("b" if wdt == "float32" else "")
    plan = ring_plan(262144, "bfloat16", cfg)
    assert plan.cluster_n == 16 and plan.num_threads == 256
    wbits = 32 if wdt == "float32" else 16
    assert cfg["stages"] == (3 if wdt == "float32" else 4)
    want = reducer_bytes(plan, 8) + smem_wb * plan.tile_n * wbits // 8 + cfg["stages"] * plan.tile_n * 2
    assert cfg["smem_bytes"] == want <= SMEM_MAX


def test_pipeline_knobs_are_checked():
    with pytest.raises(ValueError, match="ring_wregs='x'"):
        ring_cfg(
            "layer", "bfloat16", 262144, True, True, False, "float32", {"ring_pipe": True, "ring_wregs": "x"}
        )
    with pytest.raises(ValueError, match="only with ring_pipe"):
        ring_cfg("layer", "bfloat16", 262144, True, True, False, "float32", {"ring_wregs": "b"})
    # w AND b (fp32, 128 KiB) in shared memory leave room for 2 x stages: no pipelined ring
    assert ring_cfg("layer", "bfloat16", 262144, True, True, False, "float32", {"ring_pipe": True}) is None
    on = {"ring_pipe": True, "ring_wregs": True}  # True: both in registers
    assert ring_cfg("layer", "bfloat16", 262144, True, True, False, "float32", on)["wregs"] == "wb"
    # no cluster (one 256-thread CTA a row): the clusterless ring, never pipelined
    one = ring_cfg("layer", "bfloat16", 16384, True, True, False, "float32", {"ring_pipe": True})
    assert one is None or one["pipe"] is False


def test_pipelined_kernel_pushes_partials_and_keeps_the_bias_in_registers(tmp_path):
    """The default fp32-w + b kernel at 262144: st.async of each warp's (mean, M2) to the
    cluster's 16 CTAs (2 values a lane, in two places: the first row before the loop and row
    it+1 inside it); the fp32 bias read from global memory once, before the loop (16 loads:
    64 fp32 a thread); the weight staged into shared memory (16-byte stores) and read back
    there; 3 x stages of 16-byte cp.async (8 a thread a row)."""
    ptx = layernorm_fwd_ptx(tmp_path, "'bfloat16', 262144, True, True, 'float32'")
    body = ptx[ptx.index(".entry") :]
    assert len(re.findall(r"st\.async\.shared::cluster\.mbarrier::complete_tx::bytes\.f32", body)) == 2 * 2
    assert len(re.findall(r"ld\.global\.v4", body)) == 2 * 16  # w staged + b into registers
    assert len(re.findall(r"cp\.async\.cg\.shared\.global", body)) == 8 * 3  # prologue (2 rows) + refill
    assert len(re.findall(r"ld\.shared\.v4\.b32", body)) >= 16  # the fp32 weight, 2 a vector


def test_rmsnorm_fp32_weight_at_262144_takes_the_pipelined_ring_over_clusters_of_8():
    """``rmsnorm.WIDE_FWD_BY_N``: 16-bit x with a wider weight at N = 262144 only; the row over
    8 CTAs of 512 threads (64 elements a thread, as over 16 CTAs of 256), the weight (and
    bias) in registers, 3 x stages, no weight in shared memory."""
    for dt in ("bfloat16", "float16"):
        kn = rmsnorm.fwd_knobs(dt, 262144, "float32", {})
        assert kn["ring_threads"] == 512 and kn["ring_pipe"] and kn["ring_wregs"] is True
        for n in CLASS16[:-1]:
            assert "ring_threads" not in rmsnorm.fwd_knobs(dt, n, "float32", {})
    assert "ring_threads" not in rmsnorm.fwd_knobs("bfloat16", 262144, "same", {})
    assert "ring_threads" not in rmsnorm.fwd_knobs("float32", 262144, "float16", {})
    for b in (False, True):
        cfg = rmsnorm.fwd_ring_cfg("bfloat16", 262144, True, b, False, "float32")
        assert cfg["pipe"] and cfg["wregs"] == "wb" and cfg["threads"] == 512 and cfg["stages"] == 3
        plan = ring_plan(262144, "bfloat16", cfg)
        assert (plan.cluster_n, plan.num_threads, plan.threads_per_row, plan.elems_per_thread) == (
            8,
            512,
            512,
            64,
        )
        assert plan.even and cfg["smem_bytes"] == reducer_bytes(plan, 4) + 3 * plan.tile_n * 2 <= SMEM_MAX
    # a residual keeps the one-row-tile path (no ring)
    assert rmsnorm.fwd_ring_cfg("bfloat16", 262144, True, False, True, "float32") is None
