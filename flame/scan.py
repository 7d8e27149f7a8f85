"""Cumulative ops along one dim, as in PyTorch: ``cumsum cumprod cummax cummin
logcumsumexp``, as ``flame.op(x, dim)`` and ``x.op(dim)``.

Each is one library op (``flame/ir/ops/scan.py``): a scan is linear work in one pass, never a
triangular matmul. Integer and bool inputs of ``cumsum``/``cumprod`` give int64, as PyTorch.
``cummax``/``cummin`` return (values, indices); the values are read at the indices, so their
gradient reaches the selected positions only.
"""

from __future__ import annotations

from flame.amp.autocast_mode import full_precision
from flame.backend import backend as use_backend
from flame.creation import zeros
from flame.indexing import take_along_dim
from flame.ir import dtypes
from flame.ir.ops import scan as _declarations  # noqa: F401  (registers the ops)
from flame.reductions import ValuesIndices
from flame.shaping import checked_tensor, user_errors
from flame.tensor import Tensor, apply_op
from flame.views import normalize_axis


def _prepared(op: str, x, dim, dtype=None) -> tuple[Tensor, int]:
    checked_tensor(op, x)
    if dtype is not None:
        x = x.to(dtype)
    elif not x.dtype.is_float:
        x = x.to(dtypes.int64)  # PyTorch accumulates integers and bools in int64
    return x, normalize_axis(dim, x.ndim, op)


@user_errors
def cumsum(input: Tensor, dim: int, dtype=None) -> Tensor:  # noqa: A002 (PyTorch's names)
    """``out[i] = input[0] + ... + input[i]`` along ``dim``."""
    if dtype is None:
        (input,) = full_precision(input)  # autocast: float32 (PyTorch's list)
    x, axis = _prepared("cumsum", input, dim, dtype)
    return apply_op("cumsum", x, dim=axis)


@user_errors
def cumprod(input: Tensor, dim: int, dtype=None) -> Tensor:  # noqa: A002
    """``out[i] = input[0] * ... * input[i]`` along ``dim`` (gradient defined at zeros)."""
    if dtype is None:
        (input,) = full_precision(input)  # autocast: float32
    x, axis = _prepared("cumprod", input, dim, dtype)
    return apply_op("cumprod", x, dim=axis)


@user_errors
def logcumsumexp(input: Tensor, dim: int) -> Tensor:  # noqa: A002
    """``log(cumsum(exp(input)))`` along ``dim``, without overflow."""
    checked_tensor("logcumsumexp", input)
    if not input.dtype.is_float:
        raise TypeError(f"logcumsumexp: needs a float input, got {input.dtype.name}")
    axis = normalize_axis(dim, input.ndim, "logcumsumexp")
    return apply_op("logcumsumexp", input, dim=axis)


def _cumulative_extreme(op: str, x, dim, largest: bool) -> ValuesIndices:
    checked_tensor(op, x)
    axis = normalize_axis(dim, x.ndim, op)
    if x.numel() == 0:  # no running extreme to find: empty results, as PyTorch's
        with use_backend(x.backend):
            indices = zeros(x.shape, dtype=dtypes.int64)
        return ValuesIndices(take_along_dim(x, indices, axis), indices)
    indices = apply_op("cumextreme_index", x, dim=axis, largest=largest)
    if x.ndim == 0:
        return ValuesIndices(x, indices)
    return ValuesIndices(take_along_dim(x, indices, axis), indices)


@user_errors
def cummax(input: Tensor, dim: int) -> ValuesIndices:  # noqa: A002
    """Running maximum and its index along ``dim`` (ties: the later index; NaN sticks)."""
    return _cumulative_extreme("cummax", input, dim, largest=True)


@user_errors
def cummin(input: Tensor, dim: int) -> ValuesIndices:  # noqa: A002
    """Running minimum and its index along ``dim`` (ties: the later index; NaN sticks)."""
    return _cumulative_extreme("cummin", input, dim, largest=False)


for _name, _function in (
    ("cumsum", cumsum), ("cumprod", cumprod), ("logcumsumexp", logcumsumexp),
    ("cummax", cummax), ("cummin", cummin),
):  # fmt: skip
    if not hasattr(Tensor, _name):
        setattr(Tensor, _name, _function)

__all__ = ["cummax", "cummin", "cumprod", "cumsum", "logcumsumexp"]
