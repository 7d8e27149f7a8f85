"""``interpolate`` with PyTorch's signature and index formulas: modes ``nearest``,
``nearest-exact``, ``linear``/``bilinear``/``trilinear``/``bicubic`` (``align_corners``
either way; ``antialias`` for bilinear and bicubic) and ``area``, sizes from ``size`` or
``scale_factor`` (``recompute_scale_factor`` as PyTorch's).

Each spatial axis is resampled alone (the modes are separable): nearest is one gather with
a constant index array; the interpolating modes gather a few taps (linear 2, cubic 4, an
antialiased window as many as its widest footprint) and sum them with constant weights.
Indices and weights are computed here in float32 (float64 for float64 inputs) as PyTorch's
kernels compute them, so the picks agree at the edges. The axes go last to first, so
bilinear sums in PyTorch's order: ``h0 * (w0 * x00 + w1 * x01) + h1 * (w0 * x10 + w1 * x11)``.
Gradients are those of the gathers and products (scatter-adds of the weighted cotangent).
"""

from __future__ import annotations

import math

import numpy as np

from flame.backend import backend as use_backend
from flame.creation import tensor as constant
from flame.indexing import index_select
from flame.linalg import at_user_line
from flame.shaping import checked_tensor, shown, user_errors
from flame.tensor import Tensor

__all__ = ["interpolate"]

_LINEAR = {"linear": 1, "bilinear": 2, "trilinear": 3}
_SPATIAL = {**_LINEAR, "bicubic": 2}  # the spatial dims each interpolating mode needs
_MODES = ("nearest", "nearest-exact", "linear", "bilinear", "trilinear", "area", "bicubic")
_CUBIC_A = -0.75  # PyTorch's cubic convolution kernel
_ANTIALIAS_CUBIC_A = -0.5  # its antialiased bicubic (Keys' kernel, as PIL's)


def _on_backend_of(x: Tensor, array: np.ndarray) -> Tensor:
    with use_backend(x.backend):
        return constant(array)


def _scale_value(scale, size: int, out: int, precision=np.float32):
    """PyTorch's ``compute_scales_value``: 1/scale_factor if one was given, else in/out."""
    if scale is not None and scale > 0:
        return precision(1.0 / scale)
    return precision(size) / precision(out)


def _area_scale(size: int, out: int, scale, align_corners: bool, precision):
    """PyTorch's ``area_pixel_compute_scale``."""
    if align_corners:
        return precision(size - 1) / precision(out - 1) if out > 1 else precision(0)
    return _scale_value(scale, size, out, precision)


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


def _source_index(size: int, out: int, scale, align_corners: bool, precision) -> np.ndarray:
    """The source coordinate of every output position (PyTorch's
    ``area_pixel_compute_source_index``, before linear's clamp at 0)."""
    factor = _area_scale(size, out, scale, align_corners, precision)
    destination = np.arange(out).astype(precision)
    if align_corners:
        return factor * destination
    return factor * (destination + precision(0.5)) - precision(0.5)


def _guarded(source: np.ndarray, size: int):
    """(the tap left of each coordinate, the fraction past it): ``guard_index_and_lambda``."""
    low = np.minimum(np.floor(source).astype(np.int64), size - 1)
    fraction = np.clip(source - low.astype(source.dtype), 0, 1).astype(source.dtype)
    return low, fraction


def _linear_taps(size: int, out: int, scale, align_corners: bool, precision):
    """(indices, weights), each [2, out]: the two neighbours and their weights."""
    source = _source_index(size, out, scale, align_corners, precision)
    if not align_corners:
        source = np.maximum(source, precision(0))
    low, fraction = _guarded(source, size)
    high = low + (low < size - 1)
    return np.stack([low, high]), np.stack([1 - fraction, fraction]).astype(precision)


def _cubic_near(x, a):
    """The cubic convolution kernel on [0, 1] (``cubic_convolution1``)."""
    return ((a + 2) * x - (a + 3)) * x * x + 1


def _cubic_far(x, a):
    """The cubic convolution kernel on [1, 2] (``cubic_convolution2``)."""
    return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a


def _cubic_taps(size: int, out: int, scale, align_corners: bool, precision):
    """(indices, weights), each [4, out]: the neighbours at -1, 0, 1, 2 from the tap left of
    each coordinate, clamped to the border (``upsample_get_value_bounded``), and PyTorch's
    ``get_cubic_upsample_coefficients`` (A = -0.75)."""
    low, t = _guarded(_source_index(size, out, scale, align_corners, precision), size)
    a, one = precision(_CUBIC_A), precision(1)
    indices = np.clip(low + np.arange(-1, 3)[:, None], 0, size - 1)
    weights = [_cubic_far(t + one, a), _cubic_near(t, a), _cubic_near(one - t, a)]
    weights.append(_cubic_far(precision(2) - t, a))
    return indices, np.stack(weights).astype(precision)


def _triangle(x: np.ndarray) -> np.ndarray:
    return np.maximum(1 - np.abs(x), 0)


def _keys_cubic(x: np.ndarray) -> np.ndarray:
    x, a = np.abs(x), x.dtype.type(_ANTIALIAS_CUBIC_A)
    return np.where(x < 1, _cubic_near(x, a), np.where(x < 2, _cubic_far(x, a), 0))


_ANTIALIAS_FILTERS = {"bilinear": (2, _triangle), "bicubic": (4, _keys_cubic)}


def _antialias_taps(size: int, out: int, scale, mode: str, align_corners: bool, precision):
    """(indices, weights), each [taps, out]: PyTorch's antialiased windows
    (``_compute_indices_min_size_weights_aa``). Downsampling stretches the filter's support
    by the scale, so every input in the footprint counts; weights are normalised to sum 1.
    A window shorter than ``taps`` repeats its first index with weight 0."""
    interp_size, kernel = _ANTIALIAS_FILTERS[mode]
    factor = _area_scale(size, out, scale, align_corners, precision)
    stretch = factor if factor >= 1 else precision(1)
    support = precision(interp_size * 0.5 * stretch)
    center = (factor * (np.arange(out) + 0.5)).astype(precision)
    start = np.maximum(((center - support) + np.float64(0.5)).astype(np.int64), 0)
    stop = np.minimum(((center + support) + np.float64(0.5)).astype(np.int64), size)
    indices = start + np.arange(int((stop - start).max()))[:, None]
    inside = indices < stop
    distance = ((indices.astype(precision) - center) + np.float64(0.5)) * (1 / stretch)
    weights = np.where(inside, kernel(distance.astype(precision)), 0).astype(precision)
    total = weights[0]
    for row in weights[1:]:  # PyTorch's order, so the normalised weights round alike
        total = total + row
    weights = (weights / np.where(total == 0, 1, total)).astype(precision)
    return np.where(inside, indices, start), weights


def _along(x: Tensor, axis: int, weights: np.ndarray) -> Tensor:
    shape = [1] * x.ndim
    shape[axis] = weights.shape[0]
    return _on_backend_of(x, weights.reshape(shape))


def _is_identity(indices: np.ndarray, weights: np.ndarray, size: int) -> bool:
    if indices.shape[1] != size:
        return False
    own = indices == np.arange(size)
    return bool((np.where(own, weights, 0).sum(0) == 1).all() and not weights[~own].any())


def _weighted_taps(x: Tensor, axis: int, indices: np.ndarray, weights: np.ndarray) -> Tensor:
    """sum_t x[..., indices[t], ...] * weights[t] along ``axis``, summed first tap first
    (PyTorch's order); the identity where the taps are."""
    if _is_identity(indices, weights, x.shape[axis]):
        return x
    result = None
    for picks, tap_weights in zip(indices, weights):
        term = index_select(x, axis, _on_backend_of(x, picks)) * _along(x, axis, tap_weights)
        result = term if result is None else result + term
    return result.to(x.dtype)


def _resample_axis(x: Tensor, axis: int, out: int, scale, mode: str, options) -> Tensor:
    """``x`` resampled to ``out`` entries along ``axis``; ``options``: (align_corners,
    antialias)."""
    size = x.shape[axis]
    if mode in ("nearest", "nearest-exact"):
        picks = _nearest_indices(size, out, scale, mode == "nearest-exact")
        if picks is None:
            return x
        return index_select(x, axis, _on_backend_of(x, picks))
    align_corners, antialias = options
    precision = np.float64 if x.dtype.name == "float64" else np.float32
    if antialias:
        if out == size:  # PyTorch skips the axis
            return x
        taps = _antialias_taps(size, out, scale, mode, align_corners, precision)
    elif mode == "bicubic":
        taps = _cubic_taps(size, out, scale, align_corners, precision)
    else:
        taps = _linear_taps(size, out, scale, align_corners, precision)
    return _weighted_taps(x, axis, *taps)


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
    if antialias and (mode not in _ANTIALIAS_FILTERS or spatial != 2):
        raise ValueError(
            f"interpolate: antialias=True is restricted to the bilinear and bicubic modes "
            f"(with a 4-d input), got mode {mode!r} and input {shown(input)}"
        )
    if mode in _SPATIAL and _SPATIAL[mode] != spatial:
        error = NotImplementedError(  # PyTorch's type, which user_errors leaves alone
            f"interpolate: got a {input.ndim}-d input {shown(input)}, but mode {mode!r} needs "
            f"a {_SPATIAL[mode] + 2}-d input"
        )
        raise at_user_line(error)
    if align_corners is not None and mode not in _SPATIAL:
        raise ValueError(
            "interpolate: align_corners option can only be set with the interpolating modes: "
            "linear | bilinear | bicubic | trilinear"
        )
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
    """Resample input [N, C, *spatial] (1 to 3 spatial dims; bicubic: 2) to ``size`` or
    by ``scale_factor`` (output size ``floor(in * scale_factor)``). ``antialias`` (bilinear
    and bicubic): PyTorch's antialiased filters, whose support grows with the downsampling
    factor."""
    checked_tensor("interpolate", input)
    spatial = _check_mode(input, mode, align_corners, antialias)
    sizes, scales = _output_sizes(input, size, scale_factor, recompute_scale_factor, spatial)
    if any(out <= 0 for out in sizes):
        raise ValueError(
            f"interpolate: input {shown(input)} gives the empty output size {list(sizes)}"
        )
    if mode == "area":
        from flame.nn import pooling

        pools = {
            1: pooling.adaptive_avg_pool1d,
            2: pooling.adaptive_avg_pool2d,
            3: pooling.adaptive_avg_pool3d,
        }
        return pools[spatial](input, sizes)
    result = input
    options = (bool(align_corners), bool(antialias))
    for axis in reversed(range(spatial)):
        result = _resample_axis(result, 2 + axis, sizes[axis], scales[axis], mode, options)
    return result
