"""Dropout modules: ``Dropout`` (each element) and ``Dropout1d/2d/3d`` (whole channels), with
PyTorch's arguments, checks and ``repr``. Identity in eval mode; in training the mask comes
from FLAME's default generator (``fl.manual_seed``), drawn inside the consuming kernel.

``dropout1d``, ``dropout2d`` and ``dropout3d`` are the functional forms (PyTorch's
``F.dropout1d`` ...): one uniform number per (sample, channel), broadcast over the channel.
"""

from __future__ import annotations

import warnings

from flame.functional import where
from flame.nn import functional as F
from flame.nn.modules.module import Module
from flame.tensor import Tensor

# (dropout1d/2d/3d are functional: flame.nn.functional's names, not flame.nn's)
__all__ = ["Dropout", "Dropout1d", "Dropout2d", "Dropout3d"]


def _check_probability(p: float) -> None:
    if p < 0 or p > 1:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")


def _feature_dropout(input: Tensor, p: float, training: bool, inplace: bool, generator=None):  # noqa: A002
    """Zero each channel (dim 1) of ``input`` [N, C, *] with probability ``p``, scale the rest
    by 1/(1-p)."""
    if not training or p == 0.0:
        return input
    if p == 1.0:
        result = input * 0.0
    else:
        from flame.creation import rand

        noise_shape = tuple(input.shape[:2]) + (1,) * (input.ndim - 2)
        keep = rand(noise_shape, generator=generator, device=input.device) >= p
        result = where(keep, input * (1.0 / (1.0 - p)), 0.0)
    return input.copy_(result) if inplace else result


def _channel_dropout(name, input, p, training, inplace, spatial: int, generator=None):  # noqa: A002
    _check_probability(p)
    if input.ndim not in (spatial + 1, spatial + 2):
        raise RuntimeError(
            f"{name}: Expected {spatial + 1}D or {spatial + 2}D input, but received a "
            f"{input.ndim}D input. Note that {name} exists to provide channel-wise dropout on "
            f"inputs with {spatial} spatial dimension{'s' if spatial > 1 else ''}, a channel "
            "dimension, and an optional batch dimension "
            f"(i.e. {spatial + 1}D or {spatial + 2}D inputs)."
        )
    if not training or p == 0.0:
        return input
    if input.ndim == spatial + 1:  # unbatched: one sample
        batched = input.unsqueeze(0)
        result = _feature_dropout(batched, p, training, False, generator).squeeze(0)
        return input.copy_(result) if inplace and result is not input else result
    return _feature_dropout(input, p, training, inplace, generator)


def dropout1d(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False,  # noqa: A002
              generator=None) -> Tensor:  # fmt: skip
    """Zero whole channels of input [N, C, L] (or [C, L]) with probability ``p``."""
    return _channel_dropout("dropout1d", input, p, training, inplace, 1, generator)


def dropout2d(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False,  # noqa: A002
              generator=None) -> Tensor:  # fmt: skip
    """Zero whole channels of input [N, C, H, W] with probability ``p``. As PyTorch's, a 3-D
    input is read as [N, C, L] (with PyTorch's warning)."""
    _check_probability(p)
    if input.ndim not in (3, 4):
        warnings.warn(
            f"dropout2d: Received a {input.ndim}-D input to dropout2d, which is deprecated "
            "and will result in an error in a future release. To retain the behavior "
            "and silence this warning, please use dropout instead. Note that dropout2d "
            "exists to provide channel-wise dropout on inputs with 2 spatial dimensions, "
            "a channel dimension, and an optional batch dimension (i.e. 3D or 4D inputs).",
            stacklevel=2,
        )
    if input.ndim == 3:
        warnings.warn(
            "dropout2d: Received a 3D input to dropout2d and assuming that channel-wise "
            "1D dropout behavior is desired - input is interpreted as shape (N, C, L), where C "
            "is the channel dim. This behavior will change in a future release to interpret the "
            "input as one without a batch dimension, i.e. shape (C, H, W). To maintain the 1D "
            "channel-wise dropout behavior, please switch to using dropout1d instead.",
            stacklevel=2,
        )
    return _feature_dropout(input, p, training, inplace, generator)


def dropout3d(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False,  # noqa: A002
              generator=None) -> Tensor:  # fmt: skip
    """Zero whole channels of input [N, C, D, H, W] (or [C, D, H, W]) with probability ``p``."""
    _check_probability(p)
    if input.ndim not in (4, 5):
        warnings.warn(
            f"dropout3d: Received a {input.ndim}-D input to dropout3d, which is deprecated "
            "and will result in an error in a future release. To retain the behavior "
            "and silence this warning, please use dropout instead. Note that dropout3d "
            "exists to provide channel-wise dropout on inputs with 3 spatial dimensions, "
            "a channel dimension, and an optional batch dimension (i.e. 4D or 5D inputs).",
            stacklevel=2,
        )
    if input.ndim == 4:
        return _channel_dropout("dropout3d", input, p, training, inplace, 3, generator)
    return _feature_dropout(input, p, training, inplace, generator)


class _DropoutNd(Module):
    def __init__(self, p: float = 0.5, inplace: bool = False) -> None:
        super().__init__()
        _check_probability(p)
        self.p = p
        self.inplace = inplace

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}"


class Dropout(_DropoutNd):
    """Zero each element with probability ``p`` in training, scaling the rest by 1/(1-p)."""

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        if not self.training:
            return input
        from flame.backend import backend as use_backend

        with use_backend(input.backend):  # the mask is drawn where the input lives
            return F.dropout(input, self.p, self.training, self.inplace)


class Dropout1d(_DropoutNd):
    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return dropout1d(input, self.p, self.training, self.inplace)


class Dropout2d(_DropoutNd):
    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return dropout2d(input, self.p, self.training, self.inplace)


class Dropout3d(_DropoutNd):
    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return dropout3d(input, self.p, self.training, self.inplace)
