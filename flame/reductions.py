"""Reductions, with PyTorch's names and arguments. Four primitives (sum, prod, max, min over
axes, keeping them as size 1); the rest are compositions the fusion pass turns into as few
kernels as possible: ``mean`` is a sum times 1/n, ``var`` two passes over a row in one
kernel, ``argmax`` a max and a min of candidate indices in one kernel."""

from __future__ import annotations

import math
from collections import namedtuple

from flame.amp.autocast_mode import full_precision
from flame.functional import where
from flame.ir import dtypes
from flame.ir.infer import SizeValue
from flame.ir.node import user_site
from flame.ir.shapes import prod
from flame.tensor import Tensor, _with_site, apply_op
from flame.views import narrow, normalize_axes, reshape

ValuesIndices = namedtuple("ValuesIndices", ["values", "indices"])


def _axes(x: Tensor, dim, name: str) -> tuple[int, ...]:
    """``dim`` as sorted non-negative axes; a 0-d tensor takes ``dim`` 0 or -1 (as PyTorch)
    and has no axis to reduce. Errors name the op and the user's line."""
    if not isinstance(x, Tensor):
        raise _with_site(
            TypeError(f"{name}: expected a flame.Tensor, got {type(x).__name__}"), user_site()
        )
    try:
        axes = normalize_axes(dim, x.ndim, name)
    except (IndexError, TypeError, ValueError) as error:
        raise _with_site(error, user_site()) from None
    return () if x.ndim == 0 else axes


def _dim(dim, axis, name: str):
    """PyTorch's ``axis=`` alias of ``dim=``."""
    if axis is None:
        return dim
    if dim is not None:
        raise _with_site(TypeError(f"{name}: got both dim= and axis="), user_site())
    return axis


class EmptyArgReductionError(IndexError, RuntimeError):
    """argmax/argmin of an empty tensor without ``dim``: PyTorch raises an IndexError there
    (a RuntimeError for amax and max); this is both."""


def _nonempty(x: Tensor, axes, dim, name: str, whole=RuntimeError) -> None:
    """max/min-like reductions have no identity: over an empty axis they refuse, as PyTorch
    does (IndexError with a dim; over the whole of an empty tensor ``whole``: RuntimeError,
    ``EmptyArgReductionError`` for argmax/argmin)."""
    empty = [axis for axis in axes if x.shape[axis] == 0]
    if not empty:
        return
    shape = list(x.shape)
    if dim is None:
        error = whole(
            f"{name}: cannot reduce an empty tensor of shape {shape} without dim= "
            "(the reduction has no identity)"
        )
    else:
        error = IndexError(
            f"{name}: expected reduction dim {empty[0]} to have non-zero size, got shape {shape}"
        )
    raise _with_site(error, user_site())


def _reduce(op: str, x: Tensor, dim, keepdim: bool, name: str) -> Tensor:
    axes = _axes(x, dim, name)
    if op in ("reduce_max", "reduce_min") and name not in ("any", "all"):
        _nonempty(x, axes, dim, name)
    if not axes:
        return (
            x.to(dtypes.int64)
            if op in ("reduce_sum", "reduce_prod") and not x.dtype.is_float
            else x
        )
    result = apply_op(op, x, axes=axes)
    return result if keepdim else _drop(result, axes)


def _drop(result: Tensor, axes) -> Tensor:
    if not axes:
        return result
    return reshape(result, tuple(s for axis, s in enumerate(result.shape) if axis not in axes))


def _count(x: Tensor, axes) -> int:
    return prod(x.shape[axis] for axis in axes)


def sum(x, dim=None, keepdim=False, dtype=None, *, axis=None):  # noqa: A001 (PyTorch's name)
    """Sum over ``dim`` (all axes when None). float16/bfloat16 accumulate in float32; bool
    and integers sum to int64. Under autocast, float32 (PyTorch's float32 list), unless
    ``dtype`` is given."""
    if dtype is not None:
        x = x.to(dtype)
    else:
        (x,) = full_precision(x)
    return _reduce("reduce_sum", x, _dim(dim, axis, "sum"), keepdim, "sum")


def plain_sum(x, dim=None, keepdim=False):
    """``sum`` without the autocast policy: the sums inside other ops (mean, var, einsum),
    which keep their input's dtype under autocast, as PyTorch's do."""
    return _reduce("reduce_sum", x, dim, keepdim, "sum")


def prod_(x, dim=None, keepdim=False, dtype=None, *, axis=None):
    if dtype is not None:
        x = x.to(dtype)
    else:
        (x,) = full_precision(x)  # autocast: PyTorch's float32 list
    return _reduce("reduce_prod", x, _dim(dim, axis, "prod"), keepdim, "prod")


def amax(x, dim=None, keepdim=False, *, axis=None):
    return _reduce("reduce_max", x, _dim(dim, axis, "amax"), keepdim, "amax")


def amin(x, dim=None, keepdim=False, *, axis=None):
    return _reduce("reduce_min", x, _dim(dim, axis, "amin"), keepdim, "amin")


def max(x, dim=None, keepdim=False, *, axis=None):  # noqa: A001
    """The maximum (NaN wins, as in PyTorch); with ``dim``, (values, indices), the values
    read at the indices (so the gradient goes to that element, as PyTorch's, not split among
    ties as ``amax``'s); ``max(x, other)`` is ``maximum``."""
    if isinstance(dim, Tensor):
        from flame.functional import maximum

        return maximum(x, dim)
    dim = _dim(dim, axis, "max")
    if dim is None:
        return _reduce("reduce_max", x, None, False, "max")
    _nonempty(x, _axes(x, dim, "max"), dim, "max")  # named as the user's call
    return _at_indices(x, argmax(x, dim, keepdim=True), dim, keepdim)


def min(x, dim=None, keepdim=False, *, axis=None):  # noqa: A001
    if isinstance(dim, Tensor):
        from flame.functional import minimum

        return minimum(x, dim)
    dim = _dim(dim, axis, "min")
    if dim is None:
        return _reduce("reduce_min", x, None, False, "min")
    _nonempty(x, _axes(x, dim, "min"), dim, "min")  # named as the user's call
    return _at_indices(x, argmin(x, dim, keepdim=True), dim, keepdim)


def _at_indices(x: Tensor, indices: Tensor, dim: int, keepdim: bool) -> ValuesIndices:
    from flame.indexing import take_along_dim

    values = take_along_dim(x, indices, dim) if x.ndim else x
    if not keepdim and x.ndim:
        values, indices = values.squeeze(dim), indices.squeeze(dim)
    return ValuesIndices(values, indices)


def mean(x, dim=None, keepdim=False, dtype=None, *, axis=None):
    """The sum times 1/n; over an empty axis NaN (0 * NaN), as PyTorch."""
    dim = _dim(dim, axis, "mean")
    if dtype is not None:
        x = x.to(dtype)
    if not x.dtype.is_float:
        raise _with_site(
            TypeError(f"mean: needs a float tensor, got {x.dtype.name} (pass dtype=)"),
            user_site(),
        )
    axes = _axes(x, dim, "mean")
    count = _count(x, axes)
    # scale before dropping axes, so the scaling stays in the reduction's kernel; 1/n is a
    # kernel argument (SizeValue): a new size runs the same kernel
    scale = SizeValue(1.0 / count, f"1/n{list(axes)}") if count else math.nan
    result = plain_sum(x, axes, keepdim=True) * scale
    return result if keepdim else _drop(result, axes)


def var(x, dim=None, correction=1, keepdim=False, *, axis=None, unbiased=None):
    """Variance with Bessel's ``correction`` (1: unbiased), computed as the mean squared
    deviation from the mean (two passes over the data, one kernel). With ``correction >= n``
    the divisor is 0, as in PyTorch: inf, or NaN where every deviation is 0 (or n is 0)."""
    dim = _dim(dim, axis, "var")
    if unbiased is not None:  # PyTorch's older keyword: unbiased=False is correction=0
        correction = int(bool(unbiased))
    if not x.dtype.is_float:
        raise _with_site(TypeError(f"var: needs a float tensor, got {x.dtype.name}"), user_site())
    axes = _axes(x, dim, "var")
    count = _count(x, axes)
    divisor = _max(count - correction, 0)
    center = mean(x, axes, keepdim=True)
    if not divisor and count:
        center = _exact_center(x, axes)
    deviation = x - center
    role = f"1/(n-{correction}){list(axes)}"
    scale = SizeValue(1.0 / divisor, role) if divisor else math.inf
    result = plain_sum(deviation * deviation, axes, keepdim=True) * scale
    return result if keepdim else _drop(result, axes)


def _exact_center(x: Tensor, axes) -> Tensor:
    """The mean, detached, shifted by each slice's first element: a constant slice gets its
    value exactly (sum * 1/n need not), so its squared deviations are exactly 0 and
    0 / 0 gives NaN, as PyTorch's; and the mean's branch of the backward, which would add
    inf - inf to PyTorch's cotangent 2 * (x - mean) / 0, is cut (its share is 0 anyway)."""
    first = x.detach()
    for axis in axes:
        first = narrow(first, axis, 0, 1)
    return first + mean(x.detach() - first, axes, keepdim=True)


def _max(a, b):
    return a if a > b else b


def std(x, dim=None, correction=1, keepdim=False, *, axis=None, unbiased=None):
    """sqrt(var); where the variance is 0 the gradient is 0, as PyTorch's (sqrt's own
    derivative there, 1 / 0, would turn it into inf * 0 = NaN)."""
    dim = _dim(dim, axis, "std")
    variance = var(x, dim, correction, keepdim=True, unbiased=unbiased)
    zero = variance == 0.0
    result = where(zero, 0.0, where(zero, 1.0, variance).sqrt())
    return result if keepdim else _drop(result, _axes(x, dim, "std"))


def logsumexp(x, dim=None, keepdim=False, *, axis=None):
    """log(sum(exp(x))) without overflow: the row's max is taken out first (over an empty
    axis: log(0) = -inf, as PyTorch)."""
    dim = _dim(dim, axis, "logsumexp")
    axes = _axes(x, dim, "logsumexp")
    if not _count(x, axes):
        result = plain_sum(x.exp(), axes, keepdim=True).log()
        return result if keepdim else _drop(result, axes)
    peak = amax(x.detach(), dim, keepdim=True)  # the result does not change with the shift
    finite_peak = where(peak.abs() == float("inf"), 0.0, peak)
    total = plain_sum((x - finite_peak).exp(), axes, keepdim=True)
    result = total.log() + finite_peak
    return result if keepdim else _drop(result, axes)


def any(x, dim=None, keepdim=False, *, axis=None):  # noqa: A001
    """True where any element is; over an empty axis False (the identity), as PyTorch."""
    return _reduce("reduce_max", x.to(dtypes.bool_), _dim(dim, axis, "any"), keepdim, "any")


def all(x, dim=None, keepdim=False, *, axis=None):  # noqa: A001
    """True where every element is; over an empty axis True (the identity), as PyTorch."""
    return _reduce("reduce_min", x.to(dtypes.bool_), _dim(dim, axis, "all"), keepdim, "all")


def _arg(x: Tensor, dim, keepdim, pick, name) -> Tensor:
    if dim is None:
        _nonempty(x, _axes(x, None, name), None, name, EmptyArgReductionError)
        flat = reshape(x, (-1,))
        return (
            _arg(flat, 0, False, pick, name)
            if not keepdim
            else reshape(_arg(flat, 0, False, pick, name), (1,) * x.ndim)
        )
    axes = _axes(x, dim, name)
    if x.ndim == 0:  # the one element is at index 0
        return where(x == x, 0, 0).to(dtypes.int64)
    _nonempty(x, axes, dim, name)
    (axis,) = axes
    best = pick(x, axis, keepdim=True)
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    from flame.creation import arange

    position = reshape(arange(x.shape[axis]), tuple(shape))
    hit = (x == best) | (x != x) if x.dtype.is_float else (x == best)
    candidate = where(hit, position, x.shape[axis])
    return amin(candidate, axis, keepdim)


def argmax(x, dim=None, keepdim=False, *, axis=None):
    """Index of the first maximum (of the first NaN, as in PyTorch)."""
    return _arg(x, _dim(dim, axis, "argmax"), keepdim, amax, "argmax")


def argmin(x, dim=None, keepdim=False, *, axis=None):
    return _arg(x, _dim(dim, axis, "argmin"), keepdim, amin, "argmin")


# --- pairs of reductions -----------------------------------------------------------------------

MinMax = namedtuple("aminmax", ["min", "max"])  # as torch.return_types.aminmax


def aminmax(input, *, dim=None, keepdim=False):  # noqa: A002 (PyTorch's name)
    """``(amin, amax)`` over ``dim`` (all axes when None) as a named tuple ``(min, max)``;
    the gradient splits among ties, as ``amin``'s and ``amax``'s."""
    axes = _axes(input, dim, "aminmax")
    _nonempty(input, axes, dim, "aminmax")
    return MinMax(amin(input, dim, keepdim), amax(input, dim, keepdim))


def count_nonzero(input, dim=None):  # noqa: A002
    """How many entries are not 0 (NaN counts; -0.0 does not), over ``dim`` (an int or a
    tuple; all axes when None or empty), as int64."""
    axes = _axes(input, dim, "count_nonzero")
    return sum(input != 0, axes if axes else None)


def _correction(name: str, x, dim, unbiased, correction):
    """PyTorch's three spellings: ``f(x, unbiased)``, ``f(x, dim, unbiased, keepdim)`` and
    ``f(x, dim, *, correction, keepdim)``: ``(dim, correction)``."""
    if not isinstance(x, Tensor):
        raise _with_site(
            TypeError(f"{name}: expected a flame.Tensor, got {type(x).__name__}"), user_site()
        )
    if isinstance(dim, bool):  # f(x, True): the bool is ``unbiased``
        dim, unbiased = None, dim if unbiased is None else unbiased
    if unbiased is not None and correction is not None:
        raise _with_site(TypeError(f"{name}: give unbiased or correction, not both"), user_site())
    if not x.dtype.is_float:
        raise _with_site(
            TypeError(f"{name}: needs a float tensor, got {x.dtype.name}{list(x.shape)}"),
            user_site(),
        )
    if unbiased is not None:
        return dim, int(bool(unbiased))
    return dim, 1 if correction is None else correction


def var_mean(input, dim=None, unbiased=None, keepdim=False, *, correction=None):  # noqa: A002
    """``(var, mean)`` over ``dim``: a plain tuple, as PyTorch's."""
    dim, correction = _correction("var_mean", input, dim, unbiased, correction)
    return var(input, dim, correction, keepdim), mean(input, dim, keepdim)


def std_mean(input, dim=None, unbiased=None, keepdim=False, *, correction=None):  # noqa: A002
    """``(std, mean)`` over ``dim``: a plain tuple, as PyTorch's."""
    dim, correction = _correction("std_mean", input, dim, unbiased, correction)
    return std(input, dim, correction, keepdim), mean(input, dim, keepdim)


for _name, _function in (
    ("sum", sum), ("prod", prod_), ("amax", amax), ("amin", amin), ("max", max), ("min", min),
    ("mean", mean), ("var", var), ("std", std), ("logsumexp", logsumexp), ("any", any),
    ("all", all), ("argmax", argmax), ("argmin", argmin), ("aminmax", aminmax),
    ("count_nonzero", count_nonzero),
):  # fmt: skip
    setattr(Tensor, _name, _function)

__all__ = [
    "all", "amax", "amin", "aminmax", "any", "argmax", "argmin", "count_nonzero", "logsumexp",
    "max", "mean", "min", "std", "std_mean", "sum", "var", "var_mean",
]  # fmt: skip
