"""Activation modules (``torch.nn.modules.activation`` without ``MultiheadAttention``, which
lives in ``attention.py``): PyTorch's constructor arguments, attribute names and ``repr``;
each ``forward`` calls the functional op (``flame.nn.functional``), so the module adds no
IR of its own.

``inplace=True`` writes the result into the input, as PyTorch's does (``Tensor.copy_``).
"""

from __future__ import annotations

import warnings

from flame import functional as E
from flame.nn import functional as F
from flame.nn.modules.module import Module
from flame.nn.parameter import Parameter
from flame.tensor import Tensor

__all__ = [
    "CELU", "ELU", "GELU", "GLU", "Hardshrink", "Hardsigmoid", "Hardswish", "Hardtanh",
    "LeakyReLU", "LogSigmoid", "LogSoftmax", "Mish", "PReLU", "ReLU", "ReLU6", "SELU", "SiLU",
    "Sigmoid", "Softmax", "Softmax2d", "Softmin", "Softplus", "Softshrink", "Softsign", "Tanh",
    "Tanhshrink", "Threshold",
]  # fmt: skip


def _written(input: Tensor, value: Tensor, inplace: bool) -> Tensor:  # noqa: A002
    return input.copy_(value) if inplace else value


def _inplace_repr(inplace: bool, lead: str = "") -> str:
    """PyTorch's spelling: ``inplace=True`` is shown only when set."""
    if not inplace:
        return lead
    return f"{lead}, inplace=True" if lead else "inplace=True"


class _Inplace(Module):
    """An activation whose only argument is ``inplace``."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace

    def extra_repr(self) -> str:
        return _inplace_repr(self.inplace)


class ReLU(_Inplace):
    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return _written(input, F.relu(input), self.inplace)


class SiLU(_Inplace):
    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return _written(input, F.silu(input), self.inplace)


class Mish(_Inplace):
    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return F.mish(input, self.inplace)


class SELU(_Inplace):
    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return F.selu(input, self.inplace)


class _InplaceUnshown(_Inplace):
    def extra_repr(self) -> str:  # PyTorch shows nothing here, inplace or not
        return ""


class Hardswish(_InplaceUnshown):
    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return F.hardswish(input, self.inplace)


class Hardsigmoid(_InplaceUnshown):
    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return F.hardsigmoid(input, self.inplace)


class Threshold(Module):
    """``input`` where it is greater than ``threshold``, ``value`` elsewhere."""

    def __init__(self, threshold: float, value: float, inplace: bool = False) -> None:
        super().__init__()
        self.threshold = threshold
        self.value = value
        self.inplace = inplace

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        result = E.where(input > self.threshold, input, float(self.value))
        return _written(input, result, self.inplace)

    def extra_repr(self) -> str:
        return _inplace_repr(self.inplace, f"threshold={self.threshold}, value={self.value}")


class Hardtanh(Module):
    def __init__(
        self,
        min_val: float = -1.0,
        max_val: float = 1.0,
        inplace: bool = False,
        min_value: float | None = None,
        max_value: float | None = None,
    ) -> None:
        super().__init__()
        if min_value is not None:
            warnings.warn(
                "keyword argument `min_value` is deprecated and renamed to `min_val`",
                FutureWarning,
                stacklevel=2,
            )
            min_val = min_value
        if max_value is not None:
            warnings.warn(
                "keyword argument `max_value` is deprecated and renamed to `max_val`",
                FutureWarning,
                stacklevel=2,
            )
            max_val = max_value
        self.min_val = min_val
        self.max_val = max_val
        self.inplace = inplace
        if self.max_val <= self.min_val:
            raise AssertionError(
                f"max_val ({self.max_val}) must be greater than min_val ({self.min_val})"
            )

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return F.hardtanh(input, self.min_val, self.max_val, self.inplace)

    def extra_repr(self) -> str:
        return _inplace_repr(self.inplace, f"min_val={self.min_val}, max_val={self.max_val}")


class ReLU6(Hardtanh):
    def __init__(self, inplace: bool = False) -> None:
        super().__init__(0.0, 6.0, inplace)

    def extra_repr(self) -> str:
        return _inplace_repr(self.inplace)


class Sigmoid(Module):
    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return F.sigmoid(input)


class Tanh(Module):
    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return F.tanh(input)


class LogSigmoid(Module):
    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return F.logsigmoid(input)


class Softsign(Module):
    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return F.softsign(input)


class Tanhshrink(Module):
    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return input - F.tanh(input)


class _Alpha(Module):
    def __init__(self, alpha: float = 1.0, inplace: bool = False) -> None:
        super().__init__()
        self.alpha = alpha
        self.inplace = inplace

    def extra_repr(self) -> str:
        return _inplace_repr(self.inplace, f"alpha={self.alpha}")


class ELU(_Alpha):
    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return F.elu(input, self.alpha, self.inplace)


class CELU(_Alpha):
    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return F.celu(input, self.alpha, self.inplace)


class GELU(Module):
    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return F.gelu(input, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class LeakyReLU(Module):
    def __init__(self, negative_slope: float = 1e-2, inplace: bool = False) -> None:
        super().__init__()
        self.negative_slope = negative_slope
        self.inplace = inplace

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return _written(input, F.leaky_relu(input, self.negative_slope), self.inplace)

    def extra_repr(self) -> str:
        return _inplace_repr(self.inplace, f"negative_slope={self.negative_slope}")


class Softplus(Module):
    def __init__(self, beta: float = 1.0, threshold: float = 20.0) -> None:
        super().__init__()
        self.beta = beta
        self.threshold = threshold

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return F.softplus(input, self.beta, self.threshold)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, threshold={self.threshold}"


class Hardshrink(Module):
    """``input`` where ``|input| > lambd``, 0 elsewhere."""

    def __init__(self, lambd: float = 0.5) -> None:
        super().__init__()
        self.lambd = lambd

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return E.where(input.abs() > self.lambd, input, 0.0)

    def extra_repr(self) -> str:
        return f"{self.lambd}"


class Softshrink(Module):
    """``input`` moved ``lambd`` towards 0, and 0 within ``lambd`` of it."""

    def __init__(self, lambd: float = 0.5) -> None:
        super().__init__()
        self.lambd = lambd

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        lambd = float(self.lambd)
        if lambd < 0:
            raise RuntimeError(f"lambda must be greater or equal to 0, but found to be {lambd}.")
        shrunk = E.where(input > lambd, input - lambd, input + lambd)
        return E.where(input.abs() > lambd, shrunk, 0.0)

    def extra_repr(self) -> str:
        return str(self.lambd)


class GLU(Module):
    """The first half of ``input`` along ``dim`` gated by the sigmoid of the second."""

    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        size = input.shape[self.dim] if input.ndim else 0
        if input.ndim == 0:
            raise RuntimeError("glu does not support scalars because halving size must be even")
        if size % 2:
            raise RuntimeError(
                f"Halving dimension must be even, but dimension {self.dim} is size {size}"
            )
        first, second = input.chunk(2, self.dim)
        return first * F.sigmoid(second)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class PReLU(Module):
    """``max(0, x) + weight * min(0, x)``, ``weight`` one number or one per channel (dim 1)."""

    def __init__(
        self, num_parameters: int = 1, init: float = 0.25, device=None, dtype=None
    ) -> None:
        from flame.creation import full

        self.num_parameters = num_parameters
        super().__init__()
        self.init = init
        self.weight = Parameter(full((num_parameters,), float(init), dtype=dtype, device=device))

    def reset_parameters(self) -> None:
        from flame.nn import init

        init.constant_(self.weight, self.init)

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        weight = self.weight
        if self.num_parameters > 1:
            if input.ndim < 2 or input.shape[1] != self.num_parameters:
                raise RuntimeError(
                    f"Mismatch of parameter numbers and input channel size. Found parameter "
                    f"numbers = {self.num_parameters} and channel size = "
                    f"{input.shape[1] if input.ndim >= 2 else 1}."
                )
            weight = weight.reshape((self.num_parameters,) + (1,) * (input.ndim - 2))
        return E.where(input > 0, input, weight.to(input.dtype) * input)

    def extra_repr(self) -> str:
        return f"num_parameters={self.num_parameters}"


# --- softmax family ----------------------------------------------------------------------------


def _softmax_dim(name: str, ndim: int) -> int:
    """PyTorch's deprecated implicit choice of ``dim`` (with its warning)."""
    warnings.warn(
        f"Implicit dimension choice for {name} has been deprecated. "
        "Change the call to include dim=X as an argument.",
        stacklevel=4,
    )
    return 0 if ndim in (0, 1, 3) else 1


class _Softmax(Module):
    _function = staticmethod(F.softmax)
    _name = "softmax"

    def __init__(self, dim: int | None = None) -> None:
        super().__init__()
        self.dim = dim

    def __setstate__(self, state):
        super().__setstate__(state)
        if not hasattr(self, "dim"):
            self.dim = None

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        dim = self.dim if self.dim is not None else _softmax_dim(self._name, input.ndim)
        return self._function(input, dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class Softmax(_Softmax):
    pass


class LogSoftmax(_Softmax):
    _function = staticmethod(F.log_softmax)
    _name = "log_softmax"


class Softmin(_Softmax):
    _name = "softmin"

    @staticmethod
    def _function(input: Tensor, dim: int) -> Tensor:  # noqa: A002
        return F.softmax(-input, dim)


class Softmax2d(Module):
    """Softmax over the channels (dim -3) of a [N, C, H, W] or [C, H, W] input."""

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        if input.ndim not in (3, 4):
            raise ValueError(f"Softmax2d: expected input to be 3D or 4D, got {input.ndim}D instead")
        return F.softmax(input, -3)
