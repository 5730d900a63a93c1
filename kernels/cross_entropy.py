"""Cross-entropy over the last dim (logits (M, N), integer targets), in CuTe DSL.

forward:  lse = logsumexp(x);  nll = lse - x[target]   (0 where target == ignore_index)
backward: dlogits = (softmax(x) - onehot(target)) * dloss  (0 rows where ignored)

Class weights w and label smoothing eps (torch's semantics, C = N classes):
  loss = (1 - eps) * w[t] * nll + eps / C * sum_c w_c * (lse - x_c)
  dlogits = a * softmax(x) - b * onehot(t) - c * w      per row, with
  a = dloss * ((1 - eps) * w[t] + eps * sum(w) / C),  b = dloss * (1 - eps) * w[t],
  c = dloss * eps / C  (w = 1 without weights).
The kernels compute the row reductions (lse, x[t], and with smoothing sum_c w_c x_c);
the per-row scalars (w[t], a, b, c) are formed by the torch wrapper (O(M) work).

Here: the knobs, the registered compile functions and the torch-facing ops. Elsewhere: the
kernels (the register-path forward and the backward: ``_ce_rows``; the large-N streaming
forward: ``_ce_stream``), the ops' argument checks (``_ce_args``), the reference hooks of
``quack verify --run`` (``_verify``).

Top level imports only quack (and ``_ce_stream``, which imports only math): torch and cutlass
are imported inside functions.
"""

from quack import jit_cache
from quack.params import Choice, Config, Dtype, Int

from . import _ce_stream, _tuning
from ._ce_stream import stream_grid
from ._configs import CrossEntropyBwdConfig, CrossEntropyFwdConfig
from ._plan import N_MAX, N_MIN, size_class

# Defaults: the forward's by ``_ce_stream.default_tune`` (the streaming shapes by row
# length: the heuristic), the backward's by row-length class from the tuning table
# (kernels/tuned/sm_90a.toml; "mid": a budget of 128 through shared memory). A
# table row for the forward replaces ``default_tune``'s set whole.


def _size_class(params: dict) -> str | None:
    return size_class(params["dtype"], params["n"])


def fwd_search_space(params: dict) -> list[CrossEntropyFwdConfig]:
    """``quack tune``'s forward candidates: the heuristic's streaming shape, the register
    path, and the other measured streaming shapes (one warp a row, one CTA a row,
    clusters of 2)."""
    C = CrossEntropyFwdConfig
    cands = [C(**_ce_stream.default_tune(params["n"])), C(), C(fwd_smem=True)]
    cands += [C(stream=True, stages=st, ctas_per_sm=c) for st in (3, 4) for c in (4, 8)]
    cands += [C(stream=True, tpr=256), C(stream=True, tpr=256, cluster=2)]
    return list(dict.fromkeys(cands))


def bwd_search_space(params: dict) -> list[CrossEntropyBwdConfig]:
    """``quack tune``'s backward candidates: budgets, the shared-memory tile, CTAs / SM."""
    C = CrossEntropyBwdConfig
    cands = [C()] + [C(bwd_budget=b) for b in (16, 32, 64)]
    cands += [C(bwd_budget=b, bwd_smem=True) for b in (64, 128)] + [C(bwd_min_blocks=2)]
    return cands


# label_smoothing compile variants: "none"; "uniform" (the forward also sums x over the
# row, the backward subtracts a per-row constant); "weighted" (sum_c w_c x_c; w_c per column)
SMOOTHING = ("none", "uniform", "weighted")


def stream_cfg(dtype: str, n: int, smoothing: str, config: CrossEntropyFwdConfig) -> dict | None:
    """Launch shape of the streaming forward (``_ce_stream.launch_shape``) under the
    forward's ``config``, or None for the register path."""
    return _ce_stream.launch_shape(config.knobs(), dtype, n, smoothing)


def fwd_config(dtype: str, n: int, smoothing: str = "none") -> CrossEntropyFwdConfig:
    """The configuration a call with these parameters compiles (the launch grid follows it)."""
    return _tuning.derived_config(compile_cross_entropy_fwd.spec, (dtype, n, smoothing))


@jit_cache(
    "cross_entropy_fwd",
    params={
        "dtype": Dtype(),
        "n": Int(min=N_MIN, max=N_MAX),
        "smoothing": Choice(SMOOTHING),
        "config": Config(
            CrossEntropyFwdConfig,
            derive=_tuning.derive(
                "cross_entropy_fwd",
                CrossEntropyFwdConfig,
                _size_class,
                lambda p: CrossEntropyFwdConfig(**_ce_stream.default_tune(p["n"])),
                classes=_tuning.SIZE_CLASSES,
            ),
        ),
    },
    reference=f"{__package__}._verify:verify_cross_entropy_fwd",
    search_space=fwd_search_space,
    bench=f"{__package__}._verify:bench_cross_entropy_fwd",
)
def compile_cross_entropy_fwd(
    dtype: str, n: int, smoothing: str = "none", config: CrossEntropyFwdConfig | None = None
):
    """Runtime signature: fn(logits, target(int64, M), loss(fp32, M), lse(fp32, M), ignore_index)
    (+ num_blocks for the streaming variant, ``stream_cfg``); with smoothing "uniform" /
    "weighted": fn(logits, target, loss, lse, ignore_index, weight(fp32, N)|None, sx(fp32, M))
    where sx = sum_c x_c (* w_c)."""
    cfg = stream_cfg(dtype, n, smoothing, config)  # type: ignore[arg-type]  # derived by bind
    if cfg is not None:
        return _ce_stream.compile_fwd_stream(dtype, n, cfg)
    from ._ce_rows import compile_fwd_rows

    return compile_fwd_rows(dtype, n, smoothing, config.knobs())  # type: ignore[union-attr]


@jit_cache(
    "cross_entropy_bwd",
    params={
        "dtype": Dtype(),
        "n": Int(min=N_MIN, max=N_MAX),
        "smoothing": Choice(SMOOTHING),
        "config": Config(
            CrossEntropyBwdConfig,
            derive=_tuning.derive(
                "cross_entropy_bwd", CrossEntropyBwdConfig, _size_class, classes=_tuning.SIZE_CLASSES
            ),
        ),
    },
    reference=f"{__package__}._verify:verify_cross_entropy_bwd",
    search_space=bwd_search_space,
    bench=f"{__package__}._verify:bench_cross_entropy_bwd",
)
def compile_cross_entropy_bwd(
    dtype: str, n: int, smoothing: str = "none", config: CrossEntropyBwdConfig | None = None
):
    """Runtime signature: fn(logits, target(int64, M), a(fp32, M), lse(fp32, M), dlogits,
    ignore_index, b(fp32, M)|None, c(fp32, M)|None, weight(fp32, N)|None):
    dlogits = a * softmax(x) - b * onehot(target) - c * w  (0 rows where ignored). With
    smoothing "none", b and c are None and b = a (a = dloss * w[target])."""
    from ._ce_rows import compile_bwd_rows

    return compile_bwd_rows(dtype, n, smoothing, config.knobs())  # type: ignore[union-attr]  # derived by bind


# --------------------------------------------------------------------------- torch-facing


def cross_entropy_fwd(logits, target, ignore_index: int = -100, weight=None, label_smoothing: float = 0.0):
    """Per-row cross-entropy (torch's ``reduction="none"``, with class ``weight`` and
    ``label_smoothing``). Returns ``(loss, lse)``, float32 of shape logits.shape[:-1];
    rows whose target is ``ignore_index`` get loss 0."""
    import torch

    from . import _ce_args as ca
    from . import _torch as kt

    x2 = kt.rows(logits, "logits")
    m, n = x2.shape
    t = ca.targets(target, m, logits)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    w = ca.class_weight(weight, n, logits)
    eps = ca.smoothing(label_smoothing)
    variant = ca.variant(w, eps)
    loss = torch.empty(m, dtype=torch.float32, device=x2.device)
    lse = torch.empty(m, dtype=torch.float32, device=x2.device)
    shape = logits.shape[:-1]
    if m == 0:
        return loss.view(shape), lse.view(shape)
    dtn = kt.dtype_name(x2, "logits")
    cfg = fwd_config(dtn, n, variant)
    fn = compile_cross_entropy_fwd(dtn, n, variant, cfg)
    if variant != "none":
        sx = torch.empty(m, dtype=torch.float32, device=x2.device)
        fn(x2, t, loss, lse, ignore_index, w, sx)
        valid, wt = ca.row_weights(t, w, n, ignore_index)
        wsum = w.sum() if w is not None else float(n)
        # loss holds nll = lse - x[t] (0 on ignored rows)
        loss = (1.0 - eps) * wt * loss + (eps / n) * torch.where(valid, wsum * lse - sx, 0.0)
        return loss.view(shape), lse.view(shape)
    scfg = stream_cfg(dtn, n, "none", cfg)
    if scfg is not None:
        fn(x2, t, loss, lse, ignore_index, stream_grid(scfg, m, x2.device))
    else:
        fn(x2, t, loss, lse, ignore_index)
    if w is not None:
        loss = loss * ca.row_weights(t, w, n, ignore_index)[1]
    return loss.view(shape), lse.view(shape)


def cross_entropy_bwd(
    logits, target, dloss, lse, ignore_index: int = -100, weight=None, label_smoothing: float = 0.0
):
    """d(loss)/d(logits) of ``cross_entropy_fwd`` times ``dloss`` (per row):
    (softmax(logits) - onehot(target)) * dloss[:, None] without weight / smoothing;
    0 for ignored rows."""
    import torch

    from . import _ce_args as ca
    from . import _torch as kt

    x2 = kt.rows(logits, "logits")
    m, n = x2.shape
    t = ca.targets(target, m, logits)
    dl = kt.per_row(dloss, "dloss", m, x2)
    ls = kt.per_row(lse, "lse", m, x2)
    w = ca.class_weight(weight, n, logits)
    eps = ca.smoothing(label_smoothing)
    variant = ca.variant(w, eps)
    dx = torch.empty_like(x2)
    if m > 0:
        fn = compile_cross_entropy_bwd(kt.dtype_name(x2, "logits"), n, variant)
        if variant == "none":
            if w is not None:
                dl = dl * ca.row_weights(t, w, n, ignore_index)[1]
            fn(x2, t, dl, ls, dx, ignore_index)
        else:
            _, wt = ca.row_weights(t, w, n, ignore_index)
            wsum = w.sum() if w is not None else float(n)
            b = (dl * (1.0 - eps) * wt).contiguous()
            a = (b + dl * (eps * wsum / n)).contiguous()
            c = (dl * (eps / n)).contiguous()
            fn(x2, t, a, ls, dx, ignore_index, b, c, w)
    return dx.view(logits.shape)
