"""Ops over a list of tensors at once: ``global_norm``.

``global_norm(*tensors, p=)`` is the ``p``-norm of all its inputs taken together (the norm of
their concatenation), a float32 0-d value: ``(sum_i sum |x_i|^p)^(1/p)``, or ``max |x_i|`` for
``p = inf``. Every element is first rounded to float32 (as ``x.float()``), its power taken
and summed in float32, exactly as ``clip_grad_norm_``'s per-tensor code did. Inputs may
have any shapes and any float dtypes, mixed.

It is a library op (a fusion boundary): on the GPU one multi-tensor kernel writes a partial
result per chunk of 16K elements of every input and a second, one-block kernel combines
them in a fixed order and takes the root (flame/runtime/library_norm.py): two launches for
any number of tensors, where one reduction per tensor cost two or three launches each. Not
differentiable: ``flame.nn.utils.global_norm`` builds per-tensor reductions instead when a
gradient is asked for.
"""

from __future__ import annotations

import math

import numpy as np

from flame.ir import dtypes
from flame.ir.ops.registry import def_op
from flame.ir.shapes import ShapeError


def _shown(node) -> str:
    return f"{node.dtype.name}{list(node.shape)}"


def _global_norm_rule(inputs, attrs):
    p = attrs.get("p", 2.0)
    if not isinstance(p, float) or not p > 0:  # inf passes, NaN does not
        raise ValueError(f"global_norm: p must be a positive float or inf, got {p!r}")
    if not inputs:
        raise ValueError("global_norm: needs at least one tensor")
    for position, node in enumerate(inputs):
        if not node.dtype.is_float:
            raise TypeError(
                f"global_norm: input {position} is {_shown(node)}; the inputs must be float "
                "tensors (cast first, e.g. x.float())"
            )
        if math.isinf(p) and node.numel == 0:
            raise ShapeError(
                f"global_norm: cannot compute the infinity norm of an empty tensor (input "
                f"{position}, {_shown(node)}): the maximum has no identity"
            )
    return dtypes.float32, ()


def _global_norm_ref(*arrays, p=2.0):
    """In the arrays' precision (float32 for float16/bfloat16/float32 inputs): float32
    overflow of a sum of squares gives inf here as on the GPU."""
    compute = np.result_type(*arrays, np.float32)
    magnitudes = [np.abs(np.asarray(array, dtype=compute)).reshape(-1) for array in arrays]
    if math.isinf(p):
        return np.max([np.max(m) for m in magnitudes]).astype(compute)
    if p == 1.0:
        terms = magnitudes
    elif p == 2.0:
        terms = [m * m for m in magnitudes]
    else:
        terms = [m ** compute.type(p) for m in magnitudes]
    total = compute.type(0)
    for term in terms:
        total = total + np.sum(term, dtype=compute)
    if p == 1.0:
        return np.asarray(total, dtype=compute)
    if p == 2.0:
        return np.sqrt(np.asarray(total, dtype=compute))
    return np.asarray(total, dtype=compute) ** compute.type(1.0 / p)


def_op(
    "global_norm", "library", -1, ref=_global_norm_ref, shape_rule=_global_norm_rule,
    attrs={"p": 2.0}, categories="f", differentiable=False,
    doc="the p-norm of all inputs together (float32 0-d); any shapes and float dtypes",
)  # fmt: skip
