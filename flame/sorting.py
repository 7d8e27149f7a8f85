"""Sorting along one dim, as in PyTorch: ``sort``, ``argsort``, ``topk``.

One library op, ``argsort`` (``flame/ir/ops/scan.py``; a stable sort on the GPU), gives the
order; the values are ``take_along_dim`` of the input at those indices, so the gradient of
the values reaches the selected positions (a scatter-add), as in PyTorch. The sort is always
stable: ``stable=False`` gives the same result (PyTorch leaves the order of ties free there).
NaN sorts as the largest value.
"""

from __future__ import annotations

from flame.backend import backend as use_backend
from flame.creation import zeros
from flame.indexing import take_along_dim
from flame.ir import dtypes
from flame.ir.ops import scan as _declarations  # noqa: F401  (registers argsort)
from flame.ir.shapes import ShapeError
from flame.reductions import ValuesIndices
from flame.shaping import checked_tensor, user_errors
from flame.tensor import Tensor, apply_op
from flame.views import narrow, normalize_axis


def _order(op: str, x, dim, descending) -> tuple[Tensor, int]:
    checked_tensor(op, x)
    axis = normalize_axis(dim, x.ndim, op)
    indices = apply_op("argsort", x, dim=axis, descending=bool(descending), stable=True)
    return indices, axis


@user_errors
def argsort(input: Tensor, dim: int = -1, descending: bool = False, stable: bool = False):  # noqa: A002
    """Indices (int64) that sort ``input`` along ``dim``."""
    return _order("argsort", input, dim, descending)[0]


@user_errors
def sort(input: Tensor, dim: int = -1, descending: bool = False, stable: bool = False):  # noqa: A002
    """``(values, indices)`` of ``input`` sorted along ``dim``."""
    indices, axis = _order("sort", input, dim, descending)
    if input.ndim == 0:
        return ValuesIndices(input, indices)
    return ValuesIndices(take_along_dim(input, indices, axis), indices)


@user_errors
def topk(input: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):  # noqa: A002
    """The ``k`` largest (``largest=False``: smallest) entries along ``dim`` and their
    indices, in sorted order (``sorted=False`` gives the same order)."""
    checked_tensor("topk", input)
    axis = normalize_axis(dim, input.ndim, "topk")
    size = input.shape[axis] if input.ndim else 1
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= size:
        raise ShapeError(
            f"topk: k ({k!r}) must be in [0, {size}] for dim {dim} of input "
            f"{input.dtype.name}{list(input.shape)}"
        )
    if k == 0 and input.ndim:  # nothing to select: no sort
        shape = list(input.shape)
        shape[axis] = 0
        with use_backend(input.backend):
            indices = zeros(tuple(shape), dtype=dtypes.int64)
        return ValuesIndices(take_along_dim(input, indices, axis), indices)
    indices, axis = _order("topk", input, axis, largest)
    if input.ndim == 0:
        return ValuesIndices(input, indices)
    indices = narrow(indices, axis, 0, k)
    return ValuesIndices(take_along_dim(input, indices, axis), indices)


def msort(input: Tensor) -> Tensor:  # noqa: A002
    """``sort(input, dim=0).values``."""
    return sort(input, 0).values


for _name, _function in (("argsort", argsort), ("sort", sort), ("topk", topk), ("msort", msort)):
    if not hasattr(Tensor, _name):
        setattr(Tensor, _name, _function)

__all__ = ["argsort", "msort", "sort", "topk"]
