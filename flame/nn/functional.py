"""Composite ops with PyTorch's names and arguments, written with primitives so the fusion
pass sees through them: softmax, layer norm and RMS norm become one kernel that reads each
row once; cross-entropy one kernel per row plus a small one for the mean."""

from __future__ import annotations

from flame import reductions as R
from flame.creation import arange
from flame.functional import gelu, leaky_relu, relu, sigmoid, silu, softplus, tanh, where
from flame.indexing import embedding, one_hot
from flame.ir.shapes import ShapeError
from flame.tensor import Tensor
from flame.views import reshape

__all__ = [
    "cross_entropy", "dropout", "embedding", "gelu", "one_hot", "pad", "group_norm",
    "layer_norm", "leaky_relu", "log_softmax",
    "mse_loss", "relu", "rms_norm", "sigmoid", "silu", "softmax", "softplus", "tanh",
]  # fmt: skip


def softmax(x: Tensor, dim: int = -1, dtype=None) -> Tensor:
    if dtype is not None:
        x = x.to(dtype)
    shifted = x - R.amax(x, dim, keepdim=True)
    exponent = shifted.exp()
    return exponent / R.sum(exponent, dim, keepdim=True)


def log_softmax(x: Tensor, dim: int = -1, dtype=None) -> Tensor:
    if dtype is not None:
        x = x.to(dtype)
    shifted = x - R.amax(x, dim, keepdim=True)
    return shifted - R.sum(shifted.exp(), dim, keepdim=True).log()


def _trailing_axes(x: Tensor, normalized_shape, op: str) -> tuple[int, ...]:
    normalized = (
        (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    )
    if tuple(x.shape[x.ndim - len(normalized) :]) != normalized:
        raise ShapeError(
            f"{op}: normalized_shape {list(normalized)} does not match the trailing dims of "
            f"input {list(x.shape)}"
        )
    return tuple(range(x.ndim - len(normalized), x.ndim))


def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5) -> Tensor:
    axes = _trailing_axes(x, normalized_shape, "layer_norm")
    centered = x - R.mean(x, axes, keepdim=True)
    variance = R.mean(centered * centered, axes, keepdim=True)
    result = centered * (variance + eps).rsqrt()
    if weight is not None:
        result = result * weight
    if bias is not None:
        result = result + bias
    return result


def rms_norm(x, normalized_shape, weight=None, eps: float | None = None) -> Tensor:
    axes = _trailing_axes(x, normalized_shape, "rms_norm")
    if eps is None:
        eps = 1.1920928955078125e-07  # torch.finfo(float32).eps, PyTorch's default
    result = x * (R.mean(x * x, axes, keepdim=True) + eps).rsqrt()
    return result * weight if weight is not None else result


def group_norm(x, num_groups: int, weight=None, bias=None, eps: float = 1e-5) -> Tensor:
    if x.ndim < 2 or x.shape[1] % num_groups:
        raise ShapeError(
            f"group_norm: channels of input {list(x.shape)} must divide into {num_groups} groups"
        )
    batch, channels = x.shape[0], x.shape[1]
    grouped = reshape(x, (batch, num_groups, -1))
    centered = grouped - R.mean(grouped, 2, keepdim=True)
    variance = R.mean(centered * centered, 2, keepdim=True)
    result = reshape(centered * (variance + eps).rsqrt(), x.shape)
    affine_shape = (channels,) + (1,) * (x.ndim - 2)
    if weight is not None:
        result = result * reshape(weight, affine_shape)
    if bias is not None:
        result = result + reshape(bias, affine_shape)
    return result


def cross_entropy(
    logits: Tensor, target: Tensor, label_smoothing: float = 0.0, reduction: str = "mean",
    ignore_index: int = -100,
) -> Tensor:  # fmt: skip
    """Cross-entropy of ``logits`` [N, C] against integer class ``target`` [N]."""
    if logits.ndim != 2 or target.ndim != 1 or target.shape[0] != logits.shape[0]:
        raise ShapeError(
            f"cross_entropy: expected logits [N, C] and target [N], got {list(logits.shape)} "
            f"and {list(target.shape)}"
        )
    if target.dtype.is_float or target.dtype.is_bool:
        raise TypeError(f"cross_entropy: target must hold class indices, got {target.dtype.name}")
    classes = logits.shape[1]
    normalizer = R.logsumexp(logits, 1, keepdim=True)
    is_target = reshape(arange(classes), (1, classes)) == reshape(target, (-1, 1))
    picked = R.sum(where(is_target, logits, 0.0), 1, keepdim=True)
    loss = normalizer - picked
    if label_smoothing:
        smooth = normalizer - R.mean(logits, 1, keepdim=True)
        loss = loss * (1.0 - label_smoothing) + smooth * label_smoothing
    valid = reshape(target, (-1, 1)) != ignore_index
    loss = reshape(where(valid, loss, 0.0), (-1,))
    return _reduce_loss(loss, reduction, valid)


def _reduce_loss(loss: Tensor, reduction: str, valid=None) -> Tensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return R.sum(loss)
    if reduction == "mean":
        if valid is None:
            return R.mean(loss)
        return R.sum(loss) / R.sum(valid).float()
    raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}")


def pad(x: Tensor, pad, mode: str = "constant", value: float = 0.0) -> Tensor:
    from flame.joining import pad as pad_

    return pad_(x, pad, mode, value)


def dropout(x: Tensor, p: float = 0.5, training: bool = True, seed=None) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by 1/(1-p). The mask is
    generated inside the kernel from ``seed`` (Philox): the same seed, the same mask."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout: p must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    from flame.creation import rand

    keep = rand(x.shape, seed=seed) >= p
    return where(keep, x * (1.0 / (1.0 - p)), 0.0)


def mse_loss(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:  # noqa: A002
    difference = input - target
    return _reduce_loss(difference * difference, reduction)
