"""Strided views: how movement ops become index maps.

A ``View`` says where element ``(i0, i1, ...)`` of a value lives in a flat buffer:
``offset + sum(i_d * strides[d])``. Expand, permute and slice always compose into a view;
reshape does when the dimensions it merges are laid out contiguously (as in NumPy), and
otherwise ``reshape_view`` returns None and the value has to be copied first.
"""

from __future__ import annotations

from dataclasses import dataclass

from flame.ir.shapes import contiguous_strides, prod


@dataclass(frozen=True)
class View:
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0

    @staticmethod
    def contiguous(shape) -> View:
        return View(tuple(shape), contiguous_strides(tuple(shape)), 0)

    @property
    def is_contiguous(self) -> bool:
        return self.offset == 0 and all(
            stride == expected or size == 1
            for size, stride, expected in zip(
                self.shape, self.strides, contiguous_strides(self.shape)
            )
        )


def expand_view(view: View, shape) -> View:
    shape = tuple(shape)
    lead = len(shape) - len(view.shape)
    strides = [0] * lead
    for size, stride, target in zip(view.shape, view.strides, shape[lead:]):
        strides.append(stride if size == target and size != 1 else 0)
    return View(shape, tuple(strides), view.offset)


def permute_view(view: View, dims) -> View:
    return View(
        tuple(view.shape[d] for d in dims), tuple(view.strides[d] for d in dims), view.offset
    )


def slice_view(view: View, starts, stops, steps) -> View:
    offset = view.offset
    shape, strides = [], []
    for stride, start, stop, step in zip(view.strides, starts, stops, steps):
        count = len(range(start, stop, step))
        if count:
            offset += start * stride
        shape.append(count)
        strides.append(stride * step)
    return View(tuple(shape), tuple(strides), offset)


def reshape_view(view: View, shape) -> View | None:
    """The view of ``view`` reshaped, or None when that needs a copy (NumPy's rule)."""
    shape = tuple(shape)
    if prod(shape) == 0 or view.is_contiguous:
        base = View.contiguous(shape)
        return View(shape, base.strides, view.offset)
    old = [(size, stride) for size, stride in zip(view.shape, view.strides) if size != 1]
    new = [size for size in shape if size != 1]
    # NumPy's no-copy reshape: match runs of old dims with runs of new dims of the same
    # product ([4, 2048] -> [256, 32] merges then splits); each old run must be contiguous
    # (a broadcast run of stride 0 is too), and its new dims get strides inside it.
    new_strides = [0] * len(new)
    old_start = new_start = 0
    while old_start < len(old) and new_start < len(new):
        old_end, new_end = old_start + 1, new_start + 1
        old_product, new_product = old[old_start][0], new[new_start]
        while old_product != new_product:
            if new_product < old_product:
                new_product *= new[new_end]
                new_end += 1
            else:
                old_product *= old[old_end][0]
                old_end += 1
        for (_, outer_stride), (inner, inner_stride) in zip(
            old[old_start : old_end - 1], old[old_start + 1 : old_end]
        ):
            if outer_stride != inner * inner_stride:
                return None
        stride = old[old_end - 1][1]
        for axis in range(new_end - 1, new_start - 1, -1):
            new_strides[axis] = stride
            stride *= new[axis]
        old_start, new_start = old_end, new_end
    return _with_unit_dims(shape, new_strides, view.offset)


def _with_unit_dims(shape, strides_without_units, offset) -> View:
    strides = iter(strides_without_units)
    return View(shape, tuple(0 if size == 1 else next(strides) for size in shape), offset)


MOVEMENT_OPS = ("expand", "reshape", "permute", "slice")


def apply_movement(node, view: View) -> View | None:
    """``view`` moved by the movement ``node`` (None when a reshape needs a copy)."""
    if node.op == "expand":
        return expand_view(view, node.shape)
    if node.op == "permute":
        return permute_view(view, node.attr("dims"))
    if node.op == "slice":
        return slice_view(view, node.attr("starts"), node.attr("stops"), node.attr("steps"))
    return reshape_view(view, node.shape)


def storage_view(node) -> View:
    """The view of a realized value: its storage's strides, from its first element."""
    storage = node.buffer if node.buffer is not None else node.attr("storage")
    strides = storage.layout()[0]
    return View(tuple(node.shape), tuple(strides), 0)


def resolve(node, base_view, follow):
    """Walk down the movement ops above a value: ``(base, view)`` where ``view`` maps
    ``node``'s indices into ``base`` (whose own layout is ``base_view(base)``), or None when
    a reshape on the way cannot be a view. ``follow(movement_node)`` says whether to look
    through it (kernels look through the movement ops of their own group)."""
    chain = []
    while node.op in MOVEMENT_OPS and follow(node):
        chain.append(node)
        node = node.inputs[0]
    view = base_view(node)
    for movement in reversed(chain):
        view = apply_movement(movement, view)
        if view is None:
            return None
    return node, view
