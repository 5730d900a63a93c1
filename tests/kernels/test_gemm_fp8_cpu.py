"""CPU tier of the fp8 GEMM (``quack_kernels.ops.scaled_gemm``; its GPU tier is
test_gemm_fp8_gpu.py): the rules and the search space of promoted and fast accumulation,
torch inputs refused by name, the fake implementation under torch.compile, and the PTX of
the promoted mainloop."""

import os

import pytest
from _fixtures import module_ptx, session_ptx  # noqa: F401  (fixtures, used by name)

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
torch = pytest.importorskip("torch")

E4M3 = torch.float8_e4m3fn


def _t(shape, dtype=torch.bfloat16):
    return torch.zeros(shape, dtype=dtype)


def _ptx_cases() -> dict:
    from quack_kernels._configs import GemmConfig
    from quack_kernels.gemm import compile_gemm

    coop = GemmConfig(tile_m=128, tile_n=128, cluster_m=1, cluster_n=1, schedule="coop")
    # fp8 with its products promoted into an fp32 total (fast_accum off), with a bias: the
    # scale and the bias in one pass over the accumulator
    fp8 = dict(dtype="float8_e4m3fn", d_dtype="bfloat16", has_bias=True, config=coop)
    return {"fp8-promoted": (compile_gemm, fp8)}


#: the PTX these tests read (_fixtures.session_ptx: one batch with the other modules' cases)
PTX_CASES = _ptx_cases()


def test_promoted_fp8_searches_the_tiles_that_hold_two_accumulators():
    """fp8 products promoted into an fp32 total (fast_accum off) hold two accumulators:
    only 128x128 and 128x192 cooperative tiles leave registers for them; the search space,
    the heuristic and the rules agree on it."""
    from quack_kernels._configs import GemmConfig
    from quack_kernels._gemm_plan import heuristic
    from quack_kernels.gemm import compile_gemm, search_space

    from quack.errors import ParamError

    bound = compile_gemm.spec.bind(("float8_e5m2",), {}, arch="sm_90a")
    cands = search_space(bound)
    assert {(c.tile_m, c.tile_n, c.schedule) for c in cands} == {(128, 128, "coop"), (128, 192, "coop")}
    # both on each cluster, then 128x192 with each swizzled order, then their stream-K twins
    assert len(cands) == 2 * 3 + 12 + (3 + 12)
    assert len(set(cands)) == len(cands)
    for cfg in cands:
        compile_gemm.spec.bind(("float8_e5m2",), {"config": cfg}, arch="sm_90a")
    for m, n, k in ((8192, 8192, 8192), (256, 256, 4096)):
        cfg = GemmConfig(**heuristic(m, n, k, promote=True))
        compile_gemm.spec.bind(("float8_e4m3fn",), {"config": cfg}, arch="sm_90a")
    assert bound["config"] == GemmConfig(**heuristic(8192, 8192, 8192, promote=True))
    big = GemmConfig(tile_m=128, tile_n=256, cluster_m=2, cluster_n=1, schedule="coop")
    with pytest.raises(ParamError, match="promoted fp8"):
        compile_gemm.spec.bind(("float8_e4m3fn",), {"config": big}, arch="sm_90a")
    compile_gemm.spec.bind(("float8_e4m3fn",), {"config": big, "fast_accum": True}, arch="sm_90a")


@pytest.mark.parametrize(
    "params, field",
    [
        ({"b_major": "n"}, "b_major"),
        ({"a_major": "m"}, "a_major"),
    ],
)
def test_fp8_operands_must_be_k_major(params, field):
    from quack_kernels.gemm import compile_gemm

    from quack.errors import ParamError

    with pytest.raises(ParamError, match=f"{field} = .* fp8 . is read K-major only"):
        compile_gemm.spec.bind(("float8_e4m3fn",), params, arch="sm_90a")
    compile_gemm.spec.bind(("bfloat16",), params, arch="sm_90a")  # 16-bit: either order


def test_fast_accum_is_refused_for_16_bit_operands():
    from quack_kernels.gemm import compile_gemm

    from quack.errors import ParamError

    with pytest.raises(ParamError, match="fast_accum = True .* fp8 operands only"):
        compile_gemm.spec.bind(("bfloat16",), {"fast_accum": True}, arch="sm_90a")


def test_promoted_fp8_adds_each_stage_into_an_fp32_total_after_its_mmas(module_ptx):  # noqa: F811
    """fp8 WGMMA keeps fewer mantissa bits in its accumulator than fp32 (_gemm_plan.promotes):
    a stage's four k32 MMAs start a fresh partial sum (the first with scale-d off), all of
    them finish (wait_group 0: none left in flight), and the partial sum is added to the
    total in fp32, one add a register. The scales are read once, and the accumulator
    scaled with them once a tile."""
    import re

    text = module_ptx["fp8-promoted"]
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3", text)
    assert len(mmas) == 4, len(mmas)  # K_BYTES (128) of fp8 a stage: 4 x k32
    # the scale-d predicate of each MMA: 0 (start afresh) for the first, 1 for the others
    regs = re.findall(r"setp\.ne\.b32 p, (%r\d+), 0;\s*wgmma\.mma_async", text)
    flags = [re.search(rf"mov\.b32\s+{r}, (\d+);", text)[1] for r in regs]
    assert flags == ["0", "1", "1", "1"], flags
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", text)
    assert waits == ["0"], waits  # no batch in flight across stages: the adds read it
    # the stage loop's rest: from the wait to its back edge (a branch to a label above it)
    at = text.index("wgmma.wait_group")
    back = next(
        m for m in re.finditer(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", text[at:]) if text.index(m[1] + ":") < at
    )
    body = text[at : at + back.start()]
    acc = 64 * 128 // 128  # a warpgroup's half of a 128 x 128 tile: 64 registers
    assert len(re.findall(r"\badd\.f32\b", body)) == acc, "the partial sums are not added in fp32"
    assert len(re.findall(r"ld\.global(?:\.\w+)*\.b32", text)) >= 2  # scale_a, scale_b


def _f8(shape, dtype=E4M3):
    return torch.zeros(shape).to(dtype)


def _s(v=1.0):
    return torch.tensor([v])


def test_fp8_operands_with_scales_pass_and_default_to_a_bfloat16_output():
    from quack_kernels._gemm_args import check

    a, b = _f8((64, 32)), _f8((48, 32)).t()  # b (K, N) column-major: the (N, K) weight
    g = check(a, b, None, "none", None, None, 1.0, _s(), _s(), fast_accum=True)
    assert (g.dtype, g.d_dtype, g.out_dtype, g.scaled) == ("float8_e4m3fn", "bfloat16", torch.bfloat16, True)
    assert (g.a_major, g.b_major) == ("k", "k")
    g = check(_f8((2, 64, 32), torch.float8_e5m2), _f8((2, 48, 32), torch.float8_e5m2).transpose(1, 2),
              None, "none", torch.float32, None, 1.0, _s(), _s())  # fmt: skip
    assert (g.dtype, g.d_dtype, g.batch) == ("float8_e5m2", "float32", 2)


@pytest.mark.parametrize(
    "args, kw, exc, match",
    [
        ((_f8((64, 32)), _f8((48, 32)).t()), {}, TypeError, "fp8 operands need their per-tensor scales"),
        (
            (_t((64, 32)), _t((32, 48))),
            {"scale_a": _s(), "scale_b": _s()},
            TypeError,
            "scaled_gemm takes fp8",
        ),
        ((_f8((64, 32)), _f8((48, 32)).t()), {"scale_a": 1.0, "scale_b": _s()}, TypeError, "scale_a must be"),
        (
            (_f8((64, 32)), _f8((48, 32)).t()),
            {"scale_a": _s(), "scale_b": torch.ones(2)},
            ValueError,
            r"scale_b must be a float32 tensor of one element.*shape \(2,\)",
        ),
        (
            (_f8((64, 32)), _f8((48, 32)).t()),
            {"scale_a": _s().double(), "scale_b": _s()},
            ValueError,
            "scale_a must be a float32",
        ),
        (
            (_f8((64, 32)), _f8((32, 48))),  # b row-major: fp8 WGMMA cannot read it
            {"scale_a": _s(), "scale_b": _s()},
            ValueError,
            "fp8 a must be row-major .* and b column-major",
        ),
        (
            (_f8((64, 32)), _f8((48, 32), torch.float8_e5m2).t()),
            {"scale_a": _s(), "scale_b": _s()},
            TypeError,
            "a and b must share one dtype",
        ),
        (
            (_f8((64, 40)), _f8((48, 40)).t()),  # K = 40 one-byte elements: rows of 40 bytes
            {"scale_a": _s(), "scale_b": _s()},
            ValueError,
            "a: stride 40 of dim 0 is 40 bytes.*multiple of 16 elements",
        ),
        ((_t((64, 32)), _t((32, 48))), {"fast_accum": True}, ValueError, "fast_accum=True applies to fp8"),
    ],
)
def test_bad_fp8_inputs_name_the_argument(args, kw, exc, match):
    from quack_kernels._gemm_args import check

    with pytest.raises(exc, match=match):
        check(*args, None, "none", None, None, 1.0, **kw)


def test_scaled_gemm_fake_implementation_and_no_backward():
    from quack_kernels.ops import gemm, scaled_gemm

    a = torch.empty(1000, 784, device="meta").to(E4M3)
    b = torch.empty(1048, 784, device="meta").to(E4M3).t()
    sa, sb = torch.ones(1, device="meta"), torch.ones(1, device="meta")
    d = scaled_gemm(a, b, sa, sb)
    assert d.shape == (1000, 1048) and d.dtype == torch.bfloat16
    assert scaled_gemm(a, b, sa, sb, out_dtype=torch.float32, fast_accum=True).dtype == torch.float32
    with pytest.raises(TypeError, match="fp8 operands need their per-tensor scales"):
        gemm(a, b)  # the 16-bit op names the fp8 one
    with pytest.raises(TypeError, match="scaled_gemm takes fp8"):
        scaled_gemm(a.bfloat16(), b.bfloat16(), sa, sb)
    with pytest.raises(TypeError, match="scale_b must be a float32 tensor"):
        scaled_gemm(a, b, sa, 2.0)
    with pytest.raises(ValueError, match="expected"):
        scaled_gemm(a, b[:700], sa, sb)
    out = scaled_gemm(a.requires_grad_(), b, sa, sb)
    with pytest.raises(NotImplementedError, match="scaled_gemm has no backward"):
        out.float().sum().backward()


def test_the_fp8_op_traces_whole_under_torch_compile():
    """scaled_gemm is one node of a fullgraph trace (its fake implementation), as gemm is."""
    from quack_kernels.ops import scaled_gemm

    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    a = torch.empty(256, 128, device="meta").to(E4M3)
    b = torch.empty(64, 128, device="meta").to(E4M3).t()
    s = torch.ones(1, device="meta")
    fn = torch.compile(
        lambda a, b: scaled_gemm(a, b, s, s, activation="relu"), backend=backend, fullgraph=True
    )
    assert fn(a, b).shape == (256, 64)
    assert seen == ["quack_kernels.scaled_gemm.default"], seen


def test_torchs_product_of_two_e5m2_operands_is_matmul_in_fp32(monkeypatch):
    """torch._scaled_mm on CUDA refuses two e5m2 operands ("Multiplication of two
    Float8_e5m2 matrices is not supported": cuBLASLt has no such kernel; the GPU test
    failed there, in the reference). Its CPU build accepts them, so the refusal is played
    here by a stand-in that raises cuBLAS's error for that pair and records the others.
    check_gemm's torch product for two e5m2 operands is torch.matmul in fp32, scaled: every
    e5m2 value and product is exact there, so it equals the float64 product, batched too;
    e4m3 still goes to torch._scaled_mm."""
    from quack_kernels import _reference as R

    calls = []

    def scaled_mm(x, y, *args, **kw):
        if x.dtype == y.dtype == torch.float8_e5m2:
            raise ValueError("Multiplication of two Float8_e5m2 matrices is not supported")
        calls.append((x.dtype, y.dtype))
        return torch.matmul(x.float(), y.float())

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    g = torch.Generator().manual_seed(0)
    sa, sb = torch.tensor([0.5]), torch.tensor([0.25])
    for shape_a, shape_b in (((40, 64), (64, 32)), ((2, 8, 32), (2, 32, 16))):
        a = torch.randn(shape_a, generator=g).to(torch.float8_e5m2)
        b = torch.randn(shape_b, generator=g).to(torch.float8_e5m2)
        got = R._scaled_mm(a, b, sa, sb, fast_accum=False)
        want = torch.matmul(a.double(), b.double()) * 0.125
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6)
    assert calls == []
    a, b = torch.zeros(16, 32).to(E4M3), torch.zeros(32, 16).to(E4M3)
    R._scaled_mm(a, b, sa, sb, fast_accum=False)
    assert calls == [(E4M3, E4M3)]
