"""NumPy semantics of single nodes, straight from the op declarations.

The reference interpreter (``flame.runtime.reference``) and constant folding both call this,
so an op's meaning is written once, in its declaration.
"""

from __future__ import annotations

import numpy as np

from flame.ir.node import Node
from flame.ir.ops import get_op


def compute_dtype(dtype, precision=None):
    """NumPy dtype an op's reference runs in: float16/bfloat16 run in float32 (as the
    kernels do); ``precision`` (e.g. float64) lifts every float to that precision."""
    if dtype.is_float:
        return np.dtype(precision) if precision is not None else np.dtype(dtype.numpy_compute)
    return dtype.numpy


def evaluate_elementwise(node: Node, arrays, precision=None) -> np.ndarray:
    """Apply ``node``'s op to ``arrays`` (its inputs' values) and return the result in the
    node's dtype (or in ``precision`` for floats when given)."""
    op = get_op(node.op)
    lifted = [
        np.asarray(array).astype(compute_dtype(child.dtype, precision), copy=False)
        for array, child in zip(arrays, node.inputs)
    ]
    with np.errstate(all="ignore"):
        result = np.asarray(op.ref(*lifted, **dict(node.attrs)) if node.attrs else op.ref(*lifted))
        if node.op == "cast" and node.dtype.is_float and precision is not None:
            # a cast to a narrow float must round even when the oracle runs in float64
            result = result.astype(node.dtype.numpy)
        if precision is not None and node.dtype.is_float:
            return result.astype(precision)
        return result.astype(node.dtype.numpy)


def evaluate_leaf(node: Node, precision=None) -> np.ndarray:
    """The value of a generated leaf (constant, random numbers, iota)."""
    attrs = dict(node.attrs)
    if node.op == "const":
        # A scalar operand keeps its Python value and is used in compute precision, as in
        # PyTorch (``half_tensor * 2.7`` multiplies by 2.7f, then rounds the product).
        return np.asarray(attrs["value"], dtype=compute_dtype(node.dtype, precision))
    else:
        attrs.pop("dtype", None)
        array = np.asarray(get_op(node.op).ref(node.shape, **attrs))
    target = precision if (precision is not None and node.dtype.is_float) else node.dtype.numpy
    return array.astype(node.dtype.numpy).astype(target)


def evaluate_other(node: Node, arrays, precision=None) -> np.ndarray:
    """Movement, reduce and library ops: the declaration's reference on the input arrays
    (lifted to compute precision; results in the node's dtype, or ``precision`` for floats)."""
    op = get_op(node.op)
    lifted = arrays
    if op.kind != "movement":
        lifted = [
            np.asarray(array).astype(compute_dtype(child.dtype, precision), copy=False)
            for array, child in zip(arrays, node.inputs)
        ]
    with np.errstate(all="ignore"):
        result = np.asarray(op.ref(*lifted, **dict(node.attrs)))
    if precision is not None and node.dtype.is_float:
        return result.astype(precision, copy=False)
    return result.astype(node.dtype.numpy, copy=False)
