"""Scans and sorts along one axis: ``cumsum``, ``cumprod``, ``logcumsumexp``, the running
arg-extreme ``cumextreme_index`` (cummax/cummin) and ``argsort``.

They are library ops (fusion boundaries): a scan carries a value from one element to the next,
which none of FLAME's kernel shapes does, so on the GPU they run as CuPy routines or small
row kernels (``flame/runtime/library_scan.py``). ``dim`` is normalized (``0 <= dim < rank``)
by the front end (``flame/scan.py``, ``flame/sorting.py``), which also casts integer and bool
inputs of ``cumsum``/``cumprod`` to int64, as PyTorch does.

``cummax``/``cummin`` and ``sort``/``topk`` give values as ``take_along_dim`` of the input at
the indices these ops return, so their gradients are ``take_along_dim``'s (a scatter-add to
the selected positions), exactly PyTorch's.
"""

from __future__ import annotations

import numpy as np

from flame.ir import dtypes
from flame.ir.ops.registry import def_op, def_vjp
from flame.ir.shapes import ShapeError


def _shown(node) -> str:
    return f"{node.dtype.name}{list(node.shape)}"


def _check_dim(op: str, node, dim) -> None:
    rank = len(node.shape)
    if not isinstance(dim, int) or not 0 <= dim < max(rank, 1):
        raise ShapeError(f"{op}: dim {dim} is out of range for input {_shown(node)}")


def _same_type_rule(op: str, allow_bool: bool = False, floats_only: bool = False):
    def rule(inputs, attrs):
        (source,) = inputs
        _check_dim(op, source, attrs["dim"])
        if source.dtype.is_bool and not allow_bool:
            raise TypeError(f"{op}: not defined for bool (input {_shown(source)})")
        if floats_only and not source.dtype.is_float:
            raise TypeError(f"{op}: needs a float input, got {_shown(source)}")
        return source.dtype, source.shape

    return rule


def _index_rule(op: str):
    def rule(inputs, attrs):
        (source,) = inputs
        _check_dim(op, source, attrs["dim"])
        return dtypes.int64, source.shape

    return rule


def _axis(array: np.ndarray, dim: int) -> int:
    # a 0-d input scans over its one element (PyTorch accepts dim 0 and -1 there)
    return dim if array.ndim else None


def _cumsum_ref(x, dim=0):
    return np.cumsum(x, axis=_axis(x, dim)).reshape(x.shape)


def _cumprod_ref(x, dim=0):
    return np.cumprod(x, axis=_axis(x, dim)).reshape(x.shape)


def _logcumsumexp_ref(x, dim=0):
    if x.ndim == 0:
        return x.copy()
    return np.logaddexp.accumulate(x, axis=dim)


def _cumextreme_index_ref(x, dim=0, largest=True):
    """PyTorch's rule: an element replaces the running extreme when it is NaN or at least as
    large (small) as it, so ties take the later index and a NaN sticks."""
    if x.ndim == 0:
        return np.zeros((), np.int64)
    moved = np.moveaxis(x, dim, 0)
    out = np.zeros(moved.shape, np.int64)
    best, best_index = moved[0].copy(), np.zeros(moved.shape[1:], np.int64)
    for position in range(moved.shape[0]):
        value = moved[position]
        better = value >= best if largest else value <= best
        if value.dtype.kind == "f":
            better = np.isnan(value) | (better & ~np.isnan(best))
        best = np.where(better, value, best)
        best_index = np.where(better, position, best_index)
        out[position] = best_index
    return np.moveaxis(out, 0, dim)


def stable_argsort(x: np.ndarray, dim: int, descending: bool, xp=np) -> np.ndarray:
    """Indices that sort ``x`` along ``dim``, equal elements in their original order (NaN
    last ascending, first descending, as PyTorch). Descending sorts the reversed axis
    ascending and reverses back, which keeps ties in order without negating values (which
    would break unsigned and bool inputs). ``xp``: NumPy or CuPy."""
    if x.ndim == 0:
        return xp.zeros((), xp.int64)
    if not descending:
        return xp.argsort(x, axis=dim, kind="stable").astype(xp.int64)
    size = x.shape[dim]
    reversed_order = xp.argsort(xp.flip(x, dim), axis=dim, kind="stable")
    return (size - 1 - xp.flip(reversed_order, dim)).astype(xp.int64)


def _argsort_ref(x, dim=0, descending=False, stable=True):
    return stable_argsort(x, dim, descending)


def_op(
    "cumsum", "library", 1, ref=_cumsum_ref, shape_rule=_same_type_rule("cumsum"),
    attrs={"dim": 0}, categories="if",
    doc="running sum along dim (torch.cumsum; ints arrive as int64)",
)  # fmt: skip
def_op(
    "cumprod", "library", 1, ref=_cumprod_ref, shape_rule=_same_type_rule("cumprod"),
    attrs={"dim": 0}, categories="if",
    doc="running product along dim (torch.cumprod; ints arrive as int64)",
)  # fmt: skip
def_op(
    "logcumsumexp", "library", 1, ref=_logcumsumexp_ref,
    shape_rule=_same_type_rule("logcumsumexp", floats_only=True), attrs={"dim": 0},
    categories="f", doc="log(cumsum(exp(x))) along dim without overflow (torch.logcumsumexp)",
)  # fmt: skip
def_op(
    "cumextreme_index", "library", 1, ref=_cumextreme_index_ref,
    shape_rule=_index_rule("cumextreme_index"), attrs={"dim": 0, "largest": True},
    differentiable=False,
    doc="int64 index of the running max (largest) or min along dim (torch.cummax/cummin)",
)  # fmt: skip
def_op(
    "argsort", "library", 1, ref=_argsort_ref, shape_rule=_index_rule("argsort"),
    attrs={"dim": 0, "descending": False, "stable": True}, differentiable=False,
    doc="int64 indices that sort along dim, ties in input order (torch.argsort)",
)  # fmt: skip


# --- backward rules ---------------------------------------------------------------------------
# The rules call the front end (flame/scan.py) for the scans they are made of; imported inside
# the rule because the front end imports this module.


def _reverse_cumsum(g, dim):
    from flame.scan import cumsum
    from flame.views import flip

    return flip(cumsum(flip(g, dim), dim), dim)


def _cumsum_vjp(F, g, out, x, dim=0):
    return (_reverse_cumsum(g, dim),)


def _cumprod_vjp(F, g, out, x, dim=0):
    """d out_i / d x_j = prod_{k <= i, k != j} x_k for j <= i. Before the first zero of a
    row that is out_i / x_j; at the first zero it is the running product with that zero
    replaced by one; after it, every product holds the zero (PyTorch's rule, no division
    by zero)."""
    from flame.scan import cumprod, cumsum

    is_zero = x == 0
    zeros_so_far = cumsum(is_zero.to(dtypes.int32), dim)
    before = zeros_so_far == 0
    first_zero = is_zero & (zeros_so_far == 1)
    safe_x = F.where(is_zero, 1.0, x)
    grad_before = _reverse_cumsum(g * out, dim) / safe_x
    # at the first zero: sum_{i >= j} g_i times the running product with that zero as one
    without_zero = cumprod(F.where(first_zero, 1.0, x), dim)
    grad_at_zero = _reverse_cumsum(g * without_zero, dim)
    return (F.where(before, grad_before, F.where(first_zero, grad_at_zero, 0.0)),)


def _logcumsumexp_vjp(F, g, out, x, dim=0):
    """grad_j = sum_{i >= j} g_i exp(x_j - out_i), split by the sign of g so each half is a
    reversed logcumsumexp of finite-or-minus-infinity logs (PyTorch's stable form)."""
    from flame.scan import logcumsumexp
    from flame.views import flip

    def reversed_lcse(values):
        return flip(logcumsumexp(flip(values, dim), dim), dim)

    positive = reversed_lcse(F.log(F.where(g > 0, g, 0.0)) - out)
    negative = reversed_lcse(F.log(F.where(g < 0, -g, 0.0)) - out)
    return (F.exp(x + positive) - F.exp(x + negative),)


def_vjp("cumsum", _cumsum_vjp)
def_vjp("cumprod", _cumprod_vjp)
def_vjp("logcumsumexp", _logcumsumexp_vjp)
