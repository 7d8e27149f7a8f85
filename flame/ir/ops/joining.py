"""Ops that build a new layout from several tensors or around one: ``cat`` and constant
``pad``. They are copies by nature, run as library calls (CuPy) and are fusion boundaries;
``stack``, ``triu``, ``tril`` and ``repeat`` are compositions (flame/joining.py)."""

from __future__ import annotations

import numpy as np

from flame.ir.ops.registry import def_op, def_vjp
from flame.ir.shapes import ShapeError


def _cat_rule(inputs, attrs):
    dim = attrs["dim"]
    first = inputs[0]
    for other in inputs[1:]:
        if other.dtype is not first.dtype:
            raise TypeError(f"cat: dtypes differ: {first.dtype.name} and {other.dtype.name}")
        if len(other.shape) != len(first.shape) or any(
            a != b for axis, (a, b) in enumerate(zip(first.shape, other.shape)) if axis != dim
        ):
            shown = ", ".join(str(list(node.shape)) for node in inputs)
            raise ShapeError(f"cat: shapes {shown} differ outside dim {dim}")
    shape = list(first.shape)
    shape[dim] = sum(node.shape[dim] for node in inputs)
    return first.dtype, tuple(shape)


def _pad_rule(inputs, attrs):
    widths = attrs["widths"]
    source = inputs[0].shape
    if len(widths) != len(source) or any(low < 0 or high < 0 for low, high in widths):
        raise ShapeError(f"pad: widths {list(widths)} do not fit shape {list(source)}")
    return inputs[0].dtype, tuple(size + low + high for size, (low, high) in zip(source, widths))


def_op(
    "cat", "library", -1, ref=lambda *arrays, dim=0: np.concatenate(arrays, axis=dim),
    shape_rule=_cat_rule, attrs={"dim": 0}, doc="join along dim (any number of inputs)",
)  # fmt: skip
def_op(
    "pad", "library", 1,
    ref=lambda x, widths=(), value=0: np.pad(x, widths, constant_values=value),
    shape_rule=_pad_rule, attrs={"widths": (), "value": 0},
    doc="constant padding: widths[d] = (before, after) for every axis d",
)  # fmt: skip


# --- backward rules ---------------------------------------------------------------------------
def _cat_vjp(F, g, out, *inputs, dim=0):
    pieces, start = [], 0
    for node in inputs:
        pieces.append(F.narrow(g, dim, start, node.shape[dim]))
        start += node.shape[dim]
    return tuple(pieces)


def _pad_vjp(F, g, out, x, widths=(), value=0):
    for axis, (low, _high) in enumerate(widths):
        g = F.narrow(g, axis, low, x.shape[axis])
    return (g,)


def_vjp("cat", _cat_vjp)
def_vjp("pad", _pad_vjp)
