"""``batch_norm`` and ``instance_norm`` with PyTorch's signatures, written with public FLAME
ops (``layer_norm``, ``group_norm`` and ``rms_norm`` are in flame/nn/functional.py).

In training, the batch statistics normalize the input and the running statistics are
updated in place, as PyTorch's: ``running = (1 - momentum) * running + momentum * batch``,
the variance unbiased (n / (n - 1)). The update is an in-place write (flame/inplace.py): on
realized buffers it runs at once (the input and its statistics are realized then, once, and
the output reads them), inside ``flame.compile`` it is part of the program; it never records
gradient history.
"""

from __future__ import annotations

from flame import reductions as R
from flame.amp.autocast_mode import full_precision
from flame.autograd import no_grad
from flame.inplace import memory_of
from flame.ir.infer import SizeValue
from flame.ir.shapes import ShapeError, prod
from flame.shaping import checked_tensor, shown, user_errors
from flame.tensor import Tensor, realize
from flame.views import reshape

__all__ = ["batch_norm", "instance_norm"]


def _check_channels(op: str, input: Tensor, **vectors) -> int:  # noqa: A002
    checked_tensor(op, input)
    if input.ndim < 2:
        raise ShapeError(
            f"{op}: expected an input with at least 2 dims [N, C, ...], got {shown(input)}"
        )
    channels = input.shape[1]
    for name, vector in vectors.items():
        if vector is None:
            continue
        checked_tensor(op, vector)
        if vector.shape != (channels,):
            raise ShapeError(
                f"{op}: {name} must be [{channels}] (the channels of input {shown(input)}), "
                f"got {shown(vector)}"
            )
    return channels


def _update(running: Tensor | None, batch: Tensor, momentum: float) -> None:
    """``running`` moved toward ``batch`` in place: one kernel, no gradient history."""
    if running is None:
        return
    if memory_of(running.node) is None:
        # A lazy buffer (``fl.zeros(C)`` not yet computed) would only come to stand for the
        # new value: a chain growing every step, and inside ``flame.compile`` a constant
        # of the trace whose writes are lost on replay. Given memory, the write lands in it.
        running.realize()
    with no_grad():
        running.lerp_(batch.detach().to(running.dtype), momentum)


def _statistics_now(input: Tensor, mean: Tensor, variance: Tensor, *running) -> None:  # noqa: A002
    """Outside ``flame.compile`` the running-statistics update runs at once; computed alone it
    would compute ``input`` (and what produced it: a convolution, say) once for the update
    and again for the output. Realized together first, both read the same memory."""
    from flame.compile import current_trace  # at call time: flame.compile imports much

    if current_trace() is None and any(stat is not None for stat in running):
        realize(input, mean, variance)


def _affine(result: Tensor, weight, bias, shape) -> Tensor:
    if weight is not None:
        result = result * reshape(weight, shape)
    if bias is not None:
        result = result + reshape(bias, shape)
    return result


@user_errors
def batch_norm(
    input: Tensor,  # noqa: A002 (PyTorch's name)
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """Normalize input [N, C, ...] per channel: with the batch's statistics in training
    (updating ``running_mean``/``running_var`` in place when given), else with the running
    ones."""
    op = "batch_norm"
    channels = _check_channels(
        op, input, running_mean=running_mean, running_var=running_var, weight=weight, bias=bias
    )
    input, weight, bias = full_precision(input, weight, bias)
    shape = (1, channels) + (1,) * (input.ndim - 2)
    if not training:
        if running_mean is None or running_var is None:
            raise ValueError(f"{op}: running_mean and running_var are needed when not training")
        mean = reshape(running_mean, shape).to(input.dtype)
        variance = reshape(running_var, shape).to(input.dtype)
        return _affine((input - mean) * (variance + eps).rsqrt(), weight, bias, shape)
    count = input.numel() // channels if channels else 0
    if count <= 1:
        raise ValueError(
            f"{op}: expected more than 1 value per channel when training, got input {shown(input)}"
        )
    axes = (0, *range(2, input.ndim))
    mean = R.mean(input, axes, keepdim=True)
    centered = input - mean
    variance = R.mean(centered * centered, axes, keepdim=True)
    _statistics_now(input, mean, variance, running_mean, running_var)
    _update(running_mean, reshape(mean, (channels,)), momentum)
    unbiased = SizeValue(count / (count - 1), "n/(n-1)")
    _update(running_var, reshape(variance, (channels,)) * unbiased, momentum)
    return _affine(centered * (variance + eps).rsqrt(), weight, bias, shape)


@user_errors
def instance_norm(
    input: Tensor,  # noqa: A002
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """Normalize input [N, C, ...] per sample and channel over the spatial dims. With
    ``use_input_stats`` the running statistics (when given) move toward the batch's mean
    over N of each instance's statistics; without it, they normalize (as eval batch_norm)."""
    op = "instance_norm"
    channels = _check_channels(
        op, input, running_mean=running_mean, running_var=running_var, weight=weight, bias=bias
    )
    if not use_input_stats:
        return batch_norm(input, running_mean, running_var, weight, bias, False, momentum, eps)
    input, weight, bias = full_precision(input, weight, bias)
    count = prod(input.shape[2:])
    if count <= 1:
        raise ValueError(
            f"{op}: expected more than 1 spatial element when training, got input {shown(input)}"
        )
    axes = tuple(range(2, input.ndim))
    mean = R.mean(input, axes, keepdim=True)
    centered = input - mean
    variance = R.mean(centered * centered, axes, keepdim=True)
    if running_mean is not None or running_var is not None:
        _statistics_now(input, mean, variance, running_mean, running_var)
        flat_mean = reshape(mean, (input.shape[0], channels))
        flat_variance = reshape(variance, (input.shape[0], channels))
        _update(running_mean, R.mean(flat_mean, 0), momentum)
        _update(running_var, R.mean(flat_variance, 0) * (count / (count - 1)), momentum)
    shape = (1, channels) + (1,) * (input.ndim - 2)
    return _affine(centered * (variance + eps).rsqrt(), weight, bias, shape)
