"""Activations of ``torch.nn.functional`` beyond the registry's own ops, as compositions of
elementwise ops (so they fuse into the kernels around them): ``elu celu selu relu6 hardtanh
hardswish hardsigmoid logsigmoid mish softmin softsign``.

Piecewise functions are written with ``where`` on the same comparisons PyTorch's backward
uses, so the gradient at a kink is PyTorch's (``hardtanh`` and ``hardsigmoid``: 0 at the
bounds; ``hardswish``: 0 at -3 and 1 at 3).
"""

from __future__ import annotations

from flame.functional import softplus, tanh, where
from flame.tensor import Tensor

SELU_ALPHA = 1.6732632423543772848170429916717
SELU_SCALE = 1.0507009873554804934193349852946


def _negative_part(x: Tensor) -> Tensor:
    # expm1 only of values <= 0: the unused branch of a where must not overflow either
    return where(x > 0, 0.0, x)


def _written(input: Tensor, value: Tensor, inplace: bool) -> Tensor:  # noqa: A002
    """``inplace=True``: the value written into ``input`` (flame/inplace.py), as PyTorch."""
    return input.copy_(value) if inplace else value


def elu(input: Tensor, alpha: float = 1.0, inplace: bool = False) -> Tensor:  # noqa: A002
    """``x`` where positive, ``alpha * (exp(x) - 1)`` elsewhere."""
    return _written(input, where(input > 0, input, alpha * _negative_part(input).expm1()), inplace)


def celu(input: Tensor, alpha: float = 1.0, inplace: bool = False) -> Tensor:  # noqa: A002
    """``max(0, x) + min(0, alpha * (exp(x / alpha) - 1))``."""
    if alpha == 0:
        raise ValueError("celu: alpha must not be 0")
    value = where(input > 0, input, alpha * (_negative_part(input) / alpha).expm1())
    return _written(input, value, inplace)


def selu(input: Tensor, inplace: bool = False) -> Tensor:  # noqa: A002
    """``scale * elu(x, alpha)`` with the self-normalizing constants."""
    return _written(input, SELU_SCALE * elu(input, SELU_ALPHA), inplace)


def hardtanh(input: Tensor, min_val: float = -1.0, max_val: float = 1.0,  # noqa: A002
             inplace: bool = False) -> Tensor:  # fmt: skip
    """``input`` clipped to [min_val, max_val]; gradient 1 strictly inside, 0 elsewhere."""
    if min_val > max_val:
        raise ValueError(f"hardtanh: min_val {min_val} is larger than max_val {max_val}")
    value = where(input <= min_val, float(min_val), where(input >= max_val, float(max_val), input))
    return _written(input, value, inplace)


def relu6(input: Tensor, inplace: bool = False) -> Tensor:  # noqa: A002
    return hardtanh(input, 0.0, 6.0, inplace)


def hardswish(input: Tensor, inplace: bool = False) -> Tensor:  # noqa: A002
    """``x * relu6(x + 3) / 6``."""
    middle = input * (input + 3.0) * (1.0 / 6.0)
    return _written(input, where(input <= -3.0, 0.0, where(input < 3.0, middle, input)), inplace)


def hardsigmoid(input: Tensor, inplace: bool = False) -> Tensor:  # noqa: A002
    """``relu6(x + 3) / 6``."""
    value = where(input <= -3.0, 0.0, where(input >= 3.0, 1.0, input * (1.0 / 6.0) + 0.5))
    return _written(input, value, inplace)


def logsigmoid(input: Tensor) -> Tensor:  # noqa: A002
    """``log(sigmoid(x)) = -softplus(-x)``, accurate for large |x|."""
    return -softplus(-input)


def mish(input: Tensor, inplace: bool = False) -> Tensor:  # noqa: A002
    """``x * tanh(softplus(x))``."""
    return _written(input, input * tanh(softplus(input)), inplace)


def softmin(input: Tensor, dim: int | None = None, _stacklevel: int = 3,  # noqa: A002
            dtype=None) -> Tensor:  # fmt: skip
    """``softmax(-x, dim)``."""
    from flame.nn.functional import softmax

    if dim is None:
        raise TypeError("softmin: give dim= (PyTorch's implicit dim choice is deprecated)")
    return softmax(-input if dtype is None else -input.to(dtype), dim)


def softsign(input: Tensor) -> Tensor:  # noqa: A002
    """``x / (1 + |x|)``."""
    return input / (input.abs() + 1.0)


__all__ = [
    "celu", "elu", "hardsigmoid", "hardswish", "hardtanh", "logsigmoid", "mish", "relu6",
    "selu", "softmin", "softsign",
]  # fmt: skip
