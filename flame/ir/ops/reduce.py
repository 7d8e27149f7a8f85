"""Reductions: combine values along ``axes`` (sorted, non-negative). The result keeps the
reduced axes with size 1 (the tensor layer drops them for ``keepdim=False`` with a reshape),
so a reduction broadcasts back over its input without bookkeeping.

``cuda`` holds, per input category, the accumulator's C combine expression (``{0}`` the
accumulator, ``{1}`` the new value) and its identity. float16/bfloat16 accumulate in
float32; bool and integer sums and products in int64.
"""

from __future__ import annotations

import numpy as np

from flame.ir import dtypes
from flame.ir.ops.registry import def_op, def_vjp
from flame.ir.shapes import ShapeError

_INT64_MIN, _INT64_MAX = "(-9223372036854775807LL - 1)", "9223372036854775807LL"
_INT32_MIN, _INT32_MAX = "(-2147483647 - 1)", "2147483647"


def _reduce_rule(widen: bool):
    def rule(inputs, attrs):
        source = inputs[0].shape
        axes = tuple(attrs["axes"])
        if list(axes) != sorted(set(axes)) or any(not 0 <= axis < len(source) for axis in axes):
            raise ShapeError(f"reduce: axes {list(axes)} invalid for shape {list(source)}")
        dtype = inputs[0].dtype
        if widen and not dtype.is_float:
            dtype = dtypes.int64
        shape = tuple(1 if axis in axes else size for axis, size in enumerate(source))
        return dtype, shape

    return rule


def _reference(function, widen, identity=None):
    """``identity(dtype)``: the value over an empty axis (max and min have none in NumPy;
    only ``any``/``all`` reach them with an empty axis, the front end refuses the rest)."""

    def ref(x, axes=()):
        if widen and x.dtype.kind in "biu":
            x = x.astype(np.int64)
        if identity is not None and x.size == 0:
            return function(x, axis=tuple(axes), keepdims=True, initial=identity(x.dtype))
        return function(x, axis=tuple(axes), keepdims=True)

    return ref


def _lowest(dtype):
    if dtype.kind == "b":
        return False
    return -np.inf if dtype.kind == "f" else np.iinfo(dtype).min


def _highest(dtype):
    if dtype.kind == "b":
        return True
    return np.inf if dtype.kind == "f" else np.iinfo(dtype).max


_MAX_IDENTITY = {
    "f": "__int_as_float(0xff800000)",
    "i": _INT64_MIN,
    "i32": _INT32_MIN,
    "b": "false",
}
_MIN_IDENTITY = {"f": "__int_as_float(0x7f800000)", "i": _INT64_MAX, "i32": _INT32_MAX, "b": "true"}

def_op(
    "reduce_sum", "reduce", 1, ref=_reference(np.sum, True), shape_rule=_reduce_rule(True),
    attrs={"axes": ()},
    cuda={"combine": "({0} + {1})",
          "identity": {"f": "0.0f", "i": "0LL", "i32": "0LL", "b": "0LL"}},
)  # fmt: skip
def_op(
    "reduce_prod", "reduce", 1, ref=_reference(np.prod, True), shape_rule=_reduce_rule(True),
    attrs={"axes": ()},
    cuda={"combine": "({0} * {1})",
          "identity": {"f": "1.0f", "i": "1LL", "i32": "1LL", "b": "1LL"}},
)  # fmt: skip
def_op(
    "reduce_max", "reduce", 1, ref=_reference(np.max, False, _lowest),
    shape_rule=_reduce_rule(False),
    attrs={"axes": ()}, helpers=("flame_minmax",),
    cuda={"combine": "flame_max({0}, {1})", "identity": _MAX_IDENTITY},
)  # fmt: skip
def_op(
    "reduce_min", "reduce", 1, ref=_reference(np.min, False, _highest),
    shape_rule=_reduce_rule(False),
    attrs={"axes": ()}, helpers=("flame_minmax",),
    cuda={"combine": "flame_min({0}, {1})", "identity": _MIN_IDENTITY},
)  # fmt: skip


# --- backward rules ---------------------------------------------------------------------------
def _extreme_vjp(F, g, out, x, axes=()):
    """Ties share the cotangent equally, as in PyTorch's amax/amin."""
    hit = x == F.expand(out, x.shape)
    count = F.reduce_sum(hit.float(), axes)
    return (F.where(hit, F.expand(g / count, x.shape), 0.0),)


def_vjp("reduce_sum", lambda F, g, out, x, axes=(): (F.expand(g, x.shape).to(x.dtype),))
def_vjp("reduce_max", _extreme_vjp)
def_vjp("reduce_min", _extreme_vjp)


def _prod_vjp(F, g, out, x, axes=()):
    """PyTorch's rule: out / x where no element of the slice is 0; where one is, the
    product of the others at the zero and 0 elsewhere; where several are, 0."""
    zero = x == 0
    zeros = F.expand(F.reduce_sum(zero.float(), axes), x.shape)
    others = F.expand(F.where(zero, 1.0, x).prod(axes, keepdim=True), x.shape)
    at_zero = F.where(zero & (zeros == 1.0), others, 0.0)
    return (F.expand(g, x.shape) * F.where(zeros == 0.0, F.expand(out, x.shape) / x, at_zero),)


def_vjp("reduce_prod", _prod_vjp)
