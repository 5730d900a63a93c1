"""The kernel configurations each GPU test requests, from the GPU tests' own parameters (issue
24 item 2): ``requested()`` walks every test function of tests/kernels/*_gpu.py, expands its
real ``@pytest.mark.parametrize`` marks (the same data pytest runs on a GPU) and maps each case
to the compile calls its torch-facing ops make (``REQUESTS``: the wrappers' compile arguments,
weight_dtype "same" when the weight's dtype is x's). Without a GPU, so a CPU test can prove
that README command 2's manifests hold everything the GPU tests will ask for."""

import glob
import importlib
import itertools
import os

HERE = os.path.dirname(os.path.abspath(__file__))
F32 = "float32"


def _w(x, w):
    return "same" if w in (x, "same") else w


def rms_fwd(x, n, w=True, b=False, r=False, wdt="same"):
    return [
        ("rmsnorm_fwd", dict(dtype=x, n=n, has_weight=w, has_bias=b, has_residual=r, weight_dtype=_w(x, wdt)))
    ]


def rms_bwd(x, n, w=True, b=False, wdt="same"):
    # the backward's weight_dtype is the weight's (none: "same", whatever the bias's dtype)
    return [
        (
            "rmsnorm_bwd",
            dict(dtype=x, n=n, has_weight=w, has_bias=b, weight_dtype=_w(x, wdt) if w else "same"),
        )
    ]


def ln_fwd(x, n, w=True, b=True, wdt="same"):
    return [("layernorm_fwd", dict(dtype=x, n=n, has_weight=w, has_bias=b, weight_dtype=_w(x, wdt)))]


def ln_bwd(x, n, w=True, b=True, wdt="same"):
    return [
        (
            "layernorm_bwd",
            dict(dtype=x, n=n, has_weight=w, has_bias=b, weight_dtype=_w(x, wdt) if w else "same"),
        )
    ]


def softmax(x, n):
    return [("softmax_fwd", dict(dtype=x, n=n)), ("softmax_bwd", dict(dtype=x, n=n))]


def ce(x, n, smoothing="none"):
    return [(k, dict(dtype=x, n=n, smoothing=smoothing)) for k in ("cross_entropy_fwd", "cross_entropy_bwd")]


# test_training_gpu.CE_VARIANTS -> the kernels' smoothing variant (_ce_args.variant: a class
# weight without label smoothing is applied in torch, "none")
CE_SMOOTHING = {"plain": "none", "weighted-smooth": "weighted", "smooth": "uniform", "weighted": "none"}
BF, COMPILE_NS = "bfloat16", (1, 668, 4100, 65536)


def _hook_calls(kernel, dtype):
    """test_reference_hooks_gpu's hook test: the hook of ``kernel`` at its default params, n = 4096."""
    from quack import registry

    importlib.import_module("quack_kernels." + kernel.rsplit("_", 1)[0])
    spec = registry.get(kernel)
    params = spec.plain(spec.bind((), dict(dtype=dtype, n=4096)))
    # the configuration is derived from the tuning table where the test's call binds
    return [(kernel, {k: v for k, v in params.items() if k != "config"})]


def gemm(shape, dt=BF, out=None, am="k", bm="n", act="none", bias=False, c=False, fast=False):
    """``quack_kernels.ops.gemm`` on ``shape`` (L, M, N, K) with b_major in torch's terms
    ("n": b (K, N) row-major); the configuration the wrapper picks (``gemm_config``)."""
    from quack_kernels.gemm import gemm_config

    L, M, N, K = shape
    params = dict(dtype=dt, d_dtype=out or dt, a_major=am, b_major=bm, has_c=c, has_bias=bias, activation=act)
    if fast:
        params["fast_accum"] = True
    return [("gemm", dict(params, config=gemm_config(M, N, K, L, dt, fast)))]


def scaled_gemm(shape, dt, fast=False, out=BF, **epi):
    """``quack_kernels.ops.scaled_gemm``: fp8 a row-major, b column-major (both K-major)."""
    return gemm(shape, dt, out=out, am="k", bm="k", fast=fast, **epi)


def _gemm_cfg(**knobs):
    from quack_kernels._configs import GemmConfig

    return GemmConfig(**knobs)


def _stream_k(swizzle, knobs):
    """The stream-K twin of a large cooperative tile (test_gemm_gpu.py's STREAM_K), K-major B."""
    cfg = _gemm_cfg(
        schedule="coop", swizzle=swizzle, raster_m=True if swizzle else None, stream_k=True, **knobs
    )
    return [("gemm", dict(gemm((1, 64, 64, 64), bm="k")[0][1], config=cfg))]


def gemm_autograd(activation, dt=BF):
    """Forward (bias, act), gelu's recomputed fp32 pre-activation, dA = dD @ B^T (B^T
    K-major), dB = A^T @ dD (A^T M-major), operands of ``dt``."""
    L, M, N, K = odd = (1, 1000, 1048, 776)
    act = activation
    out = gemm(odd, dt, act=act, bias=True) + gemm((L, M, K, N), dt, bm="k") + gemm((L, K, N, M), dt, am="m")
    return out + (gemm(odd, dt, out=F32, bias=True) if act != "none" else [])


# "file::test" -> f(**case params) -> [(kernel, params)]; None: the test requests no cached
# kernel (raw compiles, input validation, driver queries).
REQUESTS = {
    "test_kernels_gpu.py::test_rmsnorm_fwd": lambda dt, n, variant, **_: (
        rms_fwd(dt, n) if variant == "w" else rms_fwd(dt, n, w=False, b=True, r=True)
    ),
    "test_kernels_gpu.py::test_rmsnorm_bwd": lambda dt, n, has_weight, **_: rms_bwd(dt, n, w=has_weight),
    "test_kernels_gpu.py::test_softmax_fwd": lambda dt, n, **_: softmax(dt, n)[:1],
    "test_kernels_gpu.py::test_softmax_bwd": lambda dt, n, **_: softmax(dt, n)[1:],
    "test_kernels_gpu.py::test_layernorm_fwd": lambda dt, n, **_: ln_fwd(dt, n),
    "test_kernels_gpu.py::test_cross_entropy_fwd": lambda dt, n, **_: ce(dt, n)[:1],
    "test_kernels_gpu.py::test_cross_entropy_bwd": lambda dt, n, **_: ce(dt, n)[1:],
    "test_kernels_gpu.py::test_autograd_wrappers": lambda: (
        rms_fwd(BF, 4096) + rms_bwd(BF, 4096) + softmax(F32, 1000) + ce(F32, 1000)
    ),
    "test_kernels_gpu.py::test_eager_calls_skip_the_dispatcher_only_when_nothing_would_differ": lambda: (
        rms_fwd(BF, 4096)
        + rms_bwd(BF, 4096)
        + softmax(F32, 1000)[:1]
        + ce(F32, 1000)[:1]
        + gemm((1, 1000, 1048, 776))
    ),
    "test_kernels_gpu.py::test_bad_inputs": None,
    "test_training_gpu.py::test_rmsnorm_fwd_bwd_weight_dtypes": lambda xdt, wdt, n, **_: (
        rms_fwd(xdt, n, wdt=wdt) + rms_bwd(xdt, n, wdt=wdt)
    ),
    "test_training_gpu.py::test_rmsnorm_bias_residual_fwd_bwd": lambda xdt, wdt, n, **_: (
        rms_fwd(xdt, n, w=False, b=True, r=True, wdt=wdt) + rms_bwd(xdt, n, w=False, b=True)
    ),
    "test_training_gpu.py::test_layernorm_fwd_bwd_weight_dtypes": lambda xdt, wdt, n, **_: (
        ln_fwd(xdt, n, wdt=wdt) + ln_bwd(xdt, n, wdt=wdt)
    ),
    "test_training_gpu.py::test_norm_fwd_every_ring_cluster_size": lambda kind, wdt, n: (
        rms_fwd(BF, n, wdt=wdt) if kind == "rms" else ln_fwd(BF, n, wdt=wdt)
    ),
    "test_training_gpu.py::test_ring_grid_is_the_drivers_occupancy": None,
    "test_training_gpu.py::test_layernorm_bwd_without_affine": lambda n: (
        ln_fwd(BF, n, w=False, b=False) + ln_bwd(BF, n, w=False, b=False)
    ),
    "test_training_gpu.py::test_softmax_fwd_bwd": lambda xdt, n, **_: softmax(xdt, n),
    "test_training_gpu.py::test_cross_entropy_fwd_bwd": lambda variant, xdt, n, **_: ce(
        xdt, n, CE_SMOOTHING[variant]
    ),
    "test_training_gpu.py::test_compile_fullgraph_norms": lambda xdt, wdt: [
        c
        for n in COMPILE_NS
        for c in rms_fwd(xdt, n, r=True, wdt=wdt)
        + rms_bwd(xdt, n, wdt=wdt)
        + ln_fwd(xdt, n, wdt=wdt)
        + ln_bwd(xdt, n, wdt=wdt)
    ],
    "test_training_gpu.py::test_compile_fullgraph_softmax_cross_entropy": lambda xdt: [
        c for n in COMPILE_NS for c in softmax(xdt, n) + ce(xdt, n, "weighted") + ce(xdt, n)
    ],
    "test_training_gpu.py::test_compile_fullgraph_inductor_every_op": lambda: [
        c
        for n in COMPILE_NS
        for c in rms_fwd(BF, n, r=True, wdt=F32)
        + rms_bwd(BF, n, wdt=F32)
        + ln_fwd(BF, n, wdt=F32)
        + ln_bwd(BF, n, wdt=F32)
        + softmax(BF, n)
        + ce(BF, n, "weighted")
        + ce(BF, n)
    ],
    "test_training_gpu.py::test_opcheck_on_gpu": lambda: (
        rms_fwd(BF, 668, wdt=F32)
        + rms_bwd(BF, 668, wdt=F32)
        + ln_fwd(BF, 668, wdt=F32)
        + ln_bwd(BF, 668, wdt=F32)
        + softmax(BF, 668)
        + ce(BF, 668, "weighted")
    ),
    "test_norm_fwd_fp32_weights_gpu.py::test_small_row_candidates_match_torch": lambda n, cand: [
        ("layernorm_fwd", dict(ln_fwd(BF, n, wdt=F32)[0][1], config=_small_row_candidate(n, cand)))
    ],
    "test_norm_fwd_fp32_weights_gpu.py::test_public_forwards_with_fp32_weights": lambda xdt, kind, n: (
        ln_fwd(xdt, n, wdt=F32) if kind == "layer" else rms_fwd(xdt, n, wdt=F32)
    ),
    "test_layernorm_one_cta_rows_gpu.py::test_layernorm_fwd_fp32_wb_one_cta_rows": lambda xdt, n: ln_fwd(
        xdt, n, wdt=F32
    ),
    "test_pipelined_ring_gpu.py::test_layernorm_fwd_fp32_wb_pipelined_ring": lambda xdt, n: ln_fwd(
        xdt, n, wdt=F32
    ),
    "test_pipelined_ring_gpu.py::test_layernorm_fwd_fp32_weight_or_bias_alone": lambda has_w, has_b: ln_fwd(
        BF, 262144, w=has_w, b=has_b, wdt=F32
    ),
    "test_pipelined_ring_gpu.py::test_layernorm_fwd_same_dtype_pipelined_ring": lambda xdt: (
        ln_fwd(xdt, 262144) + ln_fwd(xdt, 196608)
    ),
    "test_pipelined_ring_gpu.py::test_rmsnorm_fwd_fp32_weight_pipelined_ring_over_clusters_of_8": lambda xdt, has_b: (
        rms_fwd(xdt, 262144, b=has_b, wdt=F32)
    ),
    "test_layernorm_one_cta_rows_gpu.py::test_layernorm_fwd_row_cta": lambda xdt, affine, n: ln_fwd(
        xdt,
        n,
        w=affine != "none",
        b=affine in ("same", "float32"),
        wdt=F32 if affine == "float32" else "same",
    ),
    "test_reference_hooks_gpu.py::test_reference_hook_passes_on_gpu": lambda kernel, dtype: _hook_calls(
        kernel, dtype
    ),
    "test_gemm_gpu.py::test_gemm_shapes": lambda shape: gemm(shape),
    "test_gemm_gpu.py::test_gemm_ping_pong_on_a_grid_of_many_waves": lambda tile_m, tile_n, cluster_m, cluster_n: [
        (
            "gemm",
            dict(
                gemm((1, 64, 64, 64), bm="k")[0][1],
                config=_gemm_cfg(
                    tile_m=tile_m, tile_n=tile_n, cluster_m=cluster_m, cluster_n=cluster_n, schedule="ping"
                ),
            ),
        )
    ],
    "test_gemm_gpu.py::test_gemm_swizzled_tile_orders": lambda shape, **knobs: [
        ("gemm", dict(gemm((1, 64, 64, 64), bm="k")[0][1], config=_gemm_cfg(schedule="coop", **knobs)))
    ],
    "test_gemm_gpu.py::test_gemm_stream_k": lambda shape, swizzle, **knobs: _stream_k(swizzle, knobs),
    "test_gemm_gpu.py::test_gemm_stream_k_on_grids_the_gpu_holds_in_part_or_in_waves": (
        lambda scale, swizzle, **knobs: _stream_k(swizzle, knobs)
    ),
    "test_gemm_gpu.py::test_gemm_dtypes_layouts": lambda dtype, out, a_major, b_major: gemm(
        (1, 1000, 1048, 776), dtype, out, a_major, b_major
    ),
    "test_gemm_gpu.py::test_gemm_epilogue": lambda activation, has_bias, has_c: gemm(
        (1, 1000, 1048, 776), act=activation, bias=has_bias, c=has_c
    ),
    "test_gemm_gpu.py::test_gemm_autograd": gemm_autograd,
    "test_gemm_gpu.py::test_gemm_compile_fullgraph": lambda: gemm_autograd(activation="gelu_tanh"),
    "test_gemm_gpu.py::test_gemm_under_autocast_runs_on_the_cast_operands": lambda dtype: gemm_autograd(
        "gelu_tanh", dtype
    ),
    "test_gemm_gpu.py::test_gemm_bad_inputs_on_gpu": None,
    "test_gemm_fp8_gpu.py::test_scaled_gemm_fp8": lambda shape, dtype, fast_accum: scaled_gemm(
        shape, dtype, fast_accum
    ),
    "test_gemm_fp8_gpu.py::test_scaled_gemm_fp8_epilogue_and_fp32_output": lambda: scaled_gemm(
        (1, 1000, 1048, 784), "float8_e4m3fn", out=F32, act="gelu_tanh", bias=True, c=True
    ),
    "test_gemm_fp8_gpu.py::test_scaled_gemm_reads_the_scales_on_the_device": lambda: scaled_gemm(
        (1, 1000, 1048, 784), "float8_e4m3fn"
    ),
    "test_gemm_fp8_gpu.py::test_scaled_gemm_bad_inputs_on_gpu": None,
    "test_cuda_graphs_gpu.py::test_ops_replay_in_a_cuda_graph_with_the_eager_bits": lambda: (
        rms_fwd(BF, 4096)
        + softmax(F32, 1000)
        + ce(F32, 1000)
        + gemm((1, 1000, 1048, 776))
        + gemm((1, 1000, 1048, 776), act="gelu_tanh", bias=True)
        + _stream_k(8, dict(tile_m=256, tile_n=128, cluster_m=1, cluster_n=2))  # test_gemm_gpu.STREAM_K[1]
        + ln_fwd(BF, 1000)
        + ln_bwd(BF, 1000)
    ),
    "test_cuda_graphs_gpu.py::test_training_step_through_make_graphed_callables_matches_eager": lambda: (
        rms_fwd(BF, 4096) + rms_bwd(BF, 4096) + gemm_autograd("gelu_tanh")
    ),
    "test_cuda_graphs_gpu.py::test_torch_compile_reduce_overhead_records_the_ops_in_its_cuda_graphs": lambda: (
        rms_fwd(BF, 4096) + rms_bwd(BF, 4096)
    ),
    # builds every shipped manifest itself before `quack verify --run`
    "test_reference_hooks_gpu.py::test_verify_run_passes_over_every_shipped_manifest": None,
}


def _small_row_candidate(n, cand):
    from test_norm_fwd_fp32_weights_gpu import small_row_candidates

    return small_row_candidates(n)[cand]


def _cases(fn):
    """Every parameter combination of ``fn``'s parametrize marks (pytest.param values too)."""
    axes = []
    for mark in getattr(fn, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names, values = mark.args[0], mark.args[1]
        names = [s.strip() for s in names.split(",")] if isinstance(names, str) else list(names)
        rows = []
        for v in values:
            v = v.values if hasattr(v, "values") and hasattr(v, "marks") else v
            v = v if len(names) > 1 else (v[0] if isinstance(v, tuple) and len(v) == 1 else v,)
            rows.append(dict(zip(names, v)))
        axes.append(rows)
    for combo in itertools.product(*axes):
        yield {k: v for d in combo for k, v in d.items()}


def gpu_test_functions():
    """(\"file::test\", function) of every test function of the GPU test modules."""
    for path in sorted(glob.glob(os.path.join(HERE, "*_gpu.py"))):
        mod = importlib.import_module(os.path.basename(path)[:-3])
        for name in sorted(vars(mod)):
            if name.startswith("test_") and callable(getattr(mod, name)):
                yield f"{os.path.basename(path)}::{name}", getattr(mod, name)


def requested() -> dict:
    """(kernel, sorted params items) -> the first "file::test" that requests it."""
    out: dict = {}
    for test, fn in gpu_test_functions():
        if test not in REQUESTS:
            raise KeyError(f"{test}: not in _requests.REQUESTS (say which kernels it requests, or None)")
        f = REQUESTS[test]
        for case in _cases(fn) if f is not None else ():
            for kernel, params in f(**case):
                out.setdefault((kernel, tuple(sorted(params.items()))), test)
    return out
