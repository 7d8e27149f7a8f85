"""``LayerNorm``, ``GroupNorm`` and ``RMSNorm``, as PyTorch's: the same constructor arguments,
attributes, ``state_dict`` keys and shapes, initialisation (weight ones, bias zeros) and
``repr``. Each ``forward`` is the functional op, one row-wise kernel on the GPU."""

from __future__ import annotations

import numbers

from flame.nn import init
from flame.nn.functional import group_norm, layer_norm, rms_norm
from flame.nn.modules.linear import empty_parameter
from flame.nn.modules.module import Module
from flame.tensor import Tensor


def affine_parameters(module: Module, shape, affine: bool, bias: bool, device, dtype) -> None:
    """A norm's ``weight`` and ``bias`` of ``shape`` (None where ``affine``/``bias`` say so),
    PyTorch's registration of them (shared by the norms here and in batchnorm.py)."""
    module.register_parameter("weight", empty_parameter(shape, device, dtype) if affine else None)
    has_bias = affine and bias
    module.register_parameter("bias", empty_parameter(shape, device, dtype) if has_bias else None)


def reset_affine(module: Module) -> None:
    """Ones for ``weight``, zeros for ``bias``, where they exist."""
    if module.weight is not None:
        init.ones_(module.weight)
    if module.bias is not None:
        init.zeros_(module.bias)


__all__ = ["GroupNorm", "LayerNorm", "RMSNorm"]


def _shape(normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        return (normalized_shape,)
    return tuple(normalized_shape)


class LayerNorm(Module):
    """Normalise over the trailing ``normalized_shape`` dims, then ``* weight + bias``
    (each of ``normalized_shape``)."""

    __constants__ = ["normalized_shape", "eps", "elementwise_affine"]

    def __init__(
        self,
        normalized_shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        affine_parameters(self, self.normalized_shape, elementwise_affine, bias, device, dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        reset_affine(self)

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 (PyTorch's name)
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, "
            f"elementwise_affine={self.elementwise_affine}, bias={self.bias is not None}"
        )


class GroupNorm(Module):
    """Normalise each of ``num_groups`` groups of channels (dim 1) over the group's channels
    and all later dims, then ``* weight + bias`` per channel."""

    __constants__ = ["num_groups", "num_channels", "eps", "affine"]

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        device=None,
        dtype=None,
        *,
        bias: bool = True,
    ):
        super().__init__()
        if num_channels % num_groups != 0:
            raise ValueError(
                f"num_channels ({num_channels}) must be divisible by num_groups ({num_groups})"
            )
        self.num_groups = num_groups
        self.num_channels = num_channels
        self.eps = eps
        self.affine = affine
        affine_parameters(self, (num_channels,), affine, bias, device, dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        reset_affine(self)

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return group_norm(input, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (
            f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}, "
            f"bias={self.bias is not None}"
        )


class RMSNorm(Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the trailing ``normalized_shape`` dims;
    ``eps=None`` is the input dtype's machine epsilon (PyTorch's default)."""

    __constants__ = ["normalized_shape", "eps", "elementwise_affine"]

    def __init__(
        self,
        normalized_shape,
        eps: float | None = None,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = empty_parameter(self.normalized_shape, device, dtype)
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
        )
