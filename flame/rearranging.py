"""Rearranging entries, with PyTorch's names and arguments: ``t swapaxes swapdims adjoint
ravel view_as expand_as reshape_as tile rot90 diff``, and the layout metadata ``stride
storage_offset element_size nelement``.

Every op is a composition of views (permutes, slices, reshapes, broadcasts), ``repeat``,
``cat`` and a subtraction, so each is differentiable through those ops' rules and none adds
an op to the registry. Bad arguments raise when the op is built, naming the op, the shapes
and the dim, at the user's line.
"""

from __future__ import annotations

from flame.ir.shapes import ShapeError, prod
from flame.joining import cat, repeat
from flame.shaping import checked_tensor, clone, shown, user_errors
from flame.tensor import Tensor
from flame.views import expand, flip, narrow, normalize_axis, reshape, transpose, view

# --- transposes -----------------------------------------------------------------------------


@user_errors
def t(input: Tensor) -> Tensor:  # noqa: A002 (PyTorch's name)
    """The transpose of a 2-d tensor; a 0-d or 1-d tensor is returned as it is."""
    checked_tensor("t", input)
    if input.ndim > 2:
        raise ShapeError(
            f"t: expects a tensor with <= 2 dimensions, but input {shown(input)} is "
            f"{input.ndim}-D (use transpose or mT)"
        )
    return transpose(input, 0, 1) if input.ndim == 2 else input


@user_errors
def swapaxes(input: Tensor, axis0: int, axis1: int) -> Tensor:  # noqa: A002
    """``transpose`` under NumPy's name."""
    return _swapped("swapaxes", input, axis0, axis1)


@user_errors
def swapdims(input: Tensor, dim0: int, dim1: int) -> Tensor:  # noqa: A002
    """``transpose`` under another of PyTorch's names."""
    return _swapped("swapdims", input, dim0, dim1)


def _swapped(name: str, input: Tensor, first: int, second: int) -> Tensor:  # noqa: A002
    checked_tensor(name, input)
    first, second = (
        normalize_axis(first, input.ndim, name),
        normalize_axis(second, input.ndim, name),
    )
    return transpose(input, first, second)


@user_errors
def adjoint(input: Tensor) -> Tensor:  # noqa: A002
    """The conjugate transpose of the last two dims (FLAME's dtypes are real: the transpose)."""
    checked_tensor("adjoint", input)
    if input.ndim < 2:
        raise ShapeError(
            "adjoint: only supported on matrices or batches of matrices, got a "
            f"{input.ndim}-D tensor {shown(input)}"
        )
    return transpose(input, -2, -1)


# --- shapes of other tensors ----------------------------------------------------------------


@user_errors
def ravel(input: Tensor) -> Tensor:  # noqa: A002
    """The entries as a 1-d tensor, in row-major order (a 0-d tensor gives shape [1])."""
    return reshape(checked_tensor("ravel", input), (-1,))


@user_errors
def view_as(self: Tensor, other: Tensor) -> Tensor:
    return view(self, checked_tensor("view_as", other).shape)


@user_errors
def expand_as(self: Tensor, other: Tensor) -> Tensor:
    return expand(self, checked_tensor("expand_as", other).shape)


@user_errors
def reshape_as(self: Tensor, other: Tensor) -> Tensor:
    return reshape(self, checked_tensor("reshape_as", other).shape)


# --- tiling, rotating, differencing ---------------------------------------------------------


@user_errors
def tile(input: Tensor, dims) -> Tensor:  # noqa: A002
    """``input`` repeated ``dims[d]`` times along each dim; fewer ``dims`` than the input
    has dims count from the last (the rest are 1), more add leading dims (``repeat``)."""
    checked_tensor("tile", input)
    dims = (dims,) if isinstance(dims, int) else tuple(int(count) for count in dims)
    if any(count < 0 for count in dims):
        raise ShapeError(f"tile: dims {list(dims)} must be non-negative (input {shown(input)})")
    dims = (1,) * (input.ndim - len(dims)) + dims
    return repeat(input, dims)


def _tile_method(self: Tensor, *dims) -> Tensor:
    """``x.tile(2, 3)`` or ``x.tile((2, 3))``."""
    if len(dims) == 1 and not isinstance(dims[0], int):
        dims = tuple(dims[0])
    return tile(self, dims)


@user_errors
def rot90(input: Tensor, k: int = 1, dims=(0, 1)) -> Tensor:  # noqa: A002
    """``input`` rotated by 90 degrees ``k`` times in the plane of ``dims``, from the first
    towards the second (a flip and a transpose: a view; ``k % 4 == 0`` gives a copy, as
    PyTorch's)."""
    checked_tensor("rot90", input)
    dims = tuple(dims)
    if len(dims) != 2:
        raise ValueError(f"rot90: expected 2 rotation dims, got dims = {list(dims)}")
    if input.ndim < 2:
        raise ShapeError(f"rot90: expects a tensor with >= 2 dims, got {shown(input)}")
    first = normalize_axis(dims[0], input.ndim, "rot90")
    second = normalize_axis(dims[1], input.ndim, "rot90")
    if first == second:
        raise ValueError(
            f"rot90: rotation dims must differ, got dim0 = {dims[0]} and dim1 = {dims[1]} "
            f"for input {shown(input)}"
        )
    turns = k % 4
    if turns == 1:
        return transpose(flip(input, second), first, second)
    if turns == 2:
        return flip(input, (first, second))
    if turns == 3:
        return transpose(flip(input, first), first, second)
    return clone(input)


@user_errors
def diff(input: Tensor, n: int = 1, dim: int = -1, prepend=None, append=None) -> Tensor:  # noqa: A002
    """The ``n``-th forward difference along ``dim`` (``x[i + 1] - x[i]``; ``!=`` for bool),
    after ``prepend`` and ``append`` are joined to ``input`` along ``dim``. Each difference
    is one entry shorter, down to an empty dim."""
    checked_tensor("diff", input)
    if input.ndim == 0:
        raise ShapeError(f"diff: expects input to be at least one-dimensional, got {shown(input)}")
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"diff: order n must be an int, got {type(n).__name__}")
    if n < 0:
        raise ValueError(f"diff: order n must be non-negative, got {n}")
    axis = normalize_axis(dim, input.ndim, "diff")
    if n == 0:  # the input itself, prepend and append left out (as PyTorch)
        return clone(input)
    pieces = [input]
    for name, extra in (("prepend", prepend), ("append", append)):
        if extra is not None:
            _check_joined(name, input, checked_tensor(f"diff: {name}", extra), axis)
            pieces.insert(0 if name == "prepend" else len(pieces), extra)
    x = cat(pieces, axis) if len(pieces) > 1 else input
    for _ in range(n):
        length = x.shape[axis]
        if length == 0:
            break
        later, earlier = narrow(x, axis, 1, length - 1), narrow(x, axis, 0, length - 1)
        x = (later != earlier) if x.dtype.is_bool else later - earlier
    return x


def _check_joined(name: str, input: Tensor, extra: Tensor, axis: int) -> None:  # noqa: A002
    if extra.ndim != input.ndim:
        raise ShapeError(f"diff: {name} {shown(extra)} must have the dims of input {shown(input)}")
    for position, (size, extra_size) in enumerate(zip(input.shape, extra.shape)):
        if position != axis and size != extra_size:
            raise ShapeError(
                f"diff: {name} {shown(extra)} must match input {shown(input)} on every dim "
                f"but the differencing dim {axis} (dim {position}: {extra_size} vs {size})"
            )


# --- layout metadata ------------------------------------------------------------------------


def stride(self: Tensor, dim: int | None = None):
    """The strides (in elements) of a C-contiguous tensor of this shape, as PyTorch computes
    them (a dim of size 0 or 1 counts as size 1); with ``dim``, that dim's stride.

    FLAME chooses layouts itself and every tensor reads as a C-contiguous one:
    ``is_contiguous()`` is always True, ``contiguous()`` returns the tensor itself, and a view
    (``t()``, ``x[:, 1:]``, ``expand``) that is realized gets memory of its own. Lazy views
    have no memory of their own to report strides of, so these are the strides the tensor
    promises, consistent with ``is_contiguous()`` (a buffer imported from NumPy or DLPack
    may sit in memory in other strides; FLAME reads it through them, and no FLAME op depends
    on them)."""
    sizes = [max(size, 1) for size in self.shape]
    strides = tuple(prod(sizes[axis + 1 :]) for axis in range(self.ndim))
    if dim is None:
        return strides
    try:
        if self.ndim == 0:
            raise IndexError(f"stride: dim {dim} given, but a 0-d tensor has no dims")
        return strides[normalize_axis(dim, self.ndim, "stride")]
    except IndexError as error:
        from flame.linalg import at_user_line

        raise at_user_line(error) from None


def storage_offset(self: Tensor) -> int:
    """0: every tensor starts at its memory's first element (see ``stride``)."""
    return 0


def element_size(self: Tensor) -> int:
    """Bytes per element of the tensor's dtype."""
    return self.dtype.itemsize


def nelement(self: Tensor) -> int:
    return self.numel()


for _name, _function in (
    ("t", t), ("swapaxes", swapaxes), ("swapdims", swapdims), ("adjoint", adjoint),
    ("ravel", ravel), ("view_as", view_as), ("expand_as", expand_as),
    ("reshape_as", reshape_as), ("tile", _tile_method), ("rot90", rot90), ("diff", diff),
    ("stride", stride), ("storage_offset", storage_offset), ("element_size", element_size),
    ("nelement", nelement),
):  # fmt: skip
    if not hasattr(Tensor, _name):
        setattr(Tensor, _name, _function)

__all__ = [
    "adjoint", "diff", "ravel", "rot90", "swapaxes", "swapdims", "t", "tile",
]  # fmt: skip
