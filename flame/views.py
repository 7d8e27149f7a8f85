"""Views: reshape, permute, transpose, expand, squeeze, unsqueeze, flatten, narrow, flip and
basic indexing. Each builds one movement op; none copies. A kernel that reads a view reads
the original memory through strides; a copy is made only where a reshape needs one."""

from __future__ import annotations

import numpy as np

from flame.ir.shapes import ShapeError, normalize_shape, prod
from flame.tensor import Tensor, apply_op


def normalize_axis(axis: int, ndim: int, op: str) -> int:
    if type(axis) is int and 0 <= axis < ndim:  # the usual case
        return axis
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise TypeError(f"{op}: dim must be an int, got {type(axis).__name__}")
    low, high = -max(ndim, 1), max(ndim, 1) - 1
    if not low <= axis <= high:
        raise IndexError(f"{op}: dim {axis} is out of range [{low}, {high}] for a {ndim}-d tensor")
    return axis % max(ndim, 1)


def normalize_axes(dims, ndim: int, op: str) -> tuple[int, ...]:
    if dims is None:
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = (dims,)
    axes = tuple(sorted({normalize_axis(d, ndim, op) for d in dims}))
    if len(axes) != len(tuple(dims)):
        raise ValueError(f"{op}: dim {tuple(dims)} repeats an axis")
    return axes


def reshape(x: Tensor, *sizes, shape=None) -> Tensor:
    """``x.reshape(2, 3)``, ``x.reshape((2, 3))`` or, as PyTorch, ``x.reshape(shape=(2, 3))``."""
    if shape is not None:
        if sizes:
            raise TypeError("reshape: give the sizes or shape=, not both")
        sizes = (tuple(shape),)
    sizes = list(sizes[0]) if len(sizes) == 1 and not isinstance(sizes[0], int) else list(sizes)
    if sizes.count(-1) > 1:
        raise ShapeError(f"reshape: only one size may be -1, got {sizes}")
    if -1 in sizes:
        known = prod(size for size in sizes if size != -1)
        if known == 0 or x.numel() % known:
            raise ShapeError(f"reshape: cannot reshape {list(x.shape)} to {sizes}")
        sizes[sizes.index(-1)] = x.numel() // known
    target = normalize_shape(tuple(sizes), "reshape")
    if target == x.shape:
        return x
    return apply_op("reshape", x, shape=target)


def permute(x: Tensor, *dims) -> Tensor:
    dims = tuple(dims[0]) if len(dims) == 1 and not isinstance(dims[0], int) else dims
    if len(dims) != x.ndim:
        raise ShapeError(f"permute: got {len(dims)} dims for a {x.ndim}-d tensor")
    dims = tuple(normalize_axis(d, x.ndim, "permute") for d in dims)
    return apply_op("permute", x, dims=dims)


def transpose(x: Tensor, dim0: int, dim1: int) -> Tensor:
    dims = list(range(x.ndim))
    first, second = (
        normalize_axis(dim0, x.ndim, "transpose"),
        normalize_axis(dim1, x.ndim, "transpose"),
    )
    if x.ndim == 0:  # dims 0 and -1 name the one "dim" of a 0-d tensor, as in PyTorch
        return x
    dims[first], dims[second] = dims[second], dims[first]
    return apply_op("permute", x, dims=tuple(dims))


def expand(x: Tensor, *sizes) -> Tensor:
    sizes = tuple(sizes[0]) if len(sizes) == 1 and not isinstance(sizes[0], int) else sizes
    lead = len(sizes) - x.ndim
    if lead < 0:
        raise ShapeError(f"expand: {list(sizes)} has fewer dims than {list(x.shape)}")
    target = tuple(
        (x.shape[axis - lead] if size == -1 else size) for axis, size in enumerate(sizes)
    )
    if target == x.shape:
        return x
    return apply_op("expand", x, shape=target)


def broadcast_to(x: Tensor, shape) -> Tensor:
    return expand(x, tuple(shape))


def squeeze(x: Tensor, dim=None) -> Tensor:
    axes = normalize_axes(dim, x.ndim, "squeeze") if dim is not None else None
    shape = tuple(
        size for axis, size in enumerate(x.shape)
        if not (size == 1 and (axes is None or axis in axes))
    )  # fmt: skip
    return reshape(x, shape)


def unsqueeze(x: Tensor, dim: int) -> Tensor:
    axis = normalize_axis(dim, x.ndim + 1, "unsqueeze")
    return reshape(x, x.shape[:axis] + (1,) + x.shape[axis:])


def flatten(x: Tensor, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    if x.ndim == 0:
        return reshape(x, (1,))
    start = normalize_axis(start_dim, x.ndim, "flatten")
    end = normalize_axis(end_dim, x.ndim, "flatten")
    if start > end:
        raise ValueError(f"flatten: start_dim {start_dim} comes after end_dim {end_dim}")
    merged = prod(x.shape[start : end + 1])
    return reshape(x, x.shape[:start] + (merged,) + x.shape[end + 1 :])


def _slice(x: Tensor, ranges) -> Tensor:
    starts, stops, steps = zip(*ranges) if ranges else ((), (), ())
    if all(r == (0, size, 1) for r, size in zip(ranges, x.shape)):
        return x
    return apply_op("slice", x, starts=tuple(starts), stops=tuple(stops), steps=tuple(steps))


def narrow(x: Tensor, dim: int, start: int, length: int) -> Tensor:
    axis = normalize_axis(dim, x.ndim, "narrow")
    size = x.shape[axis]
    if start < 0:
        start += size
    if not (0 <= start <= size and 0 <= length <= size - start):
        raise IndexError(
            f"narrow: start {start} and length {length} exceed size {size} of dim {dim}"
        )
    ranges = [(0, s, 1) for s in x.shape]
    ranges[axis] = (start, start + length, 1)
    return _slice(x, ranges)


def flip(x: Tensor, dims) -> Tensor:
    axes = normalize_axes(dims, x.ndim, "flip")
    ranges = [((s - 1, -1, -1) if axis in axes else (0, s, 1)) for axis, s in enumerate(x.shape)]
    return _slice(x, ranges)


def _is_array_index(item) -> bool:
    return isinstance(item, (Tensor, list)) or hasattr(item, "__array_interface__")


def getitem(x: Tensor, index) -> Tensor:
    """Basic indexing: ints, slices with steps and negative bounds, None, Ellipsis (a view,
    no copy). With integer or bool tensors (or lists, arrays) among the items, NumPy's
    advanced indexing (flame/indexing.py ``advanced_index``: a gather)."""
    items = index if isinstance(index, tuple) else (index,)
    if any(_is_array_index(item) for item in items):
        from flame.indexing import advanced_index

        return advanced_index(x, items)
    used = sum(1 for item in items if item is not None and item is not Ellipsis)
    return _apply_index(x, expand_ellipsis(items, x.ndim, used))


def expand_ellipsis(items, ndim: int, used: int) -> list:
    """``items`` with ``...`` (at most one) standing for the dims no item indexes, and full
    slices for the trailing dims; ``used``: how many dims the items index."""
    if sum(item is Ellipsis for item in items) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if used > ndim:
        raise IndexError(f"too many indices for a {ndim}-d tensor: {used}")
    expanded = []
    for item in items:
        if item is Ellipsis:
            expanded.extend([slice(None)] * (ndim - used))
        else:
            expanded.append(item)
    if not any(item is Ellipsis for item in items):
        expanded.extend([slice(None)] * (ndim - used))
    return expanded


def _apply_index(x: Tensor, items) -> Tensor:
    ranges, shape_after, axis = [], [], 0
    for item in items:
        if item is None:
            shape_after.append(1)
            continue
        size = x.shape[axis]
        if isinstance(item, slice):
            start, stop, step = item.indices(size)
            ranges.append((start, stop, step))
            shape_after.append(len(range(start, stop, step)))
        elif hasattr(item, "__index__") and not isinstance(item, (bool, np.bool_)):
            item = item.__index__()
            position = item + size if item < 0 else item
            if not 0 <= position < size:
                raise IndexError(f"index {item} is out of bounds for dim {axis} with size {size}")
            ranges.append((position, position + 1, 1))
        else:
            raise TypeError(f"unsupported index {item!r} (ints, slices, None, ... and int tensors)")
        axis += 1
    return reshape(_slice(x, ranges), tuple(shape_after))


def view(x: Tensor, *shape) -> Tensor:
    """``x.view(shape)`` (a reshape that must not copy: FLAME's reshape never copies a view
    it can express) or ``x.view(dtype)``, the bits read as another dtype
    (flame/dtype_views.py)."""
    from flame import dtype_views

    if len(shape) == 1 and dtype_views.is_dtype(shape[0]):
        return dtype_views.view_dtype(x, shape[0])
    return reshape(x, *shape)


for _name, _function in (
    ("reshape", reshape), ("view", view), ("permute", permute), ("transpose", transpose),
    ("expand", expand), ("broadcast_to", broadcast_to), ("squeeze", squeeze),
    ("unsqueeze", unsqueeze), ("flatten", flatten), ("narrow", narrow), ("flip", flip),
    ("__getitem__", getitem),
):  # fmt: skip
    setattr(Tensor, _name, _function)
Tensor.T = property(lambda self: permute(self, tuple(reversed(range(self.ndim)))))
Tensor.mT = property(lambda self: transpose(self, -2, -1))


def channels_innermost(x: Tensor) -> bool:
    """Whether ``x`` [N, C, *S] lies in memory with its channels innermost (a channels-last
    convolution's result, a channels_last tensor from PyTorch): known from its lazy views
    without running anything. Code that walks channels in groups picks its order by it."""
    from flame.ir.passes.library_views import own_view
    from flame.ir.views import resolve

    if x.ndim < 3 or x.shape[1] == 1 or prod(x.shape[2:]) == 1:
        return False
    resolved = resolve(x.node, own_view, lambda movement: True)
    if resolved is None:
        return False
    strides = resolved[1].strides
    return strides[1] == 1 and all(
        s >= x.shape[1] for s, n in zip(strides[2:], x.shape[2:]) if n > 1
    )
