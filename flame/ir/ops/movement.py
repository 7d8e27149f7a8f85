"""Movement ops: index maps, no arithmetic. In kernels they become strided views of what
they read (``flame/ir/views.py``); the simplifier pushes them through elementwise ops so
that they sit on leaves."""

from __future__ import annotations

import numpy as np

from flame.ir.ops.registry import def_op, def_vjp
from flame.ir.shapes import ShapeError, can_expand, prod


def _expand_rule(inputs, attrs):
    source, target = inputs[0].shape, tuple(attrs["shape"])
    if not can_expand(source, target):
        raise ShapeError(f"expand: cannot broadcast shape {list(source)} to {list(target)}")
    return inputs[0].dtype, target


def _reshape_rule(inputs, attrs):
    source, target = inputs[0].shape, tuple(attrs["shape"])
    if prod(source) != prod(target):
        raise ShapeError(
            f"reshape: cannot reshape {list(source)} ({prod(source)} elements) to "
            f"{list(target)} ({prod(target)} elements)"
        )
    return inputs[0].dtype, target


def _permute_rule(inputs, attrs):
    source, dims = inputs[0].shape, tuple(attrs["dims"])
    if sorted(dims) != list(range(len(source))):
        raise ShapeError(f"permute: {list(dims)} is not a permutation of the {len(source)} axes")
    return inputs[0].dtype, tuple(source[d] for d in dims)


def _slice_rule(inputs, attrs):
    source = inputs[0].shape
    starts, stops, steps = attrs["starts"], attrs["stops"], attrs["steps"]
    if not len(starts) == len(stops) == len(steps) == len(source):
        raise ShapeError(f"slice: needs one start/stop/step per axis of {list(source)}")
    if any(step == 0 for step in steps):
        raise ValueError("slice: step must be nonzero")
    shape = tuple(len(range(a, b, c)) for a, b, c in zip(starts, stops, steps))
    return inputs[0].dtype, shape


def _slice_ref(x, starts=(), stops=(), steps=()):
    index = tuple(
        slice(start, stop if stop >= 0 else None, step)
        for start, stop, step in zip(starts, stops, steps)
    )
    return x[index]


def_op(
    "expand", "movement", 1, ref=lambda x, shape=(): np.broadcast_to(x, shape),
    attrs={"shape": ()}, shape_rule=_expand_rule,
    doc="NumPy broadcasting to attrs.shape: a stride-0 index map",
)  # fmt: skip
def_op(
    "reshape", "movement", 1, ref=lambda x, shape=(): np.reshape(x, shape),
    attrs={"shape": ()}, shape_rule=_reshape_rule,
    doc="same elements in row-major order, new shape (a view when strides allow)",
)  # fmt: skip
def_op(
    "permute", "movement", 1, ref=lambda x, dims=(): np.transpose(x, dims),
    attrs={"dims": ()}, shape_rule=_permute_rule, doc="reorder axes",
)  # fmt: skip
def_op(
    "slice", "movement", 1, ref=_slice_ref,
    attrs={"starts": (), "stops": (), "steps": ()}, shape_rule=_slice_rule,
    doc="per axis range(start, stop, step), normalized (a stop of -1 means before index 0)",
)  # fmt: skip


# --- backward rules ---------------------------------------------------------------------------
# Broadcasting is undone here, once: every implicit broadcast of the tensor layer is an
# explicit expand, whose cotangent is summed back over the broadcast axes.
def _expand_vjp(F, g, out, x, shape=()):
    return (F.sum_to(g, x.shape),)


def _permute_vjp(F, g, out, x, dims=()):
    inverse = [0] * len(dims)
    for position, axis in enumerate(dims):
        inverse[axis] = position
    return (F.permute(g, tuple(inverse)),)


def _slice_vjp(F, g, out, x, starts=(), stops=(), steps=()):
    """Scatter the cotangent back into zeros of x's shape, one axis at a time."""
    for axis, (start, _stop, step) in enumerate(zip(starts, stops, steps)):
        g = F.unslice_axis(g, axis, x.shape[axis], start, step)
    return (g,)


def_vjp("expand", _expand_vjp)
def_vjp("reshape", lambda F, g, out, x, shape=(): (F.reshape(g, x.shape),))
def_vjp("permute", _permute_vjp)
def_vjp("slice", _slice_vjp)
