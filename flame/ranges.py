"""Creation helpers with PyTorch's names: ``linspace logspace eye tril_indices
triu_indices``.

``linspace``, ``logspace`` and ``eye`` are lazy (an ``arange`` and elementwise ops, fused into
whatever reads them); the triangle indices depend only on the sizes, so they are computed
on the host when built, as constants.
"""

from __future__ import annotations

import numpy as np

from flame.creation import arange, creation, tensor
from flame.functional import where
from flame.ir import dtypes
from flame.shaping import user_errors
from flame.views import reshape


def _count(op: str, value, what: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__") or value.__index__() < 0:
        raise ValueError(f"{op}: {what} must be a non-negative int, got {value!r}")
    return value.__index__()


def _number(value):
    return value.item() if hasattr(value, "item") else value


@user_errors
@creation
def linspace(start, end, steps: int, *, dtype=None):
    """``steps`` values from ``start`` to ``end`` inclusive, evenly spaced. As PyTorch, the
    first half counts up from ``start`` and the second half down from ``end``, so both
    ends are exact."""
    steps = _count("linspace", steps, "steps")
    target = dtypes.dtype(dtype) if dtype is not None else dtypes.DEFAULT_FLOAT
    start, end = _number(start), _number(end)
    compute = target if target.is_float else dtypes.float32
    if steps <= 1:
        values = arange(steps, dtype=compute) + float(start)
    else:
        step = (end - start) / (steps - 1)
        position = arange(steps, dtype=compute)
        rising = position * step + float(start)
        falling = float(end) - (float(steps - 1) - position) * step
        values = where(position < steps // 2, rising, falling)
    return values.to(target)


@user_errors
@creation
def logspace(start, end, steps: int, base: float = 10.0, *, dtype=None):
    """``base ** linspace(start, end, steps)``."""
    target = dtypes.dtype(dtype) if dtype is not None else dtypes.DEFAULT_FLOAT
    compute = target if target.is_float else dtypes.float32
    exponents = linspace(start, end, steps, dtype=compute)
    return (float(base) ** exponents).to(target)


@user_errors
@creation
def eye(n: int, m: int | None = None, *, dtype=None):
    """The ``n`` x ``m`` identity matrix (``m = n`` when None)."""
    rows = _count("eye", n, "n")
    columns = rows if m is None else _count("eye", m, "m")
    target = dtypes.dtype(dtype) if dtype is not None else dtypes.DEFAULT_FLOAT
    same = reshape(arange(rows), (rows, 1)) == reshape(arange(columns), (1, columns))
    return same.to(target)


def _triangle_indices(op: str, row, col, offset, dtype, upper: bool):
    rows, columns = _count(op, row, "row"), _count(op, col, "col")
    if upper:
        picked = np.triu_indices(rows, offset, columns)
    else:
        picked = np.tril_indices(rows, offset, columns)
    target = dtypes.dtype(dtype) if dtype is not None else dtypes.int64
    if not target.is_int:
        raise TypeError(f"{op}: dtype must be an integer type, got {target.name}")
    return tensor(np.stack(picked).reshape(2, -1), dtype=target)


@user_errors
@creation
def tril_indices(row: int, col: int, offset: int = 0, *, dtype=None):
    """The [2, N] coordinates of the lower triangle of a ``row`` x ``col`` matrix, row by
    row (``offset``: which diagonal bounds it)."""
    return _triangle_indices("tril_indices", row, col, offset, dtype, upper=False)


@user_errors
@creation
def triu_indices(row: int, col: int, offset: int = 0, *, dtype=None):
    """The [2, N] coordinates of the upper triangle of a ``row`` x ``col`` matrix."""
    return _triangle_indices("triu_indices", row, col, offset, dtype, upper=True)


__all__ = ["eye", "linspace", "logspace", "tril_indices", "triu_indices"]
