"""Shapes and broadcasting (NumPy rules: align on the right, size 1 stretches)."""

from __future__ import annotations

from collections.abc import Iterable


class ShapeError(ValueError, RuntimeError):
    """A shape rule was broken; the message names the op, the shapes and the axis. A
    ``RuntimeError`` as PyTorch's shape errors are (and a ``ValueError``, as it always was)."""


def normalize_shape(sizes, op: str = "shape") -> tuple[int, ...]:
    """Accept ``f(2, 3)``, ``f((2, 3))`` or ``f([2, 3])`` and return a tuple of ints."""
    if len(sizes) == 1:
        first = sizes[0]
        if type(first) is tuple or type(first) is list:  # the usual case, without the ABC
            sizes = tuple(first)
        elif isinstance(first, Iterable) and not isinstance(first, str):
            sizes = tuple(first)
    for size in sizes:  # the usual case: plain non-negative ints, returned as they are
        if type(size) is not int or size < 0:
            break
    else:
        return tuple(sizes)
    result = []
    for size in sizes:
        if isinstance(size, bool) or not hasattr(size, "__index__"):
            raise TypeError(f"{op}: sizes must be integers, got {sizes!r}")
        size = size.__index__()
        if size < 0:
            raise ShapeError(f"{op}: sizes must be >= 0, got {tuple(sizes)}")
        result.append(size)
    return tuple(result)


def broadcast_shapes(op: str, *shapes: tuple[int, ...]) -> tuple[int, ...]:
    """The broadcast result of ``shapes``; a mismatch names the op, the shapes and the axis."""
    first = shapes[0]
    if all(shape == first for shape in shapes):
        return first
    longest = max(shapes, key=len)
    if all(shape == longest or not shape for shape in shapes):  # 0-d operands: the usual case
        return longest
    rank = max(len(shape) for shape in shapes)
    result = []
    for axis in range(rank):
        size = 1
        for shape in shapes:
            offset = axis - (rank - len(shape))
            if offset < 0:
                continue
            dim = shape[offset]
            if dim == 1 or dim == size:
                continue
            if size != 1:
                shown = " and ".join(str(list(s)) for s in shapes)
                raise ShapeError(
                    f"{op}: shapes {shown} do not broadcast: at axis {axis - rank} "
                    f"sizes {size} and {dim} differ and neither is 1"
                )
            size = dim
        result.append(size)
    return tuple(result)


def can_expand(source: tuple[int, ...], target: tuple[int, ...]) -> bool:
    if len(source) > len(target):
        return False
    tail = target[len(target) - len(source) :]
    return all(s == t or s == 1 for s, t in zip(source, tail))


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def prod(sizes: Iterable[int]) -> int:
    total = 1
    for size in sizes:
        total *= size
    return total
