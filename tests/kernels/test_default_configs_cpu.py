"""CPU tier: which problems each default configuration reaches (the tuning table's rows,
kernels/tuned/sm_90a.toml, by each family's problem class), the plans and gates the
configuration's knobs make, and the checks on knob combinations. Pure Python: nothing
compiles here (generated code: test_generated_code_cpu.py; every search-space candidate
compiling: test_search_space_cpu.py)."""

import subprocess
import sys
from pathlib import Path

import pytest
from _fixtures import h200_rows  # noqa: F401  (a fixture, used by name)
from quack_kernels import _cachehint as ch
from quack_kernels import _ln_row, _norm_bwd, cross_entropy, layernorm, rmsnorm, softmax
from quack_kernels._configs import LayerNormFwdConfig, SoftmaxBwdConfig
from quack_kernels._norm_fwd import SMEM_MAX, reducer_bytes, ring_cfg, ring_plan
from quack_kernels._plan import plan_rows, size_class

# the assertions name the checked-in H200 rows (_fixtures.TABLE_GPU), whatever GPU is here
pytestmark = pytest.mark.usefixtures("h200_rows")

A = "sm_90a"
F32 = "float32"
BF, FP = "bfloat16", "float16"
CLASS16 = [n for n in range(131072 + 8, 262145, 8192) if plan_rows(n, 16).cluster_n == 16] + [262144]


def ln(dt, n, wdt="same", w=True, b=True):
    return layernorm.compile_layernorm_fwd.spec.bind((dt, n, w, b, wdt), {}, arch=A)["config"]


def ln_over(dt, ns, wdt="same"):
    """(n, ``ln(dt, n, wdt)``) for every n of ``ns``, for the exhaustive sweeps (~100k
    problems): one bind gives the other parameters, canonical, and each n goes through the
    very derive callable that bind applies (the configuration parameter's), without
    re-checking the unchanged parameters (a full bind each was 2 x 4 s on 2 cores).
    ``test_sweep_helper_derives_what_bind_does`` holds the two together."""
    spec = layernorm.compile_layernorm_fwd.spec
    base = {k: v for k, v in spec.bind((dt, 4096, True, True, wdt), {}, arch=A).items() if k != "config"}
    derive = spec.params["config"].derive
    for n in ns:
        yield n, derive({**base, "n": n}, A)


def test_sweep_helper_derives_what_bind_does():
    for dt in (BF, FP, F32):
        for w in ("same", F32, BF, FP):
            ns = (1, 100, 3072, 4096, 8192, 10240, 12000, 14336, 16384, 65536, 262144)
            assert [c for _, c in ln_over(dt, ns, w)] == [ln(dt, n, w) for n in ns]


def rms(dt, n, wdt="same", w=True, b=False, r=False):
    return rmsnorm.compile_rmsnorm_fwd.spec.bind((dt, n, w, b, r, wdt), {}, arch=A)["config"]


def sm_bwd(dt, n):
    return softmax.compile_softmax_bwd.spec.bind((dt, n), {}, arch=A)["config"].knobs()


# --------------------------------------------------------------------------- RMSNorm forward


def test_rmsnorm_wide_weight_row_reaches_only_its_cluster_size():
    """16-bit rows with an fp32 weight over clusters of 4: x through shared memory, two rows
    a CTA, the ring off; other cluster sizes, same-width weights and fp32 rows untouched."""
    for dt in (BF, FP):
        c = rms(dt, 65536, F32)
        assert c.knobs() == {
            "ring": False,
            "x_min_blocks": 3,
            "x_rows": 2,
            "x_smem": True,
            "x_smem_wide": True,
        }
        assert rmsnorm.fwd_ring_cfg(dt, 65536, True, False, False, F32, c) is None
        for n in (4096, 16384, 131072):
            assert rms(dt, n, F32).knobs() == {}
        assert rms(dt, 65536).knobs() == {}
    assert rms(F32, 65536).knobs() == {}
    # without the row (the heuristic): the ring
    assert rmsnorm.fwd_ring_cfg(BF, 65536, True, False, False, F32, rmsnorm.RmsNormFwdConfig()) is not None


def test_rmsnorm_fp32_weight_at_262144_takes_the_pipelined_ring_over_clusters_of_8():
    """16-bit x with a wider weight at N = 262144 only: the row over 8 CTAs of 512 threads
    (64 elements a thread), weight and bias in registers, 3 x stages, none in shared memory."""
    for dt in (BF, FP):
        kn = rms(dt, 262144, F32).knobs()
        assert kn["ring_threads"] == 512 and kn["ring_pipe"] and kn["ring_wregs"] == "wb"
        for n in CLASS16[:-1]:
            assert "ring_threads" not in rms(dt, n, F32).knobs()
    assert "ring_threads" not in rms(BF, 262144).knobs()
    assert "ring_threads" not in rms(F32, 262144, FP).knobs()
    for b in (False, True):
        cfg = rmsnorm.fwd_ring_cfg(BF, 262144, True, b, False, F32, rms(BF, 262144, F32, b=b))
        assert cfg["pipe"] and cfg["wregs"] == "wb" and cfg["threads"] == 512 and cfg["stages"] == 3
        plan = ring_plan(262144, BF, cfg)
        assert (plan.cluster_n, plan.num_threads, plan.threads_per_row, plan.elems_per_thread) == (
            8,
            512,
            512,
            64,
        )
        assert plan.even and cfg["smem_bytes"] == reducer_bytes(plan, 4) + 3 * plan.tile_n * 2 <= SMEM_MAX
    # a residual keeps the one-row-tile path (no ring); below 262144, the one-row ring
    c = rms(BF, 262144, F32, r=True)
    assert rmsnorm.fwd_ring_cfg(BF, 262144, True, False, True, F32, c) is None
    assert rmsnorm.fwd_ring_cfg(BF, 196608, True, False, False, F32, rms(BF, 196608, F32))["pipe"] is False


# --------------------------------------------------------------------------- LayerNorm forward


def test_layernorm_one_cta_rows_reach_only_16bit_even_rows_of_one_256_thread_cta():
    same = {"threads": 512, "x_min_blocks": 3, "x_smem": True}
    for dt in (BF, FP):
        for n in (10240, 12288):
            assert ln(dt, n).knobs() == same
            assert ln(dt, n, F32).knobs() == {
                "ring": False,
                "wb_ahead": 2,
                "x_min_blocks": 3,
                "x_rows": 2,
                "x_smem": True,
            }
        assert ln(dt, 16384).knobs() == same
        # a column tail, one warp / 128-thread rows, cluster rows: another class
        for n in (12000, 16385, 8192, 65536):
            assert _ln_row.fwd_class(dict(dtype=dt, n=n, weight_dtype="same")) != "same/cta256"
            assert ln(dt, n).knobs() == {}
    assert ln(F32, 16384).knobs() == {}


def test_layernorm_wide_one_cta_row_reaches_exactly_its_rows():
    reached = {
        (dt, w, n)
        for dt in (BF, FP, F32)
        for w in ("same", F32, BF, FP)
        for n, cfg in ln_over(dt, range(8192, 16385), w)
        if cfg.knobs().get("wb_ahead")
    }
    want = {(dt, F32, n) for dt in (BF, FP) for n in (10240, 12288, 14336, 16384)}
    assert reached == want
    kn = ln(BF, 14336, F32).knobs()
    assert kn["ring"] is False and kn["x_rows"] == 2 and kn["wb_ahead"] == 2
    # N = 16384 has a row of its own: four rows a 512-thread CTA
    kn = ln(BF, 16384, F32).knobs()
    assert kn["ring"] is False and kn["x_rows"] == 4 and kn["wb_ahead"] == 4 and kn["threads"] == 512
    assert "wb_ahead" not in ln(BF, 16384).knobs()
    # the row turns the ring off through the compiled configuration; cluster rows keep it
    assert layernorm.fwd_ring_cfg(BF, 16384, True, True, F32, ln(BF, 16384, F32)) is None
    assert layernorm.fwd_ring_cfg(BF, 16384, True, True, F32, LayerNormFwdConfig()) is not None
    assert layernorm.fwd_ring_cfg(BF, 65536, True, True, F32, ln(BF, 65536, F32)) is not None


def test_layernorm_small_rows_reach_only_3072_and_4096_with_a_wider_weight():
    reached = {
        (dt, w, n)
        for dt in (BF, FP, F32)
        for w in ("same", F32, BF, FP)
        for n, cfg in ln_over(dt, range(1, 8193), w)
        if cfg.knobs().get("row_budget")
    }
    assert reached == {(dt, F32, n) for dt in (BF, FP) for n in (3072, 4096)}
    # no ring there (it would replace the kernel): rows of one 128-thread CTA
    assert layernorm.fwd_ring_cfg(BF, 4096, True, True, F32, ln(BF, 4096, F32)) is None


@pytest.mark.parametrize("n", (3072, 4096))
def test_row_budget_gives_one_row_a_cta(n):
    base = _ln_row.row_plan(n, 16, {})
    assert base == plan_rows(n, 16, budget=64) and base.rows_per_cta == 2
    p = _ln_row.row_plan(n, 16, {"row_budget": 32})
    assert (p.rows_per_cta, p.num_threads, p.even, p.vec) == (1, 128, True, 8)
    assert _ln_row.x_smem_ok(p, 16, ln(BF, n, F32).knobs())


def test_layernorm_fp32_weight_rows_over_16_ctas_take_the_pipelined_ring():
    for dt in (BF, FP):
        for n in CLASS16:
            kn = ln(dt, n, F32).knobs()
            assert kn["ring_pipe"] and kn["ring_wregs"] == "b" and kn["stages"] == 3, (dt, n)
            # where the ring does not apply (uneven tiling): the two-row x-in-shared-memory kernel
            assert kn["x_rows"] == 2 and kn["x_smem_cluster"]
    # the same-dtype rows: only N = 262144
    reached = {(dt, n) for dt in (BF, FP) for n in CLASS16 if ln(dt, n).knobs().get("ring_pipe")}
    assert reached == {(BF, 262144), (FP, 262144)}
    assert ln(BF, 262144).knobs()["stages"] == 4 and "ring_wregs" not in ln(BF, 262144).knobs()
    assert not ln(F32, 262144).knobs().get("ring_pipe")
    assert not ln(BF, 65536, F32).knobs().get("ring_pipe")
    assert not ln(FP, 196608, BF).knobs().get("ring_pipe")


@pytest.mark.parametrize(
    ("w", "b", "wdt", "smem_wb"),
    [(True, True, F32, 1), (True, False, F32, 1), (False, True, F32, 0), (True, True, "same", 2)],
)
def test_layernorm_ring_of_the_defaults(w, b, wdt, smem_wb):
    """The pipeline, 8 reducer stages, and shared memory = reducer + the slices kept there
    (the fp32 weight; not the bias, in registers) + x stages, within one CTA an SM."""
    cfg = layernorm.fwd_ring_cfg(BF, 262144, w, b, wdt, ln(BF, 262144, wdt, w, b))
    assert cfg["pipe"] is True and cfg["red_stages"] == 8 and cfg["ctas_per_sm"] == 1
    assert cfg["wregs"] == ("b" if wdt == F32 else "")
    plan = ring_plan(262144, BF, cfg)
    assert plan.cluster_n == 16 and plan.num_threads == 256
    wbits = 32 if wdt == F32 else 16
    assert cfg["stages"] == (3 if wdt == F32 else 4)
    want = reducer_bytes(plan, 8) + smem_wb * plan.tile_n * wbits // 8 + cfg["stages"] * plan.tile_n * 2
    assert cfg["smem_bytes"] == want <= SMEM_MAX


def test_ring_pipeline_knobs_are_checked():
    args = ("layer", BF, 262144, True, True, False, F32)
    with pytest.raises(ValueError, match="ring_wregs='x'"):
        ring_cfg(*args, {"ring_pipe": True, "ring_wregs": "x"})
    with pytest.raises(ValueError, match="only with ring_pipe"):
        ring_cfg(*args, {"ring_wregs": "b"})
    # w AND b (fp32, 128 KiB) in shared memory leave room for 2 x stages: no pipelined ring
    assert ring_cfg(*args, {"ring_pipe": True}) is None
    assert ring_cfg(*args, {"ring_pipe": True, "ring_wregs": True})["wregs"] == "wb"
    one = ring_cfg("layer", BF, 16384, True, True, False, F32, {"ring_pipe": True})
    assert one is None or one["pipe"] is False  # no cluster: never pipelined


def test_row_plan_threads_knob():
    p = _ln_row.row_plan(16384, 16, {"threads": 512})
    assert (p.threads_per_row, p.num_threads, p.cluster_n, p.nvec, p.vec) == (512, 512, 1, 4, 8)
    assert p.even and p.elems_per_thread == 32
    for n in (4096, 16385, 65536):  # not a 256-thread one-CTA even row: unchanged
        assert _ln_row.row_plan(n, 16, {"threads": 512}) == _ln_row.row_plan(n, 16, {})
    assert _ln_row.row_plan(16384, 16, {}).num_threads == 256


def test_x_smem_gates():
    on = {"x_smem": True}
    plan = _ln_row.row_plan(16384, 16, {})
    assert _ln_row.x_smem_ok(plan, 16, on) and not _ln_row.x_smem_ok(plan, 16, {})
    assert not _ln_row.x_smem_ok(_ln_row.row_plan(16385, 16, {}), 16, on)  # tail
    assert not _ln_row.x_smem_ok(_ln_row.row_plan(65536, 16, {}), 16, on)  # cluster
    assert not _ln_row.x_smem_ok(_ln_row.row_plan(16384, 32, {}), 32, on)  # fp32 rows
    # over a cluster: only with its knob, never with a tail
    p = _ln_row.row_plan(262144, 16, {})
    assert p.cluster_n == 16
    assert not _ln_row.x_smem_ok(p, 16, on) and _ln_row.x_smem_ok(p, 16, on | {"x_smem_cluster": True})
    assert not _ln_row.x_smem_ok(_ln_row.row_plan(200000, 16, {}), 16, on | {"x_smem_cluster": True})


# --------------------------------------------------------------------------- norm backward


def test_wide_weight_in_shared_memory_on_rows_of_one_cta():
    p4096, p16384 = _norm_bwd.bwd_plan(BF, 4096), _norm_bwd.bwd_plan(BF, 16384)
    assert (p4096.cluster_n, p16384.cluster_n) == (1, 2)
    assert _norm_bwd.W_SMEM_WIDE_ONE_CTA == {"rms": True, "layer": False}
    assert _norm_bwd.w_smem_ok(p4096, {}, True, "rms")
    assert not _norm_bwd.w_smem_ok(p4096, {}, False, "rms")  # same-width weight
    assert not _norm_bwd.w_smem_ok(p4096, {}, True, "layer")
    assert not _norm_bwd.w_smem_ok(p16384, {}, True, "rms")  # cluster rows
    assert _norm_bwd.w_smem_ok(_norm_bwd.bwd_plan(BF, 262144), {}, False, "rms")
    assert not _norm_bwd.w_smem_ok(p4096, {"w_smem": False}, True, "rms")  # the knob decides


# --------------------------------------------------------------------------- softmax / CE


def test_softmax_bwd_small_class_default_is_torch_compiles_kernel():
    small = {"bwd_twopass": True, "bwd_tpr": 512, "bwd_ld": "last:evict_last", "bwd_ld2": "first:evict_first"}
    for dt in (BF, FP):
        for n in (4096, 4100, 6144, 8192):
            assert sm_bwd(dt, n) == small
        assert sm_bwd(dt, 16384) == {"bwd_min_blocks": 4}
        assert sm_bwd(dt, 4095) == {}
    assert sm_bwd(F32, 4096) == {}
    from quack_kernels._configs import hint_spec

    assert hint_spec(small["bwd_ld"]) == {"evict": "last", "l2": "evict_last"}
    assert hint_spec("first:") == {"evict": "first"} and hint_spec(None) is None


def test_softmax_bwd_plan_512_threads_where_the_row_splits_evenly():
    small = sm_bwd(BF, 4096)
    p = softmax._bwd_plan(BF, 4096, 16, small)
    assert (p.threads_per_row, p.num_threads, p.cluster_n, p.nvec, p.vec) == (512, 512, 1, 1, 8)
    p = softmax._bwd_plan(FP, 8192, 16, small)
    assert (p.threads_per_row, p.num_threads, p.nvec) == (512, 512, 2)
    # a row that does not split into 16-byte vectors over 512 threads keeps the budget's plan
    for n in (4100, 5000, 6144):
        assert softmax._bwd_plan(BF, n, 16, small) == plan_rows(n, 16, budget=32)
    assert softmax._bwd_plan(F32, 4096, 32, {}) == plan_rows(4096, 32, budget=32)
    p = softmax._bwd_plan(BF, 16384, 16, {"bwd_tpr": 1024})  # one CTA a row, not a cluster of 4
    assert (p.threads_per_row, p.cluster_n, p.nvec) == (1024, 1, 2)
    kn = SoftmaxBwdConfig(bwd_tpr=512, bwd_budget=16).knobs()  # > 32 elements a thread: not taken
    assert softmax._bwd_plan(BF, 32768, 16, kn) == plan_rows(32768, 16, budget=16)


def test_l2_policy_operands():
    assert ch.l2_policy(None) is None and ch.l2_policy({"evict": "last"}) is None
    assert ch.l2_policy({"l2": "evict_last"}) == ch.L2_POLICY["evict_last"] == 0x14F0000000000000
    assert ch.l2_policy({"l2": "evict_first"}) == 0x12F0000000000000


def test_softmax_imports_the_cache_hints_only_when_compiling():
    # a kernel module's import is on every fresh process's path: the hints come in with a compile
    src = Path(softmax.__file__).read_text()
    assert "L2_POLICY = " not in src and "def io_copy" not in src
    assert "from . import _cachehint as ch" in src
    code = "import sys, quack_kernels.softmax; print('quack_kernels._cachehint' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False"


def test_size_classes_of_the_measured_shapes():
    assert [size_class(BF, n) for n in (4096, 16384, 262144, 65536, 1000)] == [
        "small",
        "mid",
        "large",
        "cluster",
        "tiny",
    ]
    # fp32 rows have classes of their own: the 16-bit rows' table rows never reach them
    assert size_class(F32, 4096) == "f32/small"
    assert [size_class(FP, n) for n in (4096, 16384, 65536)] == ["small", "mid", "cluster"]
    assert softmax.compile_softmax_bwd.spec.bind((F32, 12288), {}, arch=A)["config"].knobs() == {}
    kn = cross_entropy.compile_cross_entropy_bwd.spec.bind((BF, 16384), {}, arch=A)["config"].knobs()
    assert kn == {"bwd_budget": 128, "bwd_smem": True}
