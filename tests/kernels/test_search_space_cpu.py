"""CPU tier: each family's tuning search space (``search_space`` of its kernel module, what
``quack tune`` measures): every candidate is a distinct valid configuration, every row of
the tuning table is a candidate of the problems it reaches (so tuning from an empty table
can find today's winners), and the candidates of the problems the table tunes compile for
sm_90a through the cache (compile worker -> .o -> load), with every weight / bias kind."""

import os

import pytest
from _fixtures import kernel_cache  # noqa: F401  (a fixture, used by name)
from conftest import has_gpu
from quack_kernels import _tuning, cross_entropy, layernorm, rmsnorm, softmax

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
A = "sm_90a"
F32 = "float32"

FAMILIES = {
    "rmsnorm_fwd": (rmsnorm.compile_rmsnorm_fwd, rmsnorm.search_space),
    "rmsnorm_bwd": (rmsnorm.compile_rmsnorm_bwd, rmsnorm.bwd_search_space),
    "layernorm_fwd": (layernorm.compile_layernorm_fwd, layernorm.search_space),
    "layernorm_bwd": (layernorm.compile_layernorm_bwd, layernorm.bwd_search_space),
    "softmax_fwd": (softmax.compile_softmax_fwd, softmax.fwd_search_space),
    "softmax_bwd": (softmax.compile_softmax_bwd, softmax.bwd_search_space),
    "cross_entropy_fwd": (cross_entropy.compile_cross_entropy_fwd, cross_entropy.fwd_search_space),
    "cross_entropy_bwd": (cross_entropy.compile_cross_entropy_bwd, cross_entropy.bwd_search_space),
}


def _bind(kernel, **kw):
    return FAMILIES[kernel][0].spec.bind((), kw, arch=A)


@pytest.mark.parametrize("kernel", sorted(FAMILIES))
@pytest.mark.parametrize(
    "dtype, n", [("bfloat16", 4096), ("bfloat16", 65536), ("float32", 16384), ("float16", 262144)]
)
def test_candidates_are_distinct_valid_configs(kernel, dtype, n):
    fn, space = FAMILIES[kernel]
    cls = fn.spec.params["config"].cls
    cands = space(_bind(kernel, dtype=dtype, n=n))
    assert cands and all(type(c) is cls for c in cands)
    assert len(set(cands)) == len(cands), "a duplicate would be compiled and measured twice"
    for c in cands:  # each one binds as a call's explicit config (the key tune compiles)
        assert _bind(kernel, dtype=dtype, n=n, config=c)["config"] == c


@pytest.mark.parametrize("kernel", ["rmsnorm_bwd", "layernorm_bwd"])
def test_norm_backward_searches_its_shared_memory_knobs_where_they_apply(kernel):
    """Both norm backwards (one kernel, ``_norm_bwd``) search the pipeline depth, the
    register path and where the weight lives on rows of one CTA or more; on rows several
    a CTA (the register path whatever the knobs say) the heuristic is the only kernel."""
    fn, space = FAMILIES[kernel]
    for wdt in ("same", F32):
        labels = {c.label() for c in space(_bind(kernel, dtype="bfloat16", n=16384, weight_dtype=wdt))}
        assert {"default", "smem=false", "smem_kb=128 stages=2"} <= labels
        assert any("w_smem" in x for x in labels)
    assert [c.label() for c in space(_bind(kernel, dtype="bfloat16", n=1024))] == ["default"]


def test_every_gemm_table_row_is_a_candidate_its_own_shape_reaches():
    """The GEMM's rows are keyed by shape class (its search space is one for every shape):
    each row's configuration is a candidate, and the shape it was measured at reaches it."""
    from quack_kernels._configs import GemmConfig
    from quack_kernels.gemm import compile_gemm, gemm_config, search_space

    from quack import settings

    rows = [r for r in _tuning.table(A).rows if r.kernel == "gemm"]
    assert len(rows) >= 7  # issue 28's goal shapes, each its own class
    for row in rows:
        cfg = GemmConfig(**row.config)
        m, n, k = (int(x) for x in row.shape.split("x"))
        fast = row.cls.endswith("/fast")  # fp8 with fast accumulation: a space of its own
        for dtype in row.dtype:
            space = search_space(compile_gemm.spec.bind((dtype,), {"fast_accum": fast}, arch=A))
            assert cfg in space, (row.cls, row.config, dtype)
            with settings.override(tune_gpu=row.gpu):  # each GPU model's rows, whatever GPU is here
                assert gemm_config(m, n, k, 1, dtype, fast) == cfg, (row.gpu, row.shape, dtype)


def test_every_table_row_is_a_candidate_of_the_problems_it_reaches():
    from quack import settings

    t = _tuning.table(A)
    for row in t.rows:
        if row.kernel == "gemm":
            continue  # keyed by shape class: the test above
        with settings.override(tune_gpu=row.gpu):  # each GPU model's rows, whatever GPU is here
            _reaches(row, *FAMILIES[row.kernel])


def _reaches(row, fn, space):
    """Row ``row`` (of the GPU model in force) reaches some N of its range, and its
    configuration is a candidate of the problems it reaches."""
    wide = row.cls.startswith("wide")
    reached = 0
    for dtype in row.dtype or ("bfloat16", "float16"):
        for n in sorted({row.n[0], row.n[1], (row.n[0] + row.n[1]) // 2 // 8 * 8}):
            kw = dict(dtype=dtype, n=n)
            if row.kernel in ("rmsnorm_fwd", "layernorm_fwd"):
                kw["weight_dtype"] = F32 if wide else "same"
            p = _bind(row.kernel, **kw)
            if p["config"].knobs() != row.config:
                continue  # another (narrower) row, or the config does not fit this N
            reached += 1
            assert p["config"] in space(p), (row.kernel, row.cls, dtype, n)
    assert reached, f"table row {row.kernel} {row.cls} {row.n} reaches none of its N range"


def _cases():
    out = []
    for wdt in ("same", F32):
        p = dict(dtype="bfloat16", n=262144, has_weight=True, has_bias=True, weight_dtype=wdt)
        out += [("layernorm_fwd", p, c) for c in layernorm.search_space(_bind("layernorm_fwd", **p))]
    for wdt, w, b in (("same", True, True), (F32, True, True), ("same", False, False)):
        p = dict(dtype="bfloat16", n=16384, has_weight=w, has_bias=b, weight_dtype=wdt)
        out += [("layernorm_fwd", p, c) for c in layernorm.search_space(_bind("layernorm_fwd", **p))]
    p = dict(dtype="bfloat16", n=65536, has_weight=True, has_bias=False, has_residual=False, weight_dtype=F32)
    out += [("rmsnorm_fwd", p, c) for c in rmsnorm.search_space(_bind("rmsnorm_fwd", **p))]
    p = dict(dtype="bfloat16", n=4100)  # hinted copies keep the column predicate (a row tail)
    out += [("softmax_bwd", p, c) for c in softmax.bwd_search_space(_bind("softmax_bwd", **p))]
    return out


CASES = _cases()


@pytest.fixture(scope="module")
def candidates_built(kernel_cache, tmp_path_factory):  # noqa: F811
    """Every candidate of CASES' problems built into the session's cache the way a user
    builds them, `quack tune --compile-only` (compile workers -> .o), once per session:
    under `pytest --quack-prebuilt` (CI) this process may only load (a candidate compiled
    in-process here failed there as KernelNotPrebuilt)."""
    import json
    import subprocess
    import sys

    problems = {(k, tuple(sorted(p.items()))) for k, p, _ in CASES}
    lines = []
    for kernel, items in sorted(problems):
        vals = ", ".join(f"{k} = {json.dumps([v])}" for k, v in items)
        lines.append(f'[[kernel]]\nname = "{kernel}"\nparams = {{ {vals} }}\n')
    manifest = tmp_path_factory.mktemp("candidates") / "candidates.toml"
    manifest.write_text("\n".join(lines))
    r = subprocess.run(
        [sys.executable, "-m", "quack_build", "tune", "--compile-only", str(manifest)]
        + ["--cache-dir", str(kernel_cache), "--json", "-j", "2"],
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "CUTE_DSL_ARCH": A},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.mark.skipif(
    has_gpu(), reason="the CPU tier's proof; on the GPU machine `quack tune` compiles the candidates"
)
@pytest.mark.usefixtures("candidates_built")
@pytest.mark.parametrize(
    "kernel, params, config",
    CASES,
    ids=[
        f"{k}-{p['n']}-{p.get('weight_dtype', '')}-{int(p.get('has_weight', 1))}-{c.label()}"
        for k, p, c in CASES
    ],
)
def test_search_space_candidates_compile_for_sm90(kernel, params, config):
    fn = FAMILIES[kernel][0]
    assert callable(fn(**params, config=config))
