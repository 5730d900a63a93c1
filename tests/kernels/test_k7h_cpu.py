"""CPU tier: round 7's LayerNorm forward for rows of 2+ a CTA with a wider weight (issue 14
part 6; the sweep, benchmarks/tune_k7h.py, is at commit e3992f2): which rows
``_ln_row.ROW_SMALL`` reaches, the plan its "row_budget" knob gives, and that its kernels
compile for sm_90a with every weight / bias combination and the w / b loads issued ahead of
the reductions ("wb_ahead", read back from the PTX)."""

import os
import re

import pytest
from _cases import layernorm_fwd_ptx

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from quack_kernels import _ln_row, layernorm  # noqa: E402
from quack_kernels._plan import plan_rows  # noqa: E402


def test_row_small_default_names_a_measured_variant():
    assert set(_ln_row.ROW_SMALL) <= {"same", "wide"}
    for label in _ln_row.ROW_SMALL.values():
        assert label in _ln_row.ROW_SMALL_VARIANTS


def test_row_small_reaches_only_16bit_rows_of_3072_and_4096_with_a_wider_weight():
    label = _ln_row.ROW_SMALL["wide"]
    want = _ln_row.ROW_SMALL_VARIANTS[label]
    reached = {
        (dt, w, n)
        for dt in ("bfloat16", "float16", "float32")
        for w in ("same", "float32", "bfloat16", "float16")
        for n in range(1, 8193)
        if _ln_row.fwd_knobs(dt, n, w, {}).get("row_budget")
    }
    assert reached == {(dt, "float32", n) for dt in ("bfloat16", "float16") for n in (3072, 4096)}
    assert _ln_row.fwd_knobs("bfloat16", 4096, "float32", {}) == want
    # the benchmark knobs go over it; "row_cta": False leaves every table out
    assert _ln_row.fwd_knobs("bfloat16", 4096, "float32", {"x_min_blocks": 2})["x_min_blocks"] == 2
    assert _ln_row.fwd_knobs("bfloat16", 4096, "float32", {"row_cta": False}) == {"row_cta": False}
    # no ring there (it would replace the kernel): rows of one 128-thread CTA
    assert layernorm.fwd_ring_cfg("bfloat16", 4096, True, True, "float32") is None


@pytest.mark.parametrize("n", (3072, 4096))
def test_row_budget_gives_one_row_a_cta(n):
    base = _ln_row.row_plan(n, 16, {})
    assert base == plan_rows(n, 16, budget=64) and base.rows_per_cta == 2
    p = _ln_row.row_plan(n, 16, {"row_budget": 32})
    assert (p.rows_per_cta, p.num_threads, p.even, p.vec) == (1, 128, True, 8)
    assert _ln_row.x_smem_ok(p, 16, _ln_row.ROW_SMALL_VARIANTS[_ln_row.ROW_SMALL["wide"]])


@pytest.mark.parametrize(("w", "b"), [(True, True), (True, False), (False, True)])
def test_row_small_kernel_compiles_and_loads_wb_before_the_reductions(tmp_path, w, b):
    ptx = layernorm_fwd_ptx(tmp_path, f"'bfloat16', 4096, {w}, {b}, 'float32'")
    body = ptx[ptx.index(".entry") :]
    # 4 rows' cp.async, then every w / b vector of the thread (4 a tensor: 2 16-byte loads
    # each), then the first reduction's wait; y's 16-byte stores after it
    first_wait = body.index("cp.async.wait_group")
    loads = re.findall(r"ld\.global\.v4", body[:first_wait])
    assert len(loads) == 8 * (int(w) + int(b))
    assert "ld.global" not in body[first_wait:]
    assert len(re.findall(r"st\.global\.v4", body)) == 4 * 4  # 4 rows x 4 vectors
