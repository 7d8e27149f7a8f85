"""``interpolate`` with PyTorch's signature and index formulas: modes ``nearest``,
``nearest-exact``, ``linear``/``bilinear``/``trilinear`` (``align_corners`` either way) and
``area``, sizes from ``size`` or ``scale_factor`` (``recompute_scale_factor`` as PyTorch's).

Each spatial axis is resampled alone (the modes are separable): nearest is one gather with
a constant index array; linear is two gathers and a weighted sum with constant weights.
Indices and weights are computed here in float32 as PyTorch's kernels compute them, so the
nearest picks agree at the edges. The axes go last to first, so bilinear sums in PyTorch's
order: ``h0 * (w0 * x00 + w1 * x01) + h1 * (w0 * x10 + w1 * x11)``.
"""

from __future__ import annotations

import math

import numpy as np

from flame.backend import backend as use_backend
from flame.creation import tensor as constant
from flame.indexing import index_select
from flame.shaping import checked_tensor, shown, user_errors
from flame.tensor import Tensor

__all__ = ["interpolate"]

_LINEAR = {"linear": 1, "bilinear": 2, "trilinear": 3}
_MODES = ("nearest", "nearest-exact", "linear", "bilinear", "trilinear", "area", "bicubic")


def _on_backend_of(x: Tensor, array: np.ndarray) -> Tensor:
    with use_backend(x.backend):
        return constant(array)


def _scale_value(scale, size: int, out: int) -> np.float32:
    """PyTorch's ``compute_scales_value``: 1/scale_factor if one was given, else in/out."""
    if scale is not None and scale > 0:
        return np.float32(1.0 / scale)
    return np.float32(size) / np.float32(out)


def _nearest_indices(size: int, out: int, scale, exact: bool) -> np.ndarray | None:
    """The source index of every output position; None where it is the identity."""
    if out == size:
        return None
    destination = np.arange(out)
    if not exact and out == 2 * size:
        return destination >> 1
    factor = _scale_value(scale, size, out)
    if exact:
        source = np.floor(((destination + 0.5) * np.float64(factor)).astype(np.float32))
    else:
        source = np.floor(destination.astype(np.float32) * factor)
    return np.minimum(source.astype(np.int64), size - 1)


def _linear_weights(size: int, out: int, scale, align_corners: bool, precision):
    """(i0, i1, lambda0, lambda1) per output position (PyTorch's
    ``area_pixel_compute_source_index`` and ``guard_index_and_lambda``)."""
    destination = np.arange(out).astype(precision)
    if align_corners:
        factor = precision(size - 1) / precision(out - 1) if out > 1 else precision(0)
        source = factor * destination
    else:
        factor = precision(_scale_value(scale, size, out))
        source = np.maximum(factor * (destination + precision(0.5)) - precision(0.5), 0)
    low = np.minimum(np.floor(source).astype(np.int64), size - 1)
    weight = np.clip(source - low, 0, 1).astype(precision)
    high = low + (low < size - 1)
    return low, high, (1 - weight).astype(precision), weight


def _along(x: Tensor, axis: int, weights: np.ndarray) -> Tensor:
    shape = [1] * x.ndim
    shape[axis] = weights.shape[0]
    return _on_backend_of(x, weights.reshape(shape))


def _resample_axis(x: Tensor, axis: int, out: int, scale, mode: str, align_corners) -> Tensor:
    size = x.shape[axis]
    if mode in ("nearest", "nearest-exact"):
        picks = _nearest_indices(size, out, scale, mode == "nearest-exact")
        if picks is None:
            return x
        return index_select(x, axis, _on_backend_of(x, picks))
    precision = np.float64 if x.dtype.name == "float64" else np.float32
    low, high, weight_low, weight_high = _linear_weights(size, out, scale, align_corners, precision)
    if out == size and np.array_equal(low, np.arange(size)) and not weight_high.any():
        return x
    gathered_low = index_select(x, axis, _on_backend_of(x, low))
    gathered_high = index_select(x, axis, _on_backend_of(x, high))
    result = gathered_low * _along(x, axis, weight_low) + gathered_high * _along(
        x, axis, weight_high
    )
    return result.to(x.dtype)


def _output_sizes(input, size, scale_factor, recompute_scale_factor, spatial: int):  # noqa: A002
    """(output sizes, the scales the index formulas use: None entries mean in/out)."""
    if size is not None and scale_factor is not None:
        raise ValueError("interpolate: only one of size or scale_factor should be defined")
    if size is None and scale_factor is None:
        raise ValueError("interpolate: either size or scale_factor should be defined")
    if size is not None:
        if recompute_scale_factor:
            raise ValueError(
                "interpolate: recompute_scale_factor is not meaningful with an explicit size"
            )
        sizes = (size,) * spatial if hasattr(size, "__index__") else tuple(size)
        if len(sizes) != spatial:
            raise ValueError(
                f"interpolate: input {shown(input)} has {spatial} spatial dims, but size is "
                f"{list(sizes)}; give the input as (N, C, d1, ..., dK) and size as (o1, ..., oK)"
            )
        return tuple(int(value) for value in sizes), (None,) * spatial
    scales = (
        (float(scale_factor),) * spatial
        if isinstance(scale_factor, (int, float))
        else tuple(float(value) for value in scale_factor)
    )
    if len(scales) != spatial:
        raise ValueError(
            f"interpolate: input {shown(input)} has {spatial} spatial dims, but scale_factor "
            f"is {list(scales)}"
        )
    sizes = tuple(
        math.floor(float(extent) * scale) for extent, scale in zip(input.shape[2:], scales)
    )
    return sizes, ((None,) * spatial if recompute_scale_factor else scales)


def _check_mode(input: Tensor, mode: str, align_corners, antialias) -> int:  # noqa: A002
    if mode not in _MODES:
        raise ValueError(f"interpolate: mode must be one of {', '.join(_MODES)}, got {mode!r}")
    spatial = input.ndim - 2
    if spatial not in (1, 2, 3):
        raise ValueError(
            f"interpolate: expected a 3-d, 4-d or 5-d input (N, C, d1, ...), got input "
            f"{shown(input)}"
        )
    if mode in _LINEAR and _LINEAR[mode] != spatial:
        raise NotImplementedError(
            f"interpolate: got a {input.ndim}-d input {shown(input)}, but mode {mode!r} needs "
            f"a {_LINEAR[mode] + 2}-d input"
        )
    if align_corners is not None and mode not in _LINEAR and mode != "bicubic":
        raise ValueError(
            "interpolate: align_corners option can only be set with the interpolating modes: "
            "linear | bilinear | bicubic | trilinear"
        )
    if mode == "bicubic":
        raise NotImplementedError("interpolate: mode 'bicubic' is not supported yet")
    if antialias:
        raise NotImplementedError("interpolate: antialias=True is not supported yet")
    return spatial


@user_errors
def interpolate(
    input: Tensor,  # noqa: A002 (PyTorch's name)
    size=None,
    scale_factor=None,
    mode: str = "nearest",
    align_corners: bool | None = None,
    recompute_scale_factor: bool | None = None,
    antialias: bool = False,
) -> Tensor:
    """Resample input [N, C, *spatial] (1 to 3 spatial dims) to ``size`` or by
    ``scale_factor`` (output size ``floor(in * scale_factor)``)."""
    checked_tensor("interpolate", input)
    spatial = _check_mode(input, mode, align_corners, antialias)
    sizes, scales = _output_sizes(input, size, scale_factor, recompute_scale_factor, spatial)
    if any(out <= 0 for out in sizes):
        raise ValueError(
            f"interpolate: input {shown(input)} gives the empty output size {list(sizes)}"
        )
    if mode == "area":
        from flame.nn import pooling

        if spatial == 3:
            raise NotImplementedError("interpolate: mode 'area' of a 5-d input is not supported")
        if spatial == 1:
            return pooling.adaptive_avg_pool1d(input, sizes)
        return pooling.adaptive_avg_pool2d(input, sizes)
    result = input
    for axis in reversed(range(spatial)):
        result = _resample_axis(
            result, 2 + axis, sizes[axis], scales[axis], mode, bool(align_corners)
        )
    return result
