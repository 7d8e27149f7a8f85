"""Norms and closeness, with PyTorch's names: ``norm`` (vector norms of any order, the
Frobenius matrix norm), ``isclose``, ``allclose``.

The norms are compositions of reductions. A root of a sum is taken through ``_root``, whose
gradient is 0 where the sum is 0 (PyTorch's subgradient of a norm at the origin) instead of
the 0 * inf = NaN a plain ``sqrt`` would give there.
"""

from __future__ import annotations

import math

from flame import reductions as R
from flame.functional import where
from flame.ir import dtypes
from flame.shaping import checked_tensor, user_errors
from flame.tensor import Tensor
from flame.views import normalize_axes


def _root(total: Tensor, order: float) -> Tensor:
    is_zero = total == 0
    safe = where(is_zero, 1.0, total)
    root = safe.sqrt() if order == 2 else safe ** (1.0 / order)
    return where(is_zero, 0.0, root)


def vector_norm(x: Tensor, ord=2, dim=None, keepdim: bool = False, dtype=None) -> Tensor:  # noqa: A002
    """``torch.linalg.vector_norm``: the ``ord``-norm over ``dim`` (all dims when None)."""
    checked_tensor("vector_norm", x)
    if dtype is not None:
        x = x.to(dtype)
    if not x.dtype.is_float:
        raise TypeError(f"norm: needs a float input, got {x.dtype.name}{list(x.shape)}")
    axes = normalize_axes(dim, x.ndim, "norm")
    order = float(ord)
    magnitude = x.abs()
    if order in (math.inf, -math.inf):
        empty = [axis for axis in axes if x.shape[axis] == 0]
        if empty:  # a max/min over nothing: refused, as PyTorch refuses it
            over = "the whole tensor" if dim is None else f"dim {empty[0]}"
            raise RuntimeError(
                f"norm: cannot take the {ord} norm of {x.dtype.name}{list(x.shape)} over "
                f"{over}, which is empty (the operation has no identity)"
            )
        pick = R.amax if order == math.inf else R.amin
        return pick(magnitude, axes, keepdim)
    if order == 0:
        return R.sum((x != 0).to(x.dtype), axes, keepdim)
    if order == 1:
        return R.sum(magnitude, axes, keepdim)
    if order == 2:
        return _root(R.sum(x * x, axes, keepdim), 2)
    return _root(R.sum(magnitude**order, axes, keepdim), order)


@user_errors
def norm(input: Tensor, p="fro", dim=None, keepdim: bool = False, dtype=None) -> Tensor:  # noqa: A002
    """``torch.norm``: ``p="fro"`` (the square root of the sum of squares, over ``dim`` or
    everything) or a number (a vector norm over ``dim``: ``inf``, ``-inf``, 0, 1, 2, any
    other order). The nuclear norm needs an SVD, which FLAME does not have."""
    checked_tensor("norm", input)
    if p == "fro":
        if dim is not None and len(normalize_axes(dim, input.ndim, "norm")) > 2:
            raise ValueError(f"norm: 'fro' takes at most 2 dims, got dim={dim}")
        return vector_norm(input, 2, dim, keepdim, dtype)
    if isinstance(p, str):
        raise ValueError(f"norm: p must be 'fro' or a number, got {p!r} (no nuclear norm)")
    return vector_norm(input, p, dim, keepdim, dtype)


@user_errors
def isclose(input: Tensor, other, rtol: float = 1e-05, atol: float = 1e-08,  # noqa: A002
            equal_nan: bool = False) -> Tensor:  # fmt: skip
    """``|input - other| <= atol + rtol * |other|`` elementwise (equal infinities are
    close; NaN is close to NaN only with ``equal_nan``)."""
    checked_tensor("isclose", input)
    if rtol < 0 or atol < 0:
        raise ValueError(f"isclose: rtol ({rtol}) and atol ({atol}) must be non-negative")
    equal = input == other
    if input.dtype.is_bool and (not isinstance(other, Tensor) or other.dtype.is_bool):
        return equal
    left = input if input.dtype.is_float else input.to(dtypes.float32)
    difference = (left - other).abs()
    scale = other.abs() if isinstance(other, Tensor) else abs(other)
    # an infinity is close only to itself (an infinite difference would pass an infinite scale)
    close = equal | ((difference <= atol + rtol * scale) & (difference != math.inf))
    if equal_nan:
        close = close | ((input != input) & (other != other))
    return close


def allclose(input: Tensor, other, rtol: float = 1e-05, atol: float = 1e-08,  # noqa: A002
             equal_nan: bool = False) -> bool:  # fmt: skip
    """Whether every element is ``isclose`` (a Python bool: reads the values)."""
    return bool(R.all(isclose(input, other, rtol, atol, equal_nan)).item())


for _name, _function in (("norm", norm), ("isclose", isclose), ("allclose", allclose)):
    if not hasattr(Tensor, _name):
        setattr(Tensor, _name, _function)

__all__ = ["allclose", "isclose", "norm", "vector_norm"]
