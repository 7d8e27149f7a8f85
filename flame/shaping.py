"""Shape helpers with PyTorch's names and arguments: ``chunk split unbind clone contiguous
type_as new_zeros new_ones new_full new_empty dim repeat_interleave roll meshgrid outer diag
diagonal unfold unflatten movedim``, and ``x.softmax(dim)`` / ``x.log_softmax(dim)``.

Every one is a composition of views (slices, reshapes, permutes, broadcasts), ``cat`` and
``index_select``, so each is differentiable through those ops' rules and none adds an op to
the registry. Bad arguments raise when the op is built, naming the op, the shapes and the dim,
at the user's line.
"""

from __future__ import annotations

import functools

from flame.backend import backend as use_backend
from flame.ir import dtypes
from flame.ir.shapes import ShapeError, prod
from flame.linalg import at_user_line
from flame.tensor import Tensor, apply
from flame.views import _slice, narrow, normalize_axis, permute, reshape, squeeze

USER_ERRORS = (ShapeError, TypeError, ValueError, IndexError)


def user_errors(function):
    """Errors of the decorated front-end function name the user's line, as ``apply`` does."""

    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except USER_ERRORS as error:
            if "[at " in str(error):
                raise
            raise at_user_line(error) from None

    return wrapped


def checked_tensor(op: str, value) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{op}: expected a flame.Tensor, got {type(value).__name__}")
    return value


def shown(x: Tensor) -> str:
    return f"{x.dtype.name}{list(x.shape)}"


# --- splitting ------------------------------------------------------------------------------


@user_errors
def split(tensor: Tensor, split_size_or_sections, dim: int = 0) -> tuple[Tensor, ...]:
    """Pieces of ``split_size_or_sections`` entries along ``dim`` (the last may be smaller),
    or of the listed sizes, which must add up to the dim's size."""
    checked_tensor("split", tensor)
    axis = normalize_axis(dim, tensor.ndim, "split")
    size = tensor.shape[axis]
    if isinstance(split_size_or_sections, int) and not isinstance(split_size_or_sections, bool):
        step = split_size_or_sections
        if step <= 0 and not (step == 0 and size == 0):
            raise ValueError(f"split: split_size must be positive, got {step}")
        sizes = [min(step, size - start) for start in range(0, size, step)] if size else [0]
    else:
        sizes = [int(section) for section in split_size_or_sections]
        if any(section < 0 for section in sizes) or sum(sizes) != size:
            raise ShapeError(
                f"split: sizes {sizes} must be non-negative and add up to {size}, the size of "
                f"dim {dim} of input {shown(tensor)}"
            )
    pieces, start = [], 0
    for length in sizes:
        pieces.append(narrow(tensor, axis, start, length))
        start += length
    return tuple(pieces)


@user_errors
def chunk(input: Tensor, chunks: int, dim: int = 0) -> tuple[Tensor, ...]:  # noqa: A002
    """At most ``chunks`` pieces of ``ceil(size / chunks)`` entries along ``dim``."""
    checked_tensor("chunk", input)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks <= 0:
        raise ValueError(f"chunk: chunks must be a positive int, got {chunks!r}")
    axis = normalize_axis(dim, input.ndim, "chunk")
    size = input.shape[axis]
    if size == 0:
        return tuple(input for _ in range(chunks))
    return split(input, -(-size // chunks), axis)


@user_errors
def unbind(input: Tensor, dim: int = 0) -> tuple[Tensor, ...]:  # noqa: A002
    """The slices of ``input`` along ``dim``, that dim removed."""
    checked_tensor("unbind", input)
    axis = normalize_axis(dim, input.ndim, "unbind")
    if input.ndim == 0:
        raise IndexError(f"unbind: a 0-d tensor has no dim to unbind ({shown(input)})")
    return tuple(squeeze(narrow(input, axis, index, 1), axis) for index in range(input.shape[axis]))


# --- copies, casts and new tensors ----------------------------------------------------------


def clone(input: Tensor, memory_format=None) -> Tensor:  # noqa: A002
    """A tensor of its own: a new node, never the input's node, and once realized memory of
    its own (an in-place write to the clone must not reach the input): the ``copy`` op, which
    no pass folds away (``x * 1`` is simplified to ``x``, whose memory it would then share)."""
    checked_tensor("clone", input)
    return apply("copy", input)


def contiguous(self: Tensor, memory_format=None) -> Tensor:
    # FLAME chooses layouts itself: every tensor reads as a C-contiguous one
    return self


def type_as(self: Tensor, other: Tensor) -> Tensor:
    return self.to(checked_tensor("type_as", other).dtype)


def _new(self: Tensor, size, fill_value, dtype) -> Tensor:
    from flame.creation import full

    sizes = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else tuple(size)
    with use_backend(self.backend):
        return full(sizes, fill_value, dtype=dtype if dtype is not None else self.dtype)


@user_errors
def new_zeros(self: Tensor, *size, dtype=None) -> Tensor:
    return _new(self, size, 0, dtype)


@user_errors
def new_ones(self: Tensor, *size, dtype=None) -> Tensor:
    return _new(self, size, 1, dtype)


@user_errors
def new_empty(self: Tensor, *size, dtype=None) -> Tensor:
    # zeros: an uninitialized buffer would only make results depend on memory reuse
    return _new(self, size, 0, dtype)


@user_errors
def new_full(self: Tensor, size, fill_value, dtype=None) -> Tensor:
    return _new(self, (tuple(size),), fill_value, dtype)


@user_errors
def new_tensor(self: Tensor, data, dtype=None) -> Tensor:
    from flame.creation import tensor

    with use_backend(self.backend):
        return tensor(data, dtype=dtype if dtype is not None else self.dtype)


def _softmax(self: Tensor, dim: int, dtype=None) -> Tensor:
    from flame.nn.functional import softmax

    return softmax(self, dim, dtype=dtype)


def _log_softmax(self: Tensor, dim: int, dtype=None) -> Tensor:
    from flame.nn.functional import log_softmax

    return log_softmax(self, dim, dtype=dtype)


# --- repeating and rolling ------------------------------------------------------------------


def _repeat_counts(repeats: Tensor, size: int, op: str) -> list[int]:
    """The counts of an integer ``repeats`` tensor (read now: the result's size depends on
    them, as PyTorch reads them on the host)."""
    if repeats.dtype.is_float or repeats.dtype.is_bool or repeats.ndim > 1:
        raise TypeError(f"{op}: repeats must be a 0-d or 1-d integer tensor, got {shown(repeats)}")
    counts = [int(count) for count in repeats.numpy().reshape(-1)]
    if len(counts) == 1:
        counts = counts * size
    if len(counts) != size or any(count < 0 for count in counts):
        raise ShapeError(
            f"{op}: repeats {shown(repeats)} must be non-negative, one per entry of the "
            f"repeated dim (size {size})"
        )
    return counts


@user_errors
def repeat_interleave(input: Tensor, repeats=None, dim=None, *, output_size=None) -> Tensor:  # noqa: A002
    """Each entry along ``dim`` (of the flattened input when None) repeated ``repeats``
    times; ``repeat_interleave(counts)`` repeats ``0, 1, ...`` by ``counts``."""
    from flame.creation import arange, tensor
    from flame.indexing import index_select

    checked_tensor("repeat_interleave", input)
    if repeats is None:
        counts = _repeat_counts(input, input.numel(), "repeat_interleave")
        with use_backend(input.backend):
            return repeat_interleave(arange(len(counts)), tensor(counts))
    x = reshape(input, (-1,)) if dim is None else input
    axis = 0 if dim is None else normalize_axis(dim, input.ndim, "repeat_interleave")
    if isinstance(repeats, Tensor) and repeats.numel() == 1:
        repeats = int(repeats.numpy().reshape(-1)[0])
    if isinstance(repeats, int):
        if repeats < 0:
            raise ValueError(f"repeat_interleave: repeats must be non-negative, got {repeats}")
        spread = list(x.shape)
        spread.insert(axis + 1, repeats)
        merged = list(x.shape)
        merged[axis] *= repeats
        widened = reshape(x, x.shape[: axis + 1] + (1,) + x.shape[axis + 1 :])
        return reshape(widened.expand(tuple(spread)), tuple(merged))
    counts = _repeat_counts(checked_tensor("repeat_interleave", repeats), x.shape[axis],
                            "repeat_interleave")  # fmt: skip
    positions = [position for position, count in enumerate(counts) for _ in range(count)]
    with use_backend(x.backend):
        index = tensor(positions, dtype=dtypes.int64)
    return index_select(x, axis, index)


@user_errors
def roll(input: Tensor, shifts, dims=None) -> Tensor:  # noqa: A002
    """Entries shifted by ``shifts`` along ``dims`` (of the flattened input when None),
    wrapping around."""
    from flame.joining import cat

    checked_tensor("roll", input)
    if dims is None:
        if not isinstance(shifts, int):
            (shifts,) = shifts
        return reshape(roll(reshape(input, (-1,)), shifts, 0), input.shape)
    shifts = (shifts,) if isinstance(shifts, int) else tuple(shifts)
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if len(shifts) != len(dims):
        raise ValueError(f"roll: {len(shifts)} shifts for {len(dims)} dims ({shifts}, {dims})")
    result = input
    for shift, dim in zip(shifts, dims):
        axis = normalize_axis(dim, input.ndim, "roll")
        size = result.shape[axis]
        offset = shift % size if size else 0
        if offset:
            tail = narrow(result, axis, size - offset, offset)
            result = cat([tail, narrow(result, axis, 0, size - offset)], axis)
    return result


# --- grids and products ---------------------------------------------------------------------


@user_errors
def meshgrid(*tensors, indexing: str = "ij") -> tuple[Tensor, ...]:
    """Coordinate grids of 1-d tensors: ``indexing="ij"`` (matrix) or ``"xy"`` (Cartesian:
    the first two dims swapped)."""
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        tensors = tuple(tensors[0])
    if indexing not in ("ij", "xy"):
        raise ValueError(f"meshgrid: indexing must be 'ij' or 'xy', got {indexing!r}")
    for tensor in tensors:
        if checked_tensor("meshgrid", tensor).ndim > 1:
            raise ShapeError(f"meshgrid: expects 0-d or 1-d tensors, got {shown(tensor)}")
    sizes = [tensor.numel() for tensor in tensors]
    order = list(range(len(tensors)))
    if indexing == "xy" and len(tensors) > 1:
        order[0], order[1] = 1, 0
    shape = tuple(sizes[position] for position in order)
    grids = []
    for position, tensor in enumerate(tensors):
        placed = [1] * len(tensors)
        placed[order.index(position)] = sizes[position]
        grids.append(reshape(tensor, tuple(placed)).expand(shape))
    return tuple(grids)


@user_errors
def outer(input: Tensor, vec2: Tensor) -> Tensor:  # noqa: A002
    """``input[i] * vec2[j]`` for two 1-d tensors."""
    for value in (input, vec2):
        if checked_tensor("outer", value).ndim != 1:
            raise ShapeError(f"outer: needs two 1-d tensors, got {shown(input)} and {shown(vec2)}")
    return reshape(input, (-1, 1)) * reshape(vec2, (1, -1))


@user_errors
def diagonal(input: Tensor, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Tensor:  # noqa: A002
    """The diagonal of the (``dim1``, ``dim2``) planes, as a new last dim; a view."""
    checked_tensor("diagonal", input)
    first = normalize_axis(dim1, input.ndim, "diagonal")
    second = normalize_axis(dim2, input.ndim, "diagonal")
    if first == second or input.ndim < 2:
        raise ShapeError(
            f"diagonal: dim1 {dim1} and dim2 {dim2} must be two different dims of input "
            f"{shown(input)}"
        )
    rest = [axis for axis in range(input.ndim) if axis not in (first, second)]
    moved = permute(input, tuple(rest) + (first, second))
    rows, columns = input.shape[first], input.shape[second]
    if offset >= 0:
        start, length = offset, max(0, min(rows, columns - offset))
    else:
        start, length = -offset * columns, max(0, min(rows + offset, columns))
    flat = reshape(moved, moved.shape[:-2] + (rows * columns,))
    ranges = [(0, size, 1) for size in flat.shape[:-1]]
    step = columns + 1
    ranges.append((start, start + (length - 1) * step + 1, step) if length else (0, 0, 1))
    return _slice(flat, ranges)


_diagonal_of = diagonal  # diag's argument is called ``diagonal``, as in PyTorch


@user_errors
def diag(input: Tensor, diagonal: int = 0) -> Tensor:  # noqa: A002
    """A 1-d input: the square matrix with it on diagonal ``diagonal``; a 2-d input: that
    diagonal."""
    from flame.creation import arange
    from flame.functional import where
    from flame.joining import pad

    checked_tensor("diag", input)
    if input.ndim == 2:
        return _diagonal_of(input, diagonal)
    if input.ndim != 1:
        raise ShapeError(f"diag: needs a 1-d or 2-d input, got {shown(input)}")
    size = input.shape[0] + abs(diagonal)
    padded = pad(input, (0, abs(diagonal)))  # entry k sits on row k (or column k when below)
    values = reshape(padded, (size, 1) if diagonal >= 0 else (1, size))
    with use_backend(input.backend):
        row, column = reshape(arange(size), (size, 1)), reshape(arange(size), (1, size))
    on_diagonal = column - row == diagonal
    zero = False if input.dtype.is_bool else 0
    return where(on_diagonal, values, zero)


# --- windows and dims -----------------------------------------------------------------------


@user_errors
def unfold(self: Tensor, dimension: int, size: int, step: int) -> Tensor:
    """``Tensor.unfold``: every window of ``size`` entries along ``dimension``, ``step``
    apart; the windows replace the dim and their entries form a new last dim."""
    from flame.creation import arange
    from flame.indexing import index_select

    checked_tensor("unfold", self)
    axis = normalize_axis(dimension, self.ndim, "unfold")
    length = self.shape[axis] if self.ndim else 1
    if step <= 0 or size < 0 or size > length:
        raise ShapeError(
            f"unfold: size {size} must be in [0, {length}] and step {step} positive for dim "
            f"{dimension} of input {shown(self)}"
        )
    if self.ndim == 0:
        return reshape(self, (1,))
    windows = (length - size) // step + 1
    with use_backend(self.backend):
        index = reshape(arange(windows), (windows, 1)) * step + reshape(arange(size), (1, size))
    picked = index_select(self, axis, reshape(index, (-1,)))
    split_shape = self.shape[:axis] + (windows, size) + self.shape[axis + 1 :]
    grouped = reshape(picked, split_shape)
    order = [d for d in range(len(split_shape)) if d != axis + 1] + [axis + 1]
    return permute(grouped, tuple(order))


@user_errors
def unflatten(input: Tensor, dim: int, sizes) -> Tensor:  # noqa: A002
    """Dim ``dim`` split into ``sizes`` (one of them may be -1)."""
    checked_tensor("unflatten", input)
    axis = normalize_axis(dim, input.ndim, "unflatten")
    sizes = list(sizes)
    known = prod(size for size in sizes if size != -1)
    if sizes.count(-1) > 1 or (
        -1 not in sizes and known != input.shape[axis]
    ) or (-1 in sizes and (known == 0 or input.shape[axis] % known)):  # fmt: skip
        raise ShapeError(
            f"unflatten: sizes {sizes} do not multiply to {input.shape[axis]}, the size of dim "
            f"{dim} of input {shown(input)}"
        )
    if -1 in sizes:
        sizes[sizes.index(-1)] = input.shape[axis] // known
    return reshape(input, input.shape[:axis] + tuple(sizes) + input.shape[axis + 1 :])


@user_errors
def movedim(input: Tensor, source, destination) -> Tensor:  # noqa: A002
    """Dims ``source`` moved to positions ``destination``, the others in their order."""
    checked_tensor("movedim", input)
    source = (source,) if isinstance(source, int) else tuple(source)
    destination = (destination,) if isinstance(destination, int) else tuple(destination)
    if len(source) != len(destination):
        raise ValueError(f"movedim: source {source} and destination {destination} differ in length")
    source = [normalize_axis(axis, input.ndim, "movedim") for axis in source]
    destination = [normalize_axis(axis, input.ndim, "movedim") for axis in destination]
    order = [None] * input.ndim
    for axis, place in zip(source, destination):
        order[place] = axis
    rest = iter(axis for axis in range(input.ndim) if axis not in source)
    return permute(input, tuple(axis if axis is not None else next(rest) for axis in order))


for _name, _function in (
    ("split", split), ("chunk", chunk), ("unbind", unbind), ("clone", clone),
    ("contiguous", contiguous), ("type_as", type_as), ("new_zeros", new_zeros),
    ("new_ones", new_ones), ("new_empty", new_empty), ("new_full", new_full),
    ("new_tensor", new_tensor), ("softmax", _softmax), ("log_softmax", _log_softmax),
    ("repeat_interleave", repeat_interleave), ("roll", roll), ("outer", outer),
    ("diagonal", diagonal), ("diag", diag), ("unfold", unfold), ("unflatten", unflatten),
    ("movedim", movedim), ("moveaxis", movedim),
):  # fmt: skip
    if not hasattr(Tensor, _name):
        setattr(Tensor, _name, _function)
if not hasattr(Tensor, "dim"):
    Tensor.dim = lambda self: self.ndim
    Tensor.ndimension = Tensor.dim
if not hasattr(Tensor, "is_contiguous"):
    Tensor.is_contiguous = lambda self, memory_format=None: True

moveaxis = movedim
__all__ = [
    "chunk", "clone", "diag", "diagonal", "meshgrid", "moveaxis", "movedim", "outer",
    "repeat_interleave", "roll", "split", "unbind", "unflatten",
]  # fmt: skip
