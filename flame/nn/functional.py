"""Composite ops with PyTorch's names and arguments, written with primitives so the fusion
pass sees through them: softmax, layer norm and RMS norm become one kernel that reads each
row once; cross-entropy one kernel per row plus a small one for the mean."""

from __future__ import annotations

from flame import reductions as R
from flame.amp.autocast_mode import full_precision
from flame.creation import arange
from flame.functional import gelu, leaky_relu, relu, sigmoid, silu, softplus, tanh, where
from flame.indexing import checked_targets, one_hot
from flame.ir.passes import layouts
from flame.ir.shapes import ShapeError, prod
from flame.nn.embedding import embedding
from flame.nn.group_norm_layouts import _after_channels_last_conv, _group_norm_channels_last
from flame.tensor import Tensor
from flame.views import channels_innermost, reshape

__all__ = [
    "cross_entropy", "dropout", "embedding", "gelu", "one_hot", "pad", "group_norm",
    "layer_norm", "leaky_relu", "log_softmax",
    "mse_loss", "relu", "rms_norm", "sigmoid", "silu", "softmax", "softplus", "tanh",
    # activations, losses and normalize: flame/nn/activations.py, flame/nn/losses.py
    "elu", "celu", "selu", "relu6", "hardtanh", "hardswish", "hardsigmoid", "logsigmoid",
    "mish", "softmin", "softsign", "nll_loss", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
    "normalize",
]  # fmt: skip


def softmax(x: Tensor, dim: int = -1, dtype=None) -> Tensor:
    if dtype is not None:
        x = x.to(dtype)
    else:
        (x,) = full_precision(x)  # autocast: float32 (PyTorch's list), unless dtype= is given
    if x.ndim and x.shape[dim] == 0:  # nothing to normalize: the empty tensor, as PyTorch
        return x
    # the shift is a constant to autograd: softmax does not change with it, so its gradient
    # through the max is zero (as PyTorch's formula, which has no such term); kept, it would
    # cost the backward two more passes over the row (the max's ties and a sum that is 0)
    shifted = x - R.amax(x.detach(), dim, keepdim=True)
    exponent = shifted.exp()
    return exponent / R.plain_sum(exponent, dim, keepdim=True)


def log_softmax(x: Tensor, dim: int = -1, dtype=None) -> Tensor:
    if dtype is not None:
        x = x.to(dtype)
    else:
        (x,) = full_precision(x)
    if x.ndim and x.shape[dim] == 0:
        return x
    shifted = x - R.amax(x.detach(), dim, keepdim=True)  # a constant shift (see softmax)
    return shifted - R.plain_sum(shifted.exp(), dim, keepdim=True).log()


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
    x, weight, bias = full_precision(x, weight, bias)  # autocast: float32
    axes = _trailing_axes(x, normalized_shape, "layer_norm")
    centered = x - R.mean(x, axes, keepdim=True)
    variance = R.mean(centered * centered, axes, keepdim=True)
    result = centered * (variance + eps).rsqrt()
    if weight is not None:
        result = result * weight
    if bias is not None:
        result = result + bias
    return result


_EPSILON = {  # torch.finfo(dtype).eps
    "float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52,
}  # fmt: skip


def rms_norm(x, normalized_shape, weight=None, eps: float | None = None) -> Tensor:
    x, weight = full_precision(x, weight)  # autocast: float32
    axes = _trailing_axes(x, normalized_shape, "rms_norm")
    if eps is None:  # PyTorch's default: the machine epsilon of the input's dtype
        eps = _EPSILON.get(x.dtype.name, _EPSILON["float32"])
    result = x * (R.mean(x * x, axes, keepdim=True) + eps).rsqrt()
    return result * weight if weight is not None else result


def group_norm(x, num_groups: int, weight=None, bias=None, eps: float = 1e-5) -> Tensor:
    """Statistics per (sample, group) over the group's channels and every spatial position.

    Computed over ``x`` viewed as [N, G, C/G, S] (S: the spatial positions): the statistics
    reduce axes 2 and 3, and the per-channel affine is a broadcast inside each row, so the
    statistics, normalisation, affine and what follows (SiLU, a time-embedding add, a cast)
    can run as one row kernel that reads x once (issue 21)."""
    x, weight, bias = full_precision(x, weight, bias)  # autocast: float32
    if x.ndim < 2:
        raise ShapeError(
            f"group_norm: expected an input [N, C, ...] of at least 2 dimensions, got "
            f"{list(x.shape)}"
        )
    batch, channels = x.shape[0], x.shape[1]
    if num_groups <= 0 or channels % num_groups:
        raise ShapeError(
            f"group_norm: channels of input {list(x.shape)} must divide into {num_groups} groups"
        )
    for name, parameter in (("weight", weight), ("bias", bias)):
        if parameter is not None and tuple(parameter.shape) != (channels,):
            raise ShapeError(
                f"group_norm: {name} of shape {list(parameter.shape)} does not match the "
                f"{channels} channels of input {list(x.shape)}"
            )
    per_group = (num_groups, channels // num_groups)
    if layouts.ENABLED and (channels_innermost(x) or _after_channels_last_conv(x)):
        # the layout pass keeps x channels-last: per-channel column sums (an experiment,
        # off: notes/performance.md, session 19)
        return _group_norm_channels_last(x, num_groups, weight, bias, eps)
    if channels_innermost(x):
        # channels innermost in memory (a channels-last conv's result): a group's channels are
        # short runs at every position, and the [N, G, C/G, S] walk would read them so. Viewed
        # as [N, G, C/G * S], which is no strided view of that memory, the input is copied to
        # the group-major order first and the rows then read whole (issue 21's notes measure
        # both; a kernel that reads channels-last groups coalesced is still to come)
        grouped = reshape(x, (batch, num_groups, prod(x.shape[1:]) // num_groups))
        centered = grouped - R.mean(grouped, 2, keepdim=True)
        variance = R.mean(centered * centered, 2, keepdim=True)
        result = reshape(centered * (variance + eps).rsqrt(), x.shape)
        affine = (channels,) + (1,) * (x.ndim - 2)
        if weight is not None:
            result = result * reshape(weight, affine)
        if bias is not None:
            result = result + reshape(bias, affine)
        return result
    grouped = reshape(x, (batch, *per_group, prod(x.shape[2:])))  # -1 is ambiguous at batch 0
    centered = grouped - R.mean(grouped, (2, 3), keepdim=True)
    variance = R.mean(centered * centered, (2, 3), keepdim=True)
    result = centered * (variance + eps).rsqrt()
    if weight is not None:
        result = result * reshape(weight, (*per_group, 1))
    if bias is not None:
        result = result + reshape(bias, (*per_group, 1))
    return reshape(result, x.shape)


def cross_entropy(
    input: Tensor, target: Tensor, weight=None, size_average=None,  # noqa: A002 (PyTorch's)
    ignore_index: int = -100, reduce=None, reduction: str = "mean", label_smoothing: float = 0.0,
) -> Tensor:  # fmt: skip
    """Cross-entropy of logits ``input`` [N, C] (or [N, C, d...], or [C]) against class
    indices ``target`` [N] (or [N, d...], []) or class probabilities shaped like ``input``."""
    _no_legacy_arguments("cross_entropy", size_average, reduce)
    logits, weight = full_precision(input, weight)  # autocast: float32
    simple = (
        weight is None and logits.ndim == 2 and target.ndim == 1
        and not target.dtype.is_float and target.shape[0] == logits.shape[0]
    )  # fmt: skip
    if not simple:
        from flame.nn.losses import cross_entropy_general

        return cross_entropy_general(
            logits, target, weight, ignore_index, reduction, label_smoothing
        )
    if target.dtype.is_bool:
        raise TypeError(f"cross_entropy: target must hold class indices, got {target.dtype.name}")
    classes = logits.shape[1]
    target = checked_targets("cross_entropy", target, classes, ignore_index)
    normalizer = R.logsumexp(logits, 1, keepdim=True)
    is_target = reshape(arange(classes), (1, classes)) == reshape(target, (-1, 1))
    picked = R.sum(where(is_target, logits, 0.0), 1, keepdim=True)
    loss = normalizer - picked
    if label_smoothing:
        smooth = normalizer - R.mean(logits, 1, keepdim=True)
        loss = loss * (1.0 - label_smoothing) + smooth * label_smoothing
    valid = reshape(target, (-1, 1)) != ignore_index
    loss = reshape(where(valid, loss, 0.0), (-1,))
    return _reduce_loss(loss, reduction, valid).to(logits.dtype)  # float16 in, float16 out


def _no_legacy_arguments(op: str, size_average, reduce) -> None:
    if size_average is not None or reduce is not None:
        raise TypeError(f"{op}: size_average and reduce are deprecated in PyTorch; use reduction=")


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


def dropout(
    x: Tensor,
    p: float = 0.5,
    training: bool = True,
    inplace: bool = False,
    seed=None,
    generator=None,
) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by 1/(1-p). The mask is
    generated inside the kernel (Philox) from ``generator`` (default: the default
    generator) or from ``seed``: the same seed, the same mask."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout: p must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    from flame.creation import rand

    keep = rand(x.shape, seed=seed, generator=generator) >= p
    result = where(keep, x * (1.0 / (1.0 - p)), 0.0)
    return x.copy_(result) if inplace else result


def mse_loss(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:  # noqa: A002
    input, target = full_precision(input, target)  # autocast: float32
    difference = input - target
    return _reduce_loss(difference * difference, reduction)


# The activations and losses beyond the ones above live in their own modules (this one stays
# short); they are re-exported here, where PyTorch users look for them.
from flame.nn.activations import (  # noqa: E402
    celu,
    elu,
    hardsigmoid,
    hardswish,
    hardtanh,
    logsigmoid,
    mish,
    relu6,
    selu,
    softmin,
    softsign,
)

# The layers' ops (flame/nn/convolution.py, folding.py, pooling.py, interpolation.py,
# attention.py, normalization.py).
from flame.nn.attention import scaled_dot_product_attention  # noqa: E402
from flame.nn.convolution import (  # noqa: E402
    bilinear,
    conv1d,
    conv2d,
    conv_transpose1d,
    conv_transpose2d,
    linear,
)
from flame.nn.folding import fold, unfold  # noqa: E402
from flame.nn.interpolation import interpolate  # noqa: E402
from flame.nn.losses import (  # noqa: E402
    binary_cross_entropy,
    binary_cross_entropy_with_logits,
    huber_loss,
    kl_div,
    l1_loss,
    nll_loss,
    normalize,
    smooth_l1_loss,
)
from flame.nn.modules.dropout import dropout1d, dropout2d, dropout3d  # noqa: E402
from flame.nn.multihead_attention import multi_head_attention_forward  # noqa: E402
from flame.nn.normalization import batch_norm, instance_norm  # noqa: E402
from flame.nn.pooling import (  # noqa: E402
    adaptive_avg_pool1d,
    adaptive_avg_pool2d,
    adaptive_avg_pool3d,
    adaptive_max_pool2d,
    avg_pool1d,
    avg_pool2d,
    max_pool1d,
    max_pool2d,
    pixel_shuffle,
    pixel_unshuffle,
)

__all__ += [
    "multi_head_attention_forward", "scaled_dot_product_attention", "bilinear", "conv1d",
    "conv2d", "conv_transpose1d", "conv_transpose2d", "fold", "linear", "unfold",
    "interpolate", "dropout1d", "dropout2d", "dropout3d", "batch_norm", "instance_norm",
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool2d",
    "avg_pool1d", "avg_pool2d", "max_pool1d", "max_pool2d", "pixel_shuffle", "pixel_unshuffle",
]  # fmt: skip
