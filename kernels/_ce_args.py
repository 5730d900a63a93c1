"""Argument handling of the torch-facing cross-entropy ops (``cross_entropy.cross_entropy_fwd``
/ ``cross_entropy_bwd``): the checks on target, class weights and label_smoothing, the
compile variant they select, and the per-row class weights w[target] the wrapper folds into
its O(M) scalars. Split from cross_entropy.py, which keeps the compile functions and the ops.

Top level imports nothing: torch is imported inside functions.
"""


def targets(target, m, x):
    import torch

    from . import _torch as kt  # noqa: F401

    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.device != x.device:
        raise ValueError(f"target is on {target.device} but logits is on {x.device}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target has dtype {target.dtype}, expected torch.int64 (or int32)")
    if target.numel() != m or tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"target has shape {tuple(target.shape)}, expected {tuple(x.shape[:-1])}")
    return target.reshape(m).to(torch.int64).contiguous()


def class_weight(weight, n, x):
    """Validate class weights: a float (N,) tensor on the logits' device; fp32 copy."""
    if weight is None:
        return None
    from . import _torch as kt

    kt.check_tensor(weight, "weight")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but logits is on {x.device}")
    kt.dtype_name(weight, "weight")
    if weight.dim() != 1 or weight.shape[0] != n:
        raise ValueError(f"weight must have shape ({n},) (one per class), got {tuple(weight.shape)}")
    return weight.float().contiguous()


def smoothing(label_smoothing) -> float:
    if (
        isinstance(label_smoothing, bool)
        or not isinstance(label_smoothing, (int, float))
        or not 0.0 <= label_smoothing <= 1.0
    ):
        raise ValueError(f"label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    return float(label_smoothing)


def variant(weight, eps: float) -> str:
    if eps == 0.0:
        return "none"
    return "weighted" if weight is not None else "uniform"


def row_weights(t, w, n, ignore_index):
    """(valid, w[t]) per row: valid = target != ignore_index; w[t] is 1 without class
    weights and 0 on ignored rows (fp32)."""
    valid = t != ignore_index
    if w is None:
        return valid, valid.float()
    return valid, w[t.clamp(0, n - 1)] * valid
