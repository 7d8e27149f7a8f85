"""Parameter initialisers, as PyTorch's ``torch.nn.init``: the same names, signatures, fan
rules, gains and distributions.

Each one writes into the tensor it is given (its memory, so views of it and tensors it is a
view of see the new values), under ``flame.no_grad()`` (a leaf that requires grad stays one),
on the tensor's own backend, and returns that same tensor. Random draws come from
``generator`` (default: the default generator, ``fl.manual_seed``): the same seed gives the
same numbers on the reference and CUDA backends.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import numpy as np

from flame.autograd import no_grad
from flame.backend import backend as use_backend
from flame.creation import rand, randn
from flame.creation import tensor as make_tensor
from flame.functional import clamp, where
from flame.ir import dtypes
from flame.ir.views import MOVEMENT_OPS
from flame.ranges import eye
from flame.sorting import argsort
from flame.tensor import Tensor

__all__ = [
    "calculate_gain", "calculate_fan_in_and_fan_out", "uniform_", "normal_", "trunc_normal_",
    "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_", "xavier_normal_",
    "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
]  # fmt: skip

_LINEAR = (
    "linear", "conv1d", "conv2d", "conv3d",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
)  # fmt: skip


# --- writing into a tensor -----------------------------------------------------------------------


def _give_memory(tensor: Tensor) -> None:
    """Give a tensor that is not a view, and has no memory yet, memory of its own.

    Works around two behaviours of ``flame/inplace.py``'s ``write`` (to be removed once it
    handles them): ``fl.empty``/``fl.zeros``/``fl.full`` make a broadcast of one constant,
    which a write refuses as a broadcast view (PyTorch's ``torch.empty`` has dense memory);
    and a write into a lazy value replaces its node without carrying its autograd record, so
    a lazy leaf (``fl.randn(n, m).requires_grad_()``) stops requiring grad. A view of another
    tensor is left alone: the write itself gives the base its memory and writes through."""
    node = tensor.node
    if tensor.is_realized:
        return
    broadcast_constant = node.op == "expand" and node.inputs[0].op == "const"
    if broadcast_constant or node.op not in (*MOVEMENT_OPS, "detach"):
        tensor.realize()


@contextlib.contextmanager
def _writing(tensor: Tensor, op: str):
    """Around a write into ``tensor``: no gradient records, new values on its backend."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{op}: expected a flame.Tensor, got {type(tensor).__name__}")
    _give_memory(tensor)
    with no_grad(), use_backend(tensor.backend):
        yield


def _compute_dtype(tensor: Tensor):
    """float64 for float64 tensors, float32 otherwise (half types are rounded once, at the
    write)."""
    return dtypes.float64 if tensor.dtype is dtypes.float64 else dtypes.float32


# --- fans and gains ----------------------------------------------------------------------------


def calculate_gain(nonlinearity, param=None):
    """The recommended gain for ``nonlinearity`` (PyTorch's table: 1 for linear, conv and
    sigmoid, 5/3 for tanh, sqrt(2) for relu, sqrt(2 / (1 + slope^2)) for leaky_relu (slope
    ``param``, default 0.01), 3/4 for selu)."""
    if nonlinearity in _LINEAR or nonlinearity == "sigmoid":
        return 1
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        if param is None:
            negative_slope = 0.01
        elif isinstance(param, (int, float)) and not isinstance(param, bool):
            negative_slope = param
        else:
            raise ValueError(f"negative_slope {param} not a valid number")
        return math.sqrt(2.0 / (1 + negative_slope**2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise ValueError(f"Unsupported nonlinearity {nonlinearity}")


def _calculate_fan_in_and_fan_out(tensor: Tensor) -> tuple[int, int]:
    """``(fan_in, fan_out)``: dims 1 and 0, each times the product of the dims after them
    (a weight is ``[out, in, *kernel]``)."""
    if tensor.ndim < 2:
        raise ValueError(
            "Fan in and fan out can not be computed for tensor with fewer than 2 dimensions"
        )
    receptive_field = math.prod(tensor.shape[2:])
    return tensor.shape[1] * receptive_field, tensor.shape[0] * receptive_field


calculate_fan_in_and_fan_out = _calculate_fan_in_and_fan_out


def _calculate_correct_fan(tensor: Tensor, mode: str) -> int:
    mode = mode.lower()
    valid_modes = ["fan_in", "fan_out"]
    if mode not in valid_modes:
        raise ValueError(f"Mode {mode} not supported, please use one of {valid_modes}")
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    return fan_in if mode == "fan_in" else fan_out


# --- plain distributions and constants ---------------------------------------------------------


def uniform_(tensor: Tensor, a: float = 0.0, b: float = 1.0, generator=None) -> Tensor:
    """Fill with U(a, b)."""
    with _writing(tensor, "uniform_"):
        return tensor.uniform_(a, b, generator=generator)


def normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0, generator=None) -> Tensor:
    """Fill with N(mean, std^2)."""
    with _writing(tensor, "normal_"):
        return tensor.normal_(mean, std, generator=generator)


def trunc_normal_(
    tensor: Tensor,
    mean: float = 0.0,
    std: float = 1.0,
    a: float = -2.0,
    b: float = 2.0,
    generator=None,
) -> Tensor:
    """Fill with N(mean, std^2) truncated to [a, b], by the inverse CDF (PyTorch's method up
    to 2.x; its newer one redraws, which needs host syncs): p uniform in
    [2 Phi(a') - 1, 2 Phi(b') - 1], value = mean + std * sqrt(2) * erfinv(p), clamped to
    [a, b] against rounding. The uniform draw is moved half a step of FLAME's 24-bit grid
    into the open interval, so p is never exactly -1 or 1 (erfinv's infinities when a or b is
    infinite). One draw of numel() numbers, computed in float32 (float64 for float64)."""

    def norm_cdf(x: float) -> float:
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

    if (mean < a - 2 * std) or (mean > b + 2 * std):
        warnings.warn(
            "mean is more than 2 std from [a, b] in nn.init.trunc_normal_. "
            "The distribution of values may be incorrect.",
            stacklevel=2,
        )
    with _writing(tensor, "trunc_normal_"):
        low = 2 * norm_cdf((a - mean) / std) - 1
        high = 2 * norm_cdf((b - mean) / std) - 1
        compute = _compute_dtype(tensor)
        unit = rand(tensor.shape, generator=generator, dtype=compute) + 2.0**-25
        value = (unit * (high - low) + low).erfinv() * (std * math.sqrt(2.0)) + mean
        return tensor.copy_(clamp(value, a, b))


def constant_(tensor: Tensor, val: float) -> Tensor:
    """Fill with ``val``."""
    with _writing(tensor, "constant_"):
        return tensor.fill_(val)


def ones_(tensor: Tensor) -> Tensor:
    with _writing(tensor, "ones_"):
        return tensor.fill_(1.0)


def zeros_(tensor: Tensor) -> Tensor:
    with _writing(tensor, "zeros_"):
        return tensor.zero_()


def eye_(tensor: Tensor) -> Tensor:
    """Fill a 2-d tensor with the identity (ones on the main diagonal of a rectangle)."""
    if tensor.ndim != 2:
        raise ValueError("Only tensors with 2 dimensions are supported")
    with _writing(tensor, "eye_"):
        return tensor.copy_(eye(*tensor.shape, dtype=tensor.dtype))


def dirac_(tensor: Tensor, groups: int = 1) -> Tensor:
    """Fill a {3, 4, 5}-d convolution weight with the Dirac delta: output channel d of each
    group passes input channel d through (a one at the kernel's centre)."""
    if tensor.ndim not in (3, 4, 5):
        raise ValueError("Only tensors with 3, 4, or 5 dimensions are supported")
    sizes = tensor.shape
    if sizes[0] % groups != 0:
        raise ValueError("dim 0 must be divisible by groups")
    per_group = sizes[0] // groups
    values = np.zeros(sizes, dtype=np.float32)
    centre = tuple(size // 2 for size in sizes[2:])
    for group in range(groups):
        for channel in range(min(per_group, sizes[1])):
            values[(group * per_group + channel, channel) + centre] = 1
    with _writing(tensor, "dirac_"):
        return tensor.copy_(make_tensor(values))


# --- scaled by fan -----------------------------------------------------------------------------


def xavier_uniform_(tensor: Tensor, gain: float = 1.0, generator=None) -> Tensor:
    """U(-a, a) with a = gain * sqrt(6 / (fan_in + fan_out)) (Glorot)."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    std = gain * math.sqrt(2.0 / float(fan_in + fan_out))
    bound = math.sqrt(3.0) * std
    return uniform_(tensor, -bound, bound, generator)


def xavier_normal_(tensor: Tensor, gain: float = 1.0, generator=None) -> Tensor:
    """N(0, std^2) with std = gain * sqrt(2 / (fan_in + fan_out)) (Glorot)."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    std = gain * math.sqrt(2.0 / float(fan_in + fan_out))
    return normal_(tensor, 0.0, std, generator)


def _kaiming_std(tensor: Tensor, a, mode: str, nonlinearity: str) -> float | None:
    """gain / sqrt(fan), or None (with PyTorch's warning) for a tensor with no elements."""
    if 0 in tensor.shape:
        warnings.warn("Initializing zero-element tensors is a no-op", stacklevel=3)
        return None
    fan = _calculate_correct_fan(tensor, mode)
    return calculate_gain(nonlinearity, a) / math.sqrt(fan)


def kaiming_uniform_(
    tensor: Tensor, a=0, mode: str = "fan_in", nonlinearity: str = "leaky_relu", generator=None
) -> Tensor:
    """U(-bound, bound) with bound = gain * sqrt(3 / fan_mode) (He); ``a`` is leaky_relu's
    negative slope. As PyTorch, fans assume the weight is used as ``x @ w.T``."""
    std = _kaiming_std(tensor, a, mode, nonlinearity)
    if std is None:
        return tensor
    bound = math.sqrt(3.0) * std
    return uniform_(tensor, -bound, bound, generator)


def kaiming_normal_(
    tensor: Tensor, a=0, mode: str = "fan_in", nonlinearity: str = "leaky_relu", generator=None
) -> Tensor:
    """N(0, std^2) with std = gain / sqrt(fan_mode) (He)."""
    std = _kaiming_std(tensor, a, mode, nonlinearity)
    if std is None:
        return tensor
    return normal_(tensor, 0, std, generator)


# --- structured --------------------------------------------------------------------------------


def orthogonal_(tensor: Tensor, gain: float = 1, generator=None) -> Tensor:
    """Fill with a (semi-)orthogonal matrix times ``gain``; dims after the first are
    flattened. As PyTorch: the QR factorisation of a standard normal [rows, cols] matrix
    (transposed when rows < cols), Q's columns multiplied by the signs of R's diagonal.

    FLAME has no QR op: the normal matrix is drawn by FLAME from ``generator`` (so the seed
    decides it on every backend), read to the host, factorised there with NumPy in float64,
    and copied in. Reading it waits for the device, and it cannot run inside
    ``flame.compile``."""
    if tensor.ndim < 2:
        raise ValueError("Only tensors with 2 or more dimensions are supported")
    if tensor.numel() == 0:
        return tensor
    rows = tensor.shape[0]
    cols = tensor.numel() // rows
    with _writing(tensor, "orthogonal_"):
        flattened = randn(rows, cols, generator=generator).numpy().astype(np.float64)
        if rows < cols:
            flattened = flattened.T
        q, r = np.linalg.qr(flattened)
        q *= np.sign(np.diag(r))
        if rows < cols:
            q = q.T
        values = (q * gain).astype(tensor.dtype.numpy).reshape(tensor.shape)
        return tensor.copy_(make_tensor(values))


def sparse_(tensor: Tensor, sparsity: float, std: float = 0.01, generator=None) -> Tensor:
    """Fill a 2-d tensor with N(0, std^2), then zero ceil(sparsity * rows) entries of each
    column, at random rows (Martens 2010). The rows come from ``generator`` too (PyTorch
    draws them from the default generator whatever ``generator`` is), as the smallest
    ranks of a uniform draw per column, all on the device."""
    if tensor.ndim != 2:
        raise ValueError("Only tensors with 2 dimensions are supported")
    rows, cols = tensor.shape
    num_zeros = math.ceil(sparsity * rows)
    with _writing(tensor, "sparse_"):
        compute = _compute_dtype(tensor)
        values = randn(rows, cols, generator=generator, dtype=compute) * std
        noise = rand(rows, cols, generator=generator)
        ranks = argsort(argsort(noise, dim=0), dim=0)
        return tensor.copy_(where(ranks < num_zeros, 0.0, values))
