"""RMSNorm forward and backward in CuTe DSL.

forward:  h = x (+ residual, rounded to x's dtype: the stored residual_out);
          rstd = 1 / sqrt(mean(h^2) + eps);  y = h * rstd (* w) (+ b)
backward: dx = rstd * (dy*w - h * mean(dy*w*h) * rstd^2);  dw = sum_rows(dy * h * rstd)

Here: the knobs, the registered compile functions and the torch-facing ops. Elsewhere: the
forward's row-tile kernels (``_rms_fwd``) and its persistent ring (``_norm_fwd``), the
backward (``_norm_bwd``, shared with LayerNorm).

Top level imports only quack: torch and cutlass are imported inside functions.
"""

from quack import jit_cache
from quack.params import Bool, Config, Dtype, Int

from . import _tuning
from ._configs import NormBwdConfig, RmsNormFwdConfig
from ._plan import N_MAX, N_MIN, WIDTHS, WeightDtype, plan_rows, resolve_weight_dtype, size_class


def fwd_class(params: dict) -> str | None:
    """The forward's tuning-table class (kernels/tuned/*.toml): for 16-bit rows, the weight
    kind ("same" / "wide": wider than the rows) and the default plan's cluster size
    ("wide/cluster4"); None for fp32 rows (the kernel's heuristic)."""
    dtype, width = params["dtype"], WIDTHS[params["dtype"]]
    if width != 16:
        return None
    kind = "wide" if WIDTHS[resolve_weight_dtype(dtype, params["weight_dtype"])] > width else "same"
    return f"{kind}/cluster{plan_rows(params['n'], width, budget=64).cluster_n}"


def search_space(params: dict) -> list[RmsNormFwdConfig]:
    """``quack tune``'s candidates for a forward problem: the table's default, the
    heuristic, and the measured variants that apply to the problem's plan."""
    width = WIDTHS[params["dtype"]]
    wide = WIDTHS[resolve_weight_dtype(params["dtype"], params["weight_dtype"])] > width
    cands = [RmsNormFwdConfig()]
    if width == 16 and not params["has_residual"]:
        for mb in (3, 4):
            cands.append(RmsNormFwdConfig(x_smem=True, x_min_blocks=mb, x_smem_wide=wide or None))
        if wide:
            cands.append(
                RmsNormFwdConfig(ring=False, x_smem=True, x_smem_wide=True, x_rows=2, x_min_blocks=3)
            )
            cands.append(RmsNormFwdConfig(ring=True, ring_budget=128, wide_perm=True))
            for st in (3, 4):
                cands.append(RmsNormFwdConfig(ring_threads=512, ring_pipe=True, ring_wregs="wb", stages=st))
    return cands


# --------------------------------------------------------------------------- forward


@jit_cache(
    "rmsnorm_fwd",
    params={
        "dtype": Dtype(),
        "n": Int(min=N_MIN, max=N_MAX),
        "has_weight": Bool(),
        "has_bias": Bool(),
        "has_residual": Bool(),
        "weight_dtype": WeightDtype(),
        "config": Config(
            RmsNormFwdConfig,
            derive=_tuning.derive(
                "rmsnorm_fwd", RmsNormFwdConfig, fwd_class, classes=r"(same|wide)/cluster\d+"
            ),
        ),
    },
    reference=f"{__package__}._verify:verify_rmsnorm_fwd",
    search_space=search_space,
    bench=f"{__package__}._verify:bench_rmsnorm_fwd",
)
def compile_rmsnorm_fwd(
    dtype: str,
    n: int,
    has_weight: bool = True,
    has_bias: bool = False,
    has_residual: bool = False,
    weight_dtype: str = "same",
    config: RmsNormFwdConfig | None = None,
):
    """Compile RMSNorm forward for rows of ``n`` elements of ``dtype`` (any batch size),
    weight / bias of ``weight_dtype`` ("same": ``dtype``).
    Runtime signature: fn(x, w|None, b|None, residual|None, y, residual_out|None, rstd, eps,
    num_blocks); num_blocks is the persistent grid (``fwd_grid``; ignored by the
    one-row-tile-per-CTA launch)."""
    from ._rms_fwd import compile_rms_fwd

    kn = config.knobs()  # type: ignore[union-attr]  # derived by bind (_tuning)
    return compile_rms_fwd(dtype, n, has_weight, has_bias, has_residual, weight_dtype, kn)


def fwd_ring_cfg(
    dtype: str, n: int, has_weight: bool, has_bias: bool, has_residual: bool, weight_dtype: str, config
):
    """The persistent, cp.async-pipelined forward (``quack_kernels._norm_fwd``) for rows
    over clusters of ``RING_MIN_CLUSTER`` (4) CTAs or more (N >= 65536 for 16-bit dtypes)
    with a weight wider than the rows and no residual, or None (one row tile per CTA);
    knobs: the forward's ``config`` (``ring_cfg``)."""
    return _ring_cfg(dtype, n, has_weight, has_bias, has_residual, weight_dtype, config.knobs())


def fwd_config(dtype: str, n: int, has_weight: bool, has_bias: bool, has_residual: bool, weight_dtype: str):
    """The configuration a call with these parameters compiles (the table's, by the
    process's arch and GPU): the launch grid must follow the same one."""
    spec = compile_rmsnorm_fwd.spec
    args = (dtype, n, has_weight, has_bias, has_residual, weight_dtype)
    return _tuning.derived_config(spec, args)


def _ring_cfg(dtype, n, has_weight, has_bias, has_residual, weight_dtype, kn: dict):
    from ._norm_fwd import ring_cfg

    return ring_cfg("rms", dtype, n, has_weight, has_bias, has_residual, weight_dtype, kn)


# The forward's measured knob sets (x through shared memory, two rows a CTA, for a weight
# wider than the rows at clusters of 4; the pipelined ring over clusters of 8 CTAs of 512
# threads at N = 262144) are rows of kernels/tuned/sm_90a.toml, by
# ``fwd_class``; ``search_space`` lists them as candidates (docs/kernels.md, docs/tuning.md).


def fwd_grid(m: int, dtype: str, n: int, rcfg, device) -> int:
    """CTAs (per cluster rank) of the ring forward (1, ignored, without one)."""
    from ._norm_fwd import ring_grid

    return ring_grid(m, dtype, n, rcfg, device)


# --------------------------------------------------------------------------- backward


def bwd_class(params: dict) -> str | None:
    """The backward's tuning-table class: the row-length class (``_plan.size_class``)."""
    return size_class(params["dtype"], params["n"])


def bwd_search_space(params: dict) -> list[NormBwdConfig]:
    """``quack tune``'s backward candidates (``_norm_bwd.search_space``, shared with
    LayerNorm's backward)."""
    from ._norm_bwd import search_space

    return search_space("rms", params)


@jit_cache(
    "rmsnorm_bwd",
    params={
        "dtype": Dtype(),
        "n": Int(min=N_MIN, max=N_MAX),
        "has_weight": Bool(),
        "has_bias": Bool(),
        "weight_dtype": WeightDtype(),
        "config": Config(
            NormBwdConfig,
            derive=_tuning.derive("rmsnorm_bwd", NormBwdConfig, bwd_class, classes=_tuning.SIZE_CLASSES),
        ),
    },
    reference=f"{__package__}._verify:verify_rmsnorm_bwd",
    search_space=bwd_search_space,
    bench=f"{__package__}._verify:bench_rmsnorm_bwd",
)
def compile_rmsnorm_bwd(
    dtype: str,
    n: int,
    has_weight: bool = True,
    has_bias: bool = False,
    weight_dtype: str = "same",
    config: NormBwdConfig | None = None,
):
    """Compile RMSNorm backward (persistent; ``quack_kernels._norm_bwd``). Runtime signature:
    fn(x, w|None, dy, None, rstd, dx, dw_partial|None, db_partial|None, num_blocks) where
    the partials are (num_blocks * rows_per_cta, n) fp32, summed by the caller;
    ``has_bias`` adds db = sum_rows(dy)."""
    from ._norm_bwd import compile_norm_bwd

    return compile_norm_bwd("rms", dtype, n, has_weight, has_bias, weight_dtype, config.knobs())  # type: ignore[union-attr]


def bwd_smem_stages(plan, width: int, config: NormBwdConfig) -> int:
    """Pipeline depth of the shared-memory backward (``quack_kernels._norm_bwd``) under
    ``config``."""
    from ._norm_bwd import bwd_smem_stages as stages

    return stages(plan, width, config.knobs())


def _bwd_grid(m: int, plan, width: int, device, config: NormBwdConfig) -> int:
    from ._norm_bwd import bwd_grid

    return bwd_grid(m, plan, width, device, config.knobs())


# --------------------------------------------------------------------------- torch-facing


def _eps(eps):
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    return float(eps)


def rmsnorm_fwd(x, weight=None, bias=None, residual=None, eps: float = 1e-6):
    """RMSNorm over the last dim. Returns ``(y, rstd, residual_out)``: y like x,
    rstd float32 of shape x.shape[:-1], residual_out = x + residual in x's dtype (None without
    residual); y and rstd normalize that stored, rounded residual_out (the backward's input).
    weight / bias may have another float dtype than x (e.g. fp32 with bf16 x)."""
    import torch

    from . import _torch as kt

    x2 = kt.rows(x, "x")
    m, n = x2.shape
    dt = kt.dtype_name(x2, "x")
    w, b, wdt = kt.affine(weight, bias, n, x)
    r2 = kt.like_rows(residual, "residual", x) if residual is not None else None
    eps = _eps(eps)
    y = torch.empty_like(x2)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    ro = torch.empty_like(x2) if r2 is not None else None
    if m > 0:
        args = (dt, n, w is not None, b is not None, r2 is not None, wdt)
        cfg = fwd_config(*args)
        fn = compile_rmsnorm_fwd(*args, cfg)
        rcfg = fwd_ring_cfg(*args, cfg)
        grid = fwd_grid(m, dt, n, rcfg, x.device)
        fn(x2, w, b, r2, y, ro, rstd, eps, grid)
    shape = x.shape
    return (y.view(shape), rstd.view(shape[:-1]), ro.view(shape) if ro is not None else None)


def rmsnorm_bwd(x, weight, dy, rstd, bias=None):
    """Gradients of y = RMSNorm(x) * weight (+ bias). ``x`` is the normalized input (x +
    residual when a residual was added), rstd from the forward. Returns ``(dx, dweight)``,
    or ``(dx, dweight, dbias)`` when ``bias`` is given (only its dtype is used); dweight /
    dbias in the weight's / bias's dtype (None when absent), summed in fp32."""
    from ._norm_bwd import run_norm_bwd

    def compile_fn(dt, n, has_w, has_b, wdt):
        cfg = _tuning.derived_config(compile_rmsnorm_bwd.spec, (dt, n, has_w, has_b, wdt))
        return compile_rmsnorm_bwd(dt, n, has_w, has_b, wdt, cfg), cfg.knobs()

    dx, dw, db = run_norm_bwd(
        "rms", compile_fn, x, weight, dy, None, rstd, bias.dtype if bias is not None else None
    )
    return (dx, dw) if bias is None else (dx, dw, db)
