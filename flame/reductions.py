"""Reductions, with PyTorch's names and arguments. Four primitives (sum, prod, max, min over
axes, keeping them as size 1); the rest are compositions the fusion pass turns into as few
kernels as possible: ``mean`` is a sum times 1/n, ``var`` two passes over a row in one
kernel, ``argmax`` a max and a min of candidate indices in one kernel."""

from __future__ import annotations

from collections import namedtuple

from flame.functional import where
from flame.ir import dtypes
from flame.ir.shapes import prod
from flame.tensor import Tensor, apply_op
from flame.views import normalize_axes, reshape

ValuesIndices = namedtuple("ValuesIndices", ["values", "indices"])


def _reduce(op: str, x: Tensor, dim, keepdim: bool, name: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a flame.Tensor, got {type(x).__name__}")
    axes = normalize_axes(dim, x.ndim, name)
    if not axes:
        return (
            x.to(dtypes.int64)
            if op in ("reduce_sum", "reduce_prod") and not x.dtype.is_float
            else x
        )
    result = apply_op(op, x, axes=axes)
    return result if keepdim else _drop(result, axes)


def _drop(result: Tensor, axes) -> Tensor:
    return reshape(result, tuple(s for axis, s in enumerate(result.shape) if axis not in axes))


def _count(x: Tensor, dim) -> int:
    return prod(x.shape[axis] for axis in normalize_axes(dim, x.ndim, "mean"))


def sum(x, dim=None, keepdim=False, dtype=None):  # noqa: A001 (PyTorch's name)
    """Sum over ``dim`` (all axes when None). float16/bfloat16 accumulate in float32; bool
    and integers sum to int64."""
    if dtype is not None:
        x = x.to(dtype)
    return _reduce("reduce_sum", x, dim, keepdim, "sum")


def prod_(x, dim=None, keepdim=False, dtype=None):
    if dtype is not None:
        x = x.to(dtype)
    return _reduce("reduce_prod", x, dim, keepdim, "prod")


def amax(x, dim=None, keepdim=False):
    return _reduce("reduce_max", x, dim, keepdim, "amax")


def amin(x, dim=None, keepdim=False):
    return _reduce("reduce_min", x, dim, keepdim, "amin")


def max(x, dim=None, keepdim=False):  # noqa: A001
    """The maximum (NaN wins, as in PyTorch); with ``dim``, (values, indices)."""
    if dim is None:
        return amax(x)
    return ValuesIndices(amax(x, dim, keepdim), argmax(x, dim, keepdim))


def min(x, dim=None, keepdim=False):  # noqa: A001
    if dim is None:
        return amin(x)
    return ValuesIndices(amin(x, dim, keepdim), argmin(x, dim, keepdim))


def mean(x, dim=None, keepdim=False, dtype=None):
    if dtype is not None:
        x = x.to(dtype)
    if not x.dtype.is_float:
        raise TypeError(f"mean: needs a float tensor, got {x.dtype.name} (pass dtype=)")
    # scale before dropping axes, so the scaling stays in the reduction's kernel
    result = sum(x, dim, keepdim=True) * (1.0 / _count(x, dim))
    return result if keepdim else _drop(result, normalize_axes(dim, x.ndim, "mean"))


def var(x, dim=None, correction=1, keepdim=False):
    """Variance with Bessel's ``correction`` (1: unbiased), computed as the mean squared
    deviation from the mean (two passes over the data, one kernel)."""
    if not x.dtype.is_float:
        raise TypeError(f"var: needs a float tensor, got {x.dtype.name}")
    count = _count(x, dim)
    deviation = x - mean(x, dim, keepdim=True)
    result = sum(deviation * deviation, dim, keepdim=True) * (1.0 / _max(count - correction, 0))
    return result if keepdim else _drop(result, normalize_axes(dim, x.ndim, "var"))


def _max(a, b):
    return a if a > b else b


def std(x, dim=None, correction=1, keepdim=False):
    result = var(x, dim, correction, keepdim=True).sqrt()
    return result if keepdim else _drop(result, normalize_axes(dim, x.ndim, "std"))


def logsumexp(x, dim, keepdim=False):
    """log(sum(exp(x))) without overflow: the row's max is taken out first."""
    peak = amax(x, dim, keepdim=True)
    finite_peak = where(peak.abs() == float("inf"), 0.0, peak)
    total = sum((x - finite_peak).exp(), dim, keepdim=True)
    result = total.log() + finite_peak
    return result if keepdim else _drop(result, normalize_axes(dim, x.ndim, "logsumexp"))


def any(x, dim=None, keepdim=False):  # noqa: A001
    return _reduce("reduce_max", x.to(dtypes.bool_), dim, keepdim, "any")


def all(x, dim=None, keepdim=False):  # noqa: A001
    return _reduce("reduce_min", x.to(dtypes.bool_), dim, keepdim, "all")


def _arg(x: Tensor, dim, keepdim, pick, name) -> Tensor:
    if dim is None:
        flat = reshape(x, (-1,))
        return (
            _arg(flat, 0, False, pick, name)
            if not keepdim
            else reshape(_arg(flat, 0, False, pick, name), (1,) * x.ndim)
        )
    (axis,) = normalize_axes(dim, x.ndim, name)
    best = pick(x, axis, keepdim=True)
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    from flame.creation import arange

    position = reshape(arange(x.shape[axis]), tuple(shape))
    hit = (x == best) | (x != x) if x.dtype.is_float else (x == best)
    candidate = where(hit, position, x.shape[axis])
    return amin(candidate, axis, keepdim)


def argmax(x, dim=None, keepdim=False):
    """Index of the first maximum (of the first NaN, as in PyTorch)."""
    return _arg(x, dim, keepdim, amax, "argmax")


def argmin(x, dim=None, keepdim=False):
    return _arg(x, dim, keepdim, amin, "argmin")


for _name, _function in (
    ("sum", sum), ("prod", prod_), ("amax", amax), ("amin", amin), ("max", max), ("min", min),
    ("mean", mean), ("var", var), ("std", std), ("logsumexp", logsumexp), ("any", any),
    ("all", all), ("argmax", argmax), ("argmin", argmin),
):  # fmt: skip
    setattr(Tensor, _name, _function)

__all__ = [
    "all", "amax", "amin", "any", "argmax", "argmin", "logsumexp", "max", "mean", "min",
    "std", "sum", "var",
]  # fmt: skip
