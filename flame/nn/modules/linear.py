"""``Identity``, ``Linear`` and ``Bilinear``, as PyTorch's: the same constructor arguments,
attribute names, ``state_dict`` keys and shapes, default initialisation and ``repr``.

Every layer's parameters are made by ``empty_parameter`` (``device=`` and ``dtype=`` as
PyTorch's factory keywords) and filled by ``reset_parameters`` from FLAME's default random
generator, so ``fl.manual_seed`` makes a model's initial weights reproducible.
"""

from __future__ import annotations

import math

from flame.creation import empty
from flame.ir import dtypes
from flame.nn import init
from flame.nn.convolution import bilinear, linear
from flame.nn.modules.module import Module
from flame.nn.parameter import Parameter
from flame.tensor import Tensor

__all__ = ["Bilinear", "Identity", "Linear"]


def empty_parameter(shape, device=None, dtype=None, requires_grad: bool = True) -> Parameter:
    """A parameter of ``shape`` (values to be written by ``reset_parameters``) on ``device``
    (``"cpu"``: the reference backend, ``"cuda"``; default: the current backend) in ``dtype``
    (default float32), as ``Parameter(torch.empty(shape, device=, dtype=))``."""
    dtype = dtypes.float32 if dtype is None else dtypes.dtype(dtype)
    return Parameter(empty(tuple(shape), dtype=dtype, device=device), requires_grad=requires_grad)


def reset_fan_in_uniform(weight: Tensor, bias: Tensor | None) -> None:
    """PyTorch's default for ``Linear`` and convolutions: kaiming_uniform_(a=sqrt(5)) on the
    weight (U(-1/sqrt(fan_in), 1/sqrt(fan_in))) and U(-1/sqrt(fan_in), 1/sqrt(fan_in)) on
    the bias."""
    init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        fan_in, _ = init._calculate_fan_in_and_fan_out(weight)
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        init.uniform_(bias, -bound, bound)


class Identity(Module):
    """``Identity(*args, **kwargs)``: returns its input (the arguments are ignored)."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 (PyTorch's name)
        return input


class Linear(Module):
    """``y = x @ weight.T + bias``: weight [out_features, in_features], bias [out_features]."""

    __constants__ = ["in_features", "out_features"]

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = empty_parameter((out_features, in_features), device, dtype)
        if bias:
            self.bias = empty_parameter((out_features,), device, dtype)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        reset_fan_in_uniform(self.weight, self.bias)

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return linear(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )


class Bilinear(Module):
    """``y[o] = x1 @ weight[o] @ x2 + bias[o]``: weight [out, in1, in2], bias [out]."""

    __constants__ = ["in1_features", "in2_features", "out_features"]

    def __init__(
        self,
        in1_features: int,
        in2_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.in1_features = in1_features
        self.in2_features = in2_features
        self.out_features = out_features
        shape = (out_features, in1_features, in2_features)
        self.weight = empty_parameter(shape, device, dtype)
        if bias:
            self.bias = empty_parameter((out_features,), device, dtype)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.in1_features <= 0:
            raise ValueError(
                f"in1_features must be > 0, but got (in1_features={self.in1_features})"
            )
        bound = 1 / math.sqrt(self.weight.shape[1])
        init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            init.uniform_(self.bias, -bound, bound)

    def forward(self, input1: Tensor, input2: Tensor) -> Tensor:
        return bilinear(input1, input2, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in1_features={self.in1_features}, in2_features={self.in2_features}, "
            f"out_features={self.out_features}, bias={self.bias is not None}"
        )
