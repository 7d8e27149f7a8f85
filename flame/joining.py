"""Joining and layout-building ops: ``cat``, ``stack``, ``pad`` (four modes), ``triu``, ``tril``,
``repeat``. ``cat`` and ``pad`` copy (library calls); ``triu``/``tril`` are elementwise
selections that fuse with their neighbours; ``repeat`` is a broadcast plus a reshape (one copy
kernel); ``stack`` is ``cat`` of unsqueezed tensors."""

from __future__ import annotations

from flame.creation import arange
from flame.functional import where
from flame.ir import dtypes
from flame.ir.shapes import ShapeError
from flame.tensor import Tensor, apply_op
from flame.views import expand, flip, narrow, normalize_axis, reshape, unsqueeze


def cat(tensors, dim: int = 0) -> Tensor:
    """PyTorch's ``cat``: the dtype promoted over every piece, and a 1-d empty piece of
    shape [0] joins tensors of any shape (PyTorch's legacy rule). Other pieces empty along
    ``dim`` stay in the graph, checked; the executor leaves them out of the copy
    (flame/runtime/empty_values.py)."""
    tensors = list(tensors)
    if not tensors or not all(isinstance(t, Tensor) for t in tensors):
        raise TypeError("cat: expected a non-empty sequence of flame.Tensor")
    common = tensors[0].dtype
    for tensor in tensors[1:]:
        common = dtypes.promote(common, tensor.dtype)
    tensors = [tensor for tensor in tensors if tensor.shape != (0,)] or tensors[:1]
    axis = normalize_axis(dim, tensors[0].ndim, "cat")
    tensors = [tensor.to(common) for tensor in tensors]
    if len(tensors) == 1:
        return tensors[0]
    return apply_op("cat", *tensors, dim=axis)


def stack(tensors, dim: int = 0) -> Tensor:
    tensors = list(tensors)
    if not tensors:
        raise TypeError("stack: expected a non-empty sequence of flame.Tensor")
    if any(t.shape != tensors[0].shape for t in tensors):
        shown = ", ".join(str(list(t.shape)) for t in tensors)
        raise ShapeError(f"stack: all tensors must have one shape, got {shown}")
    axis = normalize_axis(dim, tensors[0].ndim + 1, "stack")
    return cat([unsqueeze(t, axis) for t in tensors], axis)


def pad(x: Tensor, pad, mode: str = "constant", value: float = 0.0) -> Tensor:
    """PyTorch's ``F.pad``: ``pad`` lists (before, after) pairs from the LAST axis backwards.
    ``mode``: ``constant`` (with ``value``), ``reflect`` (mirrored, the edge not repeated),
    ``replicate`` (the edge repeated) or ``circular`` (wrapped around)."""
    if mode not in PAD_MODES:
        raise _at_user_line(ValueError(f"pad: mode must be one of {PAD_MODES}, got {mode!r}"))
    if len(pad) % 2 or len(pad) // 2 > x.ndim:
        raise _at_user_line(ShapeError(
            f"pad: {list(pad)} must hold (before, after) pairs for at most {x.ndim} dims"
        ))  # fmt: skip
    widths = [(0, 0)] * x.ndim
    for pair in range(len(pad) // 2):
        widths[x.ndim - 1 - pair] = (int(pad[2 * pair]), int(pad[2 * pair + 1]))
    if any(low < 0 or high < 0 for low, high in widths):
        if mode != "constant":
            raise _at_user_line(
                ValueError(f"pad: negative padding {list(pad)} needs mode='constant', got {mode!r}")
            )
        x, widths = _crop(x, widths, pad)
    if mode == "constant":
        if not any(widths_pair != (0, 0) for widths_pair in widths):
            return x
        return apply_op("pad", x, widths=tuple(widths), value=value)
    padded_dims = len(pad) // 2
    if not 1 <= padded_dims <= 3 or x.ndim not in (padded_dims + 1, padded_dims + 2):
        # PyTorch's rule: batch and channel dims come first, then 1 to 3 padded dims
        raise _at_user_line(ShapeError(
            f"pad: non-constant padding ({mode}) of {padded_dims} dim(s) needs a "
            f"{padded_dims + 1}-d or {padded_dims + 2}-d input, got {x.dtype.name}{list(x.shape)}"
        ))  # fmt: skip
    result = x
    for axis, (low, high) in enumerate(widths):
        if low or high:
            result = _pad_axis(result, axis, low, high, mode)
    return result


def _crop(x: Tensor, widths: list, pad) -> tuple[Tensor, list]:
    """Negative widths cut the tensor (PyTorch's constant pad crops with them): ``x`` cut
    to size, and the widths left to pad (none negative)."""
    from flame.views import narrow

    for axis, (low, high) in enumerate(widths):
        cut_low, cut_high = max(0, -low), max(0, -high)
        if cut_low or cut_high:
            kept = x.shape[axis] - cut_low - cut_high
            if kept < 0:
                raise _at_user_line(ShapeError(
                    f"pad: padding {list(pad)} leaves dim {axis} of input "
                    f"{x.dtype.name}{list(x.shape)} with a negative size {kept}"
                ))  # fmt: skip
            x = narrow(x, axis, cut_low, kept)
    return x, [(max(0, low), max(0, high)) for low, high in widths]


PAD_MODES = ("constant", "reflect", "replicate", "circular")


def _at_user_line(error: Exception) -> Exception:
    from flame.linalg import at_user_line

    return at_user_line(error)


def _pad_axis(x: Tensor, axis: int, low: int, high: int, mode: str) -> Tensor:
    """``x`` padded along one axis by copies of its own entries (a ``cat`` of slices, so the
    gradient of each copy flows back to the entry it came from)."""
    size = x.shape[axis]
    limit = {"reflect": size - 1, "circular": size, "replicate": size and max(low, high)}[mode]
    if max(low, high) > limit or size == 0:
        raise _at_user_line(ShapeError(
            f"pad: {mode} padding ({low}, {high}) of dim {axis} needs a larger dim than "
            f"{size} (input {x.dtype.name}{list(x.shape)})"
        ))  # fmt: skip
    if mode == "reflect":
        before = flip(narrow(x, axis, 1, low), axis)
        after = flip(narrow(x, axis, size - 1 - high, high), axis)
    elif mode == "circular":
        before, after = narrow(x, axis, size - low, low), narrow(x, axis, 0, high)
    else:
        before = _stretched(narrow(x, axis, 0, 1), axis, low)
        after = _stretched(narrow(x, axis, size - 1, 1), axis, high)
    pieces = [piece for piece in (before, x, after) if piece.shape[axis]]
    return cat(pieces, axis)


def _stretched(edge: Tensor, axis: int, count: int) -> Tensor:
    shape = list(edge.shape)
    shape[axis] = count
    return expand(edge, tuple(shape))


def _triangle(x: Tensor, diagonal: int, keep_upper: bool, name: str) -> Tensor:
    if x.ndim < 2:
        raise ShapeError(f"{name}: needs at least 2 dims, got {list(x.shape)}")
    rows, cols = x.shape[-2], x.shape[-1]
    row = reshape(arange(rows), (rows, 1))
    col = reshape(arange(cols), (1, cols))
    keep = (col - row >= diagonal) if keep_upper else (col - row <= diagonal)
    # a bool input stays bool (a 0 would promote it to int64)
    return where(keep, x, False if x.dtype.is_bool else 0)


def triu(x: Tensor, diagonal: int = 0) -> Tensor:
    return _triangle(x, diagonal, True, "triu")


def tril(x: Tensor, diagonal: int = 0) -> Tensor:
    return _triangle(x, diagonal, False, "tril")


def repeat(x: Tensor, *sizes) -> Tensor:
    """PyTorch's ``Tensor.repeat``: tile ``x`` ``sizes[d]`` times along each axis."""
    sizes = tuple(sizes[0]) if len(sizes) == 1 and not isinstance(sizes[0], int) else sizes
    if len(sizes) < x.ndim:
        raise ShapeError(f"repeat: {list(sizes)} has fewer dims than {list(x.shape)}")
    shape = (1,) * (len(sizes) - x.ndim) + x.shape
    interleaved = []
    for size in shape:
        interleaved += [1, size]
    tiled = expand(
        reshape(x, tuple(interleaved)),
        tuple(v for count, size in zip(sizes, shape) for v in (count, size)),
    )
    return reshape(tiled, tuple(count * size for count, size in zip(sizes, shape)))


for _name, _function in (("triu", triu), ("tril", tril), ("repeat", repeat)):
    setattr(Tensor, _name, _function)
