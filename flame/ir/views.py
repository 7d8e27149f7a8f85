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
    new_strides: list[int] = []
    old_index = 0
    for size in new:
        # take old dims until their product reaches `size`: they must be contiguous
        group = []
        product = 1
        while product < size and old_index < len(old):
            group.append(old[old_index])
            product *= old[old_index][0]
            old_index += 1
        if product != size:
            return _split(old, old_index, new, new_strides, shape, view)
        for (_, outer_stride), (inner, inner_stride) in zip(group, group[1:]):
            if outer_stride != inner * inner_stride:
                return None
        new_strides.append(group[-1][1])
    return _with_unit_dims(shape, new_strides, view.offset)


def _split(old, old_index, new, new_strides, shape, view):
    """Splitting one old dim into several new ones (e.g. [12] -> [3, 4]): done as a general
    pass below, kept apart so the common merge path above stays readable."""
    strides: list[int] = []
    new_index = 0
    for size, stride in old:
        # new dims whose product is this old dim get contiguous strides inside it
        members = []
        product = 1
        while product < size and new_index < len(new):
            members.append(new[new_index])
            product *= new[new_index]
            new_index += 1
        if product != size:
            return None
        inner = stride
        member_strides = []
        for member in reversed(members):
            member_strides.append(inner)
            inner *= member
        strides.extend(reversed(member_strides))
    if new_index != len(new):
        return None
    return _with_unit_dims(shape, strides, view.offset)


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
