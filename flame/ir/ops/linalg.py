"""Linear algebra: ``matmul`` (which ``bmm`` and the ``@`` operator build too).

``matmul`` follows NumPy: 1-D operands are a row (left) or a column (right) vector whose
added axis is dropped from the result; leading (batch) axes broadcast. Both operands share
one float dtype (the tensor layer promotes them first). The ``precision`` attribute says
how float32 products may be computed on the GPU: ``"highest"`` (IEEE float32 FMAs) or
``"tf32"`` (tensor cores, 10-bit mantissa inputs, float32 accumulation). It is chosen when
the node is built (``flame.set_matmul_precision``), so a graph means the same thing
whenever it runs. float16 and bfloat16 always accumulate in float32.
"""

from __future__ import annotations

import math

import numpy as np

from flame.ir.ops.registry import def_op, def_vjp
from flame.ir.shapes import ShapeError, broadcast_shapes

PRECISIONS = ("highest", "tf32")


def _shown(node) -> str:
    return f"{node.dtype.name}{list(node.shape)}"


def _check_types(left, right, attrs) -> None:
    if not (left.dtype.is_float and right.dtype.is_float):
        raise TypeError(
            f"matmul: needs float operands (float32, float64, float16, bfloat16), got "
            f"{left.dtype.name} and {right.dtype.name}; cast them first, e.g. x.float()"
        )
    if left.dtype is not right.dtype:
        raise TypeError(
            f"matmul: operands must share one dtype, got {_shown(left)} and {_shown(right)}"
        )
    precision = attrs.get("precision", "highest")
    if precision not in PRECISIONS:
        raise ValueError(f"matmul: precision must be one of {PRECISIONS}, got {precision!r}")


def matmul_shape(left_shape, right_shape) -> tuple[int, ...]:
    """The result shape of ``left @ right`` (NumPy rules); ShapeError names both shapes."""
    shown = f"{list(left_shape)} and {list(right_shape)}"
    if not left_shape or not right_shape:
        raise ShapeError(f"matmul: operands must have at least one axis, got shapes {shown}")
    inner_left = left_shape[-1]
    inner_right = right_shape[-2] if len(right_shape) > 1 else right_shape[0]
    if inner_left != inner_right:
        raise ShapeError(
            f"matmul: inner dimensions differ: shapes {shown} "
            f"({inner_left} columns on the left, {inner_right} rows on the right)"
        )
    try:
        batch = broadcast_shapes("matmul", left_shape[:-2], right_shape[:-2])
    except ShapeError:
        raise ShapeError(f"matmul: batch axes of shapes {shown} do not broadcast") from None
    rows = left_shape[-2:-1] if len(left_shape) > 1 else ()
    columns = right_shape[-1:] if len(right_shape) > 1 else ()
    return tuple(batch) + tuple(rows) + tuple(columns)


def _matmul_rule(inputs, attrs):
    left, right = inputs
    _check_types(left, right, attrs)
    return left.dtype, matmul_shape(left.shape, right.shape)


def _matmul_ref(left, right, precision="highest"):
    # the oracle is exact up to its compute precision: tf32 is a GPU speed/accuracy trade
    return np.matmul(left, right)


def_op(
    "matmul", "library", 2, ref=_matmul_ref, shape_rule=_matmul_rule,
    attrs={"precision": "highest"}, categories="f",
    doc="NumPy matmul (batch broadcasting, 1-D vectors); cuBLAS on the GPU",
)  # fmt: skip


# --- backward rules ---------------------------------------------------------------------------
def _matmul_vjp(F, g, out, left, right, precision="highest"):
    """NumPy matmul's cotangents: vectors are lifted to matrices first, batch broadcasting
    is summed away by ``sum_to``."""
    left_matrix = F.reshape(left, (1,) + left.shape) if left.ndim == 1 else left
    right_matrix = F.reshape(right, right.shape + (1,)) if right.ndim == 1 else right
    # the cotangent as the product of the lifted matrices would have it (a 0-d cotangent of a
    # dot product becomes [1, 1])
    g_matrix = F.reshape(g, matmul_shape(left_matrix.shape, right_matrix.shape))
    left_grad = F.matmul(g_matrix, F.transpose(right_matrix, -1, -2))
    if right_matrix.ndim == 2 and left_matrix.ndim > 2:
        # a weight shared by every batch item (``x @ w`` over [N, T, K] tokens, F.linear):
        # one matmul over the batch folded into its rows, not a product per item summed
        # afterwards ([N, K, N_out] written, then reduced)
        rows = math.prod(left_matrix.shape[:-1])
        folded_left = F.reshape(left_matrix, (rows, left_matrix.shape[-1]))
        folded_g = F.reshape(g_matrix, (rows, g_matrix.shape[-1]))
        right_grad = F.matmul(F.transpose(folded_left, -1, -2), folded_g)
    else:
        right_grad = F.matmul(F.transpose(left_matrix, -1, -2), g_matrix)
    return (
        F.reshape(F.sum_to(left_grad, left_matrix.shape), left.shape),
        F.reshape(F.sum_to(right_grad, right_matrix.shape), right.shape),
    )


def_vjp("matmul", _matmul_vjp)
