"""Losses of ``torch.nn.functional`` beyond ``mse_loss`` and the [N, C] cross-entropy:
``nll_loss``, ``cross_entropy`` with class weights, extra dims or probability targets,
``binary_cross_entropy(_with_logits)``, ``l1_loss``, ``smooth_l1_loss``, ``huber_loss``,
``kl_div``, and ``normalize``. Compositions of elementwise ops and reductions, with
PyTorch's arguments, reductions and conventions (logs clamped at -100 in
``binary_cross_entropy``, ``0 * log 0 = 0`` in ``kl_div``).
"""

from __future__ import annotations

from flame import reductions as R
from flame.amp.autocast_mode import full_precision
from flame.backend import backend as use_backend
from flame.functional import softplus, where
from flame.indexing import checked_targets
from flame.ir.infer import SizeValue
from flame.ir.shapes import ShapeError
from flame.linalg import at_user_line
from flame.shaping import movedim, shown
from flame.tensor import Tensor
from flame.views import reshape

REDUCTIONS = ("none", "mean", "sum")


def _reduced(loss: Tensor, reduction: str, op: str, denominator=None) -> Tensor:
    if reduction not in REDUCTIONS:
        raise at_user_line(
            ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
        )
    if reduction == "none":
        return loss
    total = R.sum(loss)
    if reduction == "sum":
        return total
    return total / denominator if denominator is not None else R.mean(loss)


def _same_shape(op: str, input: Tensor, target: Tensor) -> None:  # noqa: A002
    if input.shape != target.shape:
        raise at_user_line(
            ShapeError(f"{op}: input {shown(input)} and target {shown(target)} differ in shape")
        )


# --- class losses -----------------------------------------------------------------------------


def _class_rows(op: str, scores: Tensor, target: Tensor, probabilities: bool):
    """``scores`` as [M, C] rows (the class dim last), ``target`` as [M] indices or [M, C]
    probabilities, and the shape of the unreduced loss."""
    if scores.ndim == 0:
        raise at_user_line(ShapeError(f"{op}: input must have a class dim, got {shown(scores)}"))
    classes = scores.shape[0] if scores.ndim == 1 else scores.shape[1]
    loss_shape = () if scores.ndim == 1 else (scores.shape[0],) + scores.shape[2:]
    expected = scores.shape if probabilities else loss_shape
    if target.shape != expected:
        what = "probabilities shaped like input" if probabilities else "class indices"
        raise at_user_line(
            ShapeError(
                f"{op}: target {shown(target)} must hold {what} {list(expected)} for input "
                f"{shown(scores)}"
            )
        )

    def rows(tensor):
        moved = tensor if tensor.ndim == 1 else movedim(tensor, 1, -1)
        return reshape(moved, (-1, classes))

    target_rows = rows(target) if probabilities else reshape(target, (-1, 1))
    return rows(scores), target_rows, loss_shape, classes


def _class_weight(weight, classes: int, op: str):
    if weight is None:
        return None
    if weight.shape != (classes,):
        raise at_user_line(
            ShapeError(f"{op}: weight {shown(weight)} must hold one value per class ({classes})")
        )
    return reshape(weight, (1, classes))


def _targets(op: str, target: Tensor, classes: int, backend: str):
    from flame.creation import arange

    if target.dtype.is_float or target.dtype.is_bool:
        raise at_user_line(TypeError(f"{op}: target must hold class indices, got {shown(target)}"))
    with use_backend(backend):
        return reshape(arange(classes), (1, classes)) == target


def nll_loss(input: Tensor, target: Tensor, weight=None, size_average=None,  # noqa: A002
             ignore_index: int = -100, reduce=None, reduction: str = "mean") -> Tensor:  # fmt: skip
    """Negative log-likelihood of log-probabilities ``input`` [N, C] (or [N, C, d...], [C])
    at class indices ``target``; ``weight`` scales each class, ``ignore_index`` drops rows."""
    from flame.nn.functional import _no_legacy_arguments

    _no_legacy_arguments("nll_loss", size_average, reduce)
    input, weight = full_precision(input, weight)  # autocast: float32 (PyTorch's list)
    rows, target_rows, loss_shape, classes = _class_rows("nll_loss", input, target, False)
    target_rows = checked_targets("nll_loss", target_rows, classes, ignore_index)
    is_target = _targets("nll_loss", target_rows, classes, input.backend)
    class_weight = _class_weight(weight, classes, "nll_loss")
    valid = target_rows != ignore_index
    picked = R.sum(where(is_target, rows, 0.0), 1, keepdim=True)
    target_weight = (
        R.sum(where(is_target, class_weight, 0.0), 1, keepdim=True)
        if class_weight is not None
        else 1.0
    )  # fmt: skip
    loss = where(valid, -picked * target_weight, 0.0)
    denominator = R.sum(where(valid, target_weight, 0.0).to(loss.dtype))
    return _reduced(reshape(loss, loss_shape), reduction, "nll_loss", denominator)


def cross_entropy_general(logits, target, weight, ignore_index, reduction, label_smoothing):
    """``cross_entropy`` with weights, extra dims or probability targets (PyTorch's
    formulas; flame.nn.functional.cross_entropy takes the one-kernel path otherwise)."""
    from flame.nn.functional import log_softmax

    if not 0.0 <= label_smoothing <= 1.0:
        raise at_user_line(
            ValueError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
        )
    probabilities = target.dtype.is_float
    rows, target_rows, loss_shape, classes = _class_rows(
        "cross_entropy", logits, target, probabilities
    )
    class_weight = _class_weight(weight, classes, "cross_entropy")
    log_probabilities = log_softmax(rows, 1)
    weighted = log_probabilities if class_weight is None else log_probabilities * class_weight
    if probabilities:
        if label_smoothing:
            target_rows = target_rows * (1.0 - label_smoothing) + label_smoothing / classes
        loss = -R.sum(weighted * target_rows, 1)
        return _reduced(reshape(loss, loss_shape), reduction, "cross_entropy")
    nll = nll_loss(log_probabilities, reshape(target_rows, (-1,)), weight,
                   ignore_index=ignore_index, reduction="none")  # fmt: skip
    valid = reshape(target_rows, (-1,)) != ignore_index
    loss = nll
    if label_smoothing:
        smooth = where(valid, -R.sum(weighted, 1) * SizeValue(1.0 / classes, "1/classes"), 0.0)
        loss = nll * (1.0 - label_smoothing) + smooth * label_smoothing
    if class_weight is None:
        denominator = R.sum(valid.to(loss.dtype))
    else:
        is_target = _targets("cross_entropy", target_rows, classes, logits.backend)
        picked_weight = R.sum(where(is_target, class_weight, 0.0), 1)
        denominator = R.sum(where(valid, picked_weight, 0.0))
    return _reduced(reshape(loss, loss_shape), reduction, "cross_entropy", denominator)


# --- elementwise losses -----------------------------------------------------------------------


def binary_cross_entropy(input: Tensor, target: Tensor, weight=None, size_average=None,  # noqa: A002
                         reduce=None, reduction: str = "mean") -> Tensor:  # fmt: skip
    """``-w (t log x + (1 - t) log(1 - x))`` for probabilities ``input``; each log is
    clamped at -100, as PyTorch does, so x = 0 or 1 gives a finite loss. Under autocast,
    float32 (PyTorch's CPU list; its CUDA autocast refuses this op)."""
    input, target, weight = full_precision(input, target, weight)
    _same_shape("binary_cross_entropy", input, target)
    log_x = _at_least(input.log(), -100.0)
    log_rest = _at_least((1.0 - input).log(), -100.0)
    loss = -(target * log_x + (1.0 - target) * log_rest)
    if weight is not None:
        loss = loss * weight
    return _reduced(loss, reduction, "binary_cross_entropy")


def _at_least(x: Tensor, floor: float) -> Tensor:
    return where(x < floor, floor, x)


def binary_cross_entropy_with_logits(input: Tensor, target: Tensor, weight=None,  # noqa: A002
                                     size_average=None, reduce=None, reduction: str = "mean",
                                     pos_weight=None) -> Tensor:  # fmt: skip
    """``binary_cross_entropy(sigmoid(input), target)`` computed from the logits without
    overflow; ``pos_weight`` scales the positive term (per class, broadcast on the last
    dim)."""
    input, target, weight, pos_weight = full_precision(input, target, weight, pos_weight)
    _same_shape("binary_cross_entropy_with_logits", input, target)
    if pos_weight is None:
        loss = (1.0 - target) * input + softplus(-input)
    else:
        log_weight = (pos_weight - 1.0) * target + 1.0
        loss = (1.0 - target) * input + log_weight * softplus(-input)
    if weight is not None:
        loss = loss * weight
    return _reduced(loss, reduction, "binary_cross_entropy_with_logits")


def l1_loss(input: Tensor, target: Tensor, size_average=None, reduce=None,  # noqa: A002
            reduction: str = "mean") -> Tensor:  # fmt: skip
    input, target = full_precision(input, target)  # autocast: float32
    return _reduced((input - target).abs(), reduction, "l1_loss")


def smooth_l1_loss(input: Tensor, target: Tensor, size_average=None, reduce=None,  # noqa: A002
                   reduction: str = "mean", beta: float = 1.0) -> Tensor:  # fmt: skip
    """``0.5 d^2 / beta`` where ``|d| < beta``, ``|d| - 0.5 beta`` elsewhere."""
    input, target = full_precision(input, target)  # autocast: float32
    if beta < 0:
        raise at_user_line(ValueError(f"smooth_l1_loss: beta must be >= 0, got {beta}"))
    difference = input - target
    size = difference.abs()
    if beta == 0:
        return _reduced(size, reduction, "smooth_l1_loss")
    loss = where(size < beta, difference * difference * (0.5 / beta), size - 0.5 * beta)
    return _reduced(loss, reduction, "smooth_l1_loss")


def huber_loss(input: Tensor, target: Tensor, reduction: str = "mean",  # noqa: A002
               delta: float = 1.0, weight=None) -> Tensor:  # fmt: skip
    """``0.5 d^2`` where ``|d| < delta``, ``delta (|d| - 0.5 delta)`` elsewhere."""
    input, target, weight = full_precision(input, target, weight)  # autocast: float32
    if delta <= 0:
        raise at_user_line(ValueError(f"huber_loss: delta must be > 0, got {delta}"))
    difference = input - target
    size = difference.abs()
    loss = where(size < delta, difference * difference * 0.5, (size - 0.5 * delta) * delta)
    if weight is not None:
        loss = loss * weight
    return _reduced(loss, reduction, "huber_loss")


def kl_div(input: Tensor, target: Tensor, size_average=None, reduce=None,  # noqa: A002
           reduction: str = "mean", log_target: bool = False) -> Tensor:  # fmt: skip
    """``target * (log(target) - input)`` for log-probabilities ``input`` (``log_target``:
    ``target`` holds log-probabilities too). ``reduction="batchmean"`` divides the sum by
    the batch size (the KL divergence proper); ``"mean"`` by the element count."""
    input, target = full_precision(input, target)  # autocast: float32
    if log_target:
        loss = target.exp() * (target - input)
    else:
        positive = target > 0
        entropy_term = where(positive, target * where(positive, target, 1.0).log(), 0.0)
        loss = entropy_term - target * input
    if reduction == "batchmean":
        batch = input.shape[0] if input.ndim else 1
        return R.sum(loss) / float(batch)
    return _reduced(loss, reduction, "kl_div")


def normalize(input: Tensor, p: float = 2.0, dim: int = 1, eps: float = 1e-12,  # noqa: A002
              out=None) -> Tensor:  # fmt: skip
    """``input / max(norm_p(input, dim), eps)``."""
    from flame.norms import vector_norm

    if out is not None:
        raise at_user_line(TypeError("normalize: out= is not supported (FLAME tensors are values)"))
    size = vector_norm(input, p, dim, keepdim=True)
    return input / where(size < eps, eps, size)


__all__ = [
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "huber_loss", "kl_div",
    "l1_loss", "nll_loss", "normalize", "smooth_l1_loss",
]  # fmt: skip
