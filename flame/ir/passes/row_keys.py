"""Row keys: the rows a reduce kernel walks, and the views of its values it reads or writes
in place (shared by the fusion pass, row_columns.py and codegen/reduce_strips.py).

A reduction's *row key* is its input shape and reduced axes; one reduce kernel computes the
reductions of one key. Its per-row values (the reduced shape, with the axes kept as 1 or
dropped) are free to read as themselves or broadcast back over their rows; any other view of
them is written to memory first.
"""

from __future__ import annotations

from flame.ir.graph import is_input
from flame.ir.node import Node
from flame.ir.ops import get_op
from flame.ir.shapes import prod
from flame.ir.views import View, expand_view, resolve


def row_shapes(graph) -> frozenset:
    """The shapes the graph's reductions walk (their inputs')."""
    return frozenset(n.inputs[0].shape for n in graph.nodes if get_op(n.op).kind == "reduce")


def row_key(node: Node) -> tuple:
    """(input shape, axes) of a reduction."""
    return node.inputs[0].shape, node.attr("axes")


def kept_shape(key) -> tuple[int, ...]:
    shape, axes = key
    return tuple(1 if axis in axes else size for axis, size in enumerate(shape))


def scalar_shapes(key) -> tuple[tuple[int, ...], ...]:
    """Shapes of per-row values: the reduced shape with its axes kept as 1, or dropped
    (``keepdim=False``); both lay the rows out in the same order."""
    shape, axes = key
    return kept_shape(key), tuple(size for axis, size in enumerate(shape) if axis not in axes)


def row_view_fits(view: View, key) -> bool:
    """``view`` (of a per-row value, as a consumer sees it) is that value broadcast back over
    its rows, or the value itself in row order."""
    if view.shape in scalar_shapes(key):
        return view == View(view.shape, View.contiguous(view.shape).strides, 0) or (
            view.offset == 0 and view.strides == reshape_strides(view.shape)
        )
    if view.shape != key[0]:
        return False
    return view == expand_view(View.contiguous(kept_shape(key)), key[0])


def reshape_strides(shape) -> tuple[int, ...]:
    """Contiguous strides with 0 for size-1 axes (how reshapes spell them)."""
    strides = View.contiguous(shape).strides
    return tuple(0 if size == 1 else stride for size, stride in zip(shape, strides))


def is_row_alias(node: Node, key) -> bool:
    """``node`` is a reshape-like view of a reduction with row key ``key`` that keeps its
    memory order (``x.sum(-1)`` without keepdim): the reduction kernel writes it directly."""
    resolved = resolve(node, lambda base: View.contiguous(base.shape), lambda m: True)
    if resolved is None:
        return False
    base, view = resolved
    per_row = prod(kept_shape(key))
    in_row_order = view.offset == 0 and view.strides in (
        View.contiguous(view.shape).strides,
        reshape_strides(view.shape),
    )
    return (
        not is_input(base) and base.shape in scalar_shapes(key)
        and get_op(base.op).kind in ("reduce", "elementwise")
        and prod(view.shape) == per_row and in_row_order
    )  # fmt: skip


def written_in_row_order(node: Node, key) -> bool:
    """A view that a reduction kernel would write as one of its outputs: the kernel writes
    each output in the order of its rows, so the view must keep its computed base in that
    order (or be a per-row value broadcast over the rows); a reversed, sliced or transposed
    view of a computed value is written by a kernel that reads the value from memory."""
    resolved = resolve(node, lambda base: View.contiguous(base.shape), lambda m: True)
    if resolved is None:
        return False
    base, view = resolved
    if is_input(base) or get_op(base.op).kind == "leaf":
        return True  # a view of an input: the kernel loads through it
    in_order = view.offset == 0 and view.strides in (
        View.contiguous(view.shape).strides,
        reshape_strides(view.shape),
    )
    return (in_order and prod(view.shape) == prod(base.shape)) or row_view_fits(view, key)
