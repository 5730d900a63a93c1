"""CPU tier: round 8's LayerNorm forward default for 16-bit rows of one 256-thread CTA with an
fp32 weight / bias (issue 14 part 6; the sweep, benchmarks/tune_k8i.py, is at commit bfa2a86):
``_ln_row.ROW_CTA["wide"]`` names a measured knob set (N = 16384: ``ROW_CTA_BY_N``), reaches exactly N = 10240 / 12288 /
14336 / 16384 with bf16 / fp16 x and an fp32 weight, and its kernel compiles for sm_90a with
two rows a CTA and the first two w / b vectors loaded before the reductions ("wb_ahead", read
back from the PTX)."""

import os
import re

import pytest
from _cases import layernorm_fwd_ptx

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from quack_kernels import _ln_row  # noqa: E402


def test_row_cta_wide_names_a_measured_variant_with_two_vectors_ahead():
    kn = _ln_row.ROW_CTA_VARIANTS[_ln_row.ROW_CTA["wide"]]
    assert kn == {"x_smem": True, "x_rows": 2, "x_min_blocks": 3, "wb_ahead": 2}


def test_row_cta_wide_reaches_only_16bit_rows_of_one_cta_with_an_fp32_weight():
    reached = {
        (dt, w, n)
        for dt in ("bfloat16", "float16", "float32")
        for w in ("same", "float32", "bfloat16", "float16")
        for n in range(8192, 16385)
        if _ln_row.fwd_knobs(dt, n, w, {}).get("wb_ahead")
    }
    want = {(dt, "float32", n) for dt in ("bfloat16", "float16") for n in (10240, 12288, 14336, 16384)}
    assert reached == want
    kn = _ln_row.fwd_knobs("bfloat16", 14336, "float32", {})
    assert kn["ring"] is False and kn["x_rows"] == 2 and kn["wb_ahead"] == 2
    # N = 16384 has a key of its own (ROW_CTA_BY_N): four rows a 512-thread CTA
    kn = _ln_row.fwd_knobs("bfloat16", 16384, "float32", {})
    assert kn["ring"] is False and kn["x_rows"] == 4 and kn["wb_ahead"] == 4 and kn["threads"] == 512
    assert set(_ln_row.ROW_CTA_BY_N) == {("wide", 16384)}
    # the same-dtype default is not touched
    assert "wb_ahead" not in _ln_row.fwd_knobs("bfloat16", 16384, "same", {})


@pytest.mark.parametrize(("n", "nvec"), [(14336, 7), (10240, 5)])
def test_row_cta_wide_kernel_loads_two_wb_vectors_before_the_reductions(tmp_path, n, nvec):
    ptx = layernorm_fwd_ptx(tmp_path, f"'bfloat16', {n}, True, True, 'float32'")
    body = ptx[ptx.index(".entry") :]
    first_wait = body.index("cp.async.wait_group")
    # 2 vectors of fp32 w and of b (8 fp32 a vector: 2 16-byte loads each) ahead of the first
    # row's wait; the rest of them (nvec - 2 vectors) in the y loop
    assert len(re.findall(r"ld\.global\.v4", body[:first_wait])) == 2 * 2 * 2
    assert len(re.findall(r"ld\.global\.v4", body[first_wait:])) == 2 * 2 * (nvec - 2)
    assert len(re.findall(r"st\.global\.v4", body)) == 2 * nvec  # 2 rows x nvec vectors of y


def test_n16384_kernel_reads_each_wb_vector_once_for_four_rows_all_ahead(tmp_path):
    """ROW_CTA_BY_N[("wide", 16384)]: 4 vectors a thread (512 threads x 8 x 4 = 16384), all
    of a thread's w / b loaded before the first row's wait, none in the y loop; y of four
    rows stored."""
    ptx = layernorm_fwd_ptx(tmp_path, "'bfloat16', 16384, True, True, 'float32'")
    body = ptx[ptx.index(".entry") :]
    first_wait = body.index("cp.async.wait_group")
    assert len(re.findall(r"ld\.global\.v4", body[:first_wait])) == 4 * 2 * 2
    assert len(re.findall(r"ld\.global\.v4", body[first_wait:])) == 0
    assert len(re.findall(r"st\.global\.v4", body)) == 4 * 4  # 4 rows x 4 vectors of y
