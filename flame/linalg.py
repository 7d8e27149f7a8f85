"""Matrix products: ``flame.matmul``, ``flame.bmm``, the ``@`` operator, and the float32
matmul precision setting.

``matmul`` follows ``numpy.matmul`` (1-D vectors, batch broadcasting). Operands of two float
dtypes are promoted first (float16 with bfloat16 gives float32); integer or bool operands are
rejected. On the GPU the product runs in cuBLAS (``flame/runtime/library_linalg.py``); it is
a fusion boundary, so ``fl.gelu(a @ b + bias)`` is one cuBLAS call and one fused kernel.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings

from flame.amp.autocast_mode import lower_precision
from flame.ir import dtypes
from flame.ir.node import format_site, user_site
from flame.ir.ops import linalg as _declarations  # noqa: F401  (registers matmul)
from flame.ir.ops.linalg import PRECISIONS
from flame.ir.shapes import ShapeError, broadcast_shapes
from flame.tensor import Tensor, apply_op

_ALIASES = {"highest": "highest", "tf32": "tf32", "high": "tf32"}  # "high": PyTorch's name
# A context variable, like the backend: a thread or task that sets it never changes what
# another one builds. The value is copied into each matmul node when it is built.
_precision: contextvars.ContextVar[str] = contextvars.ContextVar(
    "flame_matmul_precision", default="highest"
)


def _resolve_precision(precision: str) -> str:
    resolved = _ALIASES.get(precision) if isinstance(precision, str) else None
    if resolved is None:
        choices = ", ".join(repr(name) for name in _ALIASES)
        raise ValueError(f"matmul precision must be one of {choices}, got {precision!r}")
    return resolved


def set_matmul_precision(precision: str) -> None:
    """How float32 matmuls built from now on (in this thread or task) may compute:
    ``"highest"`` (the default: IEEE float32) or ``"tf32"`` (alias ``"high"``: TF32 tensor
    cores, about 10 mantissa bits per input, float32 accumulation; several times faster on
    Ampere and later). float16 and bfloat16 matmuls are unaffected."""
    _precision.set(_resolve_precision(precision))


def get_matmul_precision() -> str:
    return _precision.get()


@contextlib.contextmanager
def matmul_precision(precision: str):
    """``with flame.matmul_precision("tf32"): ...``: the setting for a block only."""
    token = _precision.set(_resolve_precision(precision))
    try:
        yield
    finally:
        _precision.reset(token)


def at_user_line(error: Exception) -> Exception:
    """``error`` with the user's source line appended, as the tensor layer reports errors."""
    site = user_site()
    if site is None:
        return error
    return type(error)(f"{error} [at {format_site(site)}]")


def _check_operands(op_name: str, left, right) -> None:
    for value in (left, right):
        if not isinstance(value, Tensor):
            raise at_user_line(
                TypeError(f"{op_name}: expected flame.Tensor operands, got {type(value).__name__}")
            )


def _promoted(left: Tensor, right: Tensor) -> tuple[Tensor, Tensor]:
    """Both operands in their common float dtype; non-float operands are left for the
    op's rule to reject with a message naming both dtypes."""
    if left.dtype is right.dtype or not (left.dtype.is_float and right.dtype.is_float):
        return left, right
    common = dtypes.promote(left.dtype, right.dtype)
    return left.to(common), right.to(common)


def matmul(left: Tensor, right: Tensor) -> Tensor:
    """``left @ right`` with ``numpy.matmul`` semantics; float32, float64, float16 or bfloat16."""
    _check_operands("matmul", left, right)
    left, right = lower_precision(left, right)  # autocast: bmm and @ come through here
    left, right = _promoted(left, right)
    precision = _precision.get() if left.dtype is dtypes.float32 else "highest"
    return apply_op("matmul", left, right, precision=precision)


def bmm(left: Tensor, right: Tensor) -> Tensor:
    """Batched matrix product of two 3-D tensors with the same batch size (no broadcasting,
    as ``torch.bmm``): ``[b, n, m] @ [b, m, p] -> [b, n, p]``."""
    _check_operands("bmm", left, right)
    shown = f"{list(left.shape)} and {list(right.shape)}"
    if left.ndim != 3 or right.ndim != 3:
        raise at_user_line(ShapeError(f"bmm: needs two 3-D tensors, got shapes {shown}"))
    if left.shape[0] != right.shape[0]:
        raise at_user_line(ShapeError(f"bmm: batch sizes differ: shapes {shown}"))
    if left.shape[2] != right.shape[1]:
        raise at_user_line(
            ShapeError(
                f"bmm: inner dimensions differ: shapes {shown} "
                f"({left.shape[2]} vs {right.shape[1]})"
            )
        )
    return matmul(left, right)


# --- products with an added input: addmm, baddbmm -------------------------------------------


def addmm(input: Tensor, mat1: Tensor, mat2: Tensor, *, beta=1, alpha=1) -> Tensor:  # noqa: A002
    """``beta * input + alpha * (mat1 @ mat2)`` for matrices ``mat1 [n, m]`` and ``mat2
    [m, p]``; ``input`` broadcasts to ``[n, p]``. All three share one dtype, as in PyTorch.
    ``beta=0`` does not read ``input`` and ``alpha=0`` not the product (NaN or inf there
    does not reach the result, as PyTorch's); they still get their zero gradient."""
    _check_operands("addmm", mat1, mat2)
    for name, value in (("mat1", mat1), ("mat2", mat2)):
        if value.ndim != 2:
            raise at_user_line(ShapeError(f"addmm: {name} must be a matrix, got {_shown(value)}"))
    if mat1.shape[1] != mat2.shape[0]:
        raise at_user_line(
            ShapeError(
                f"addmm: mat1 and mat2 shapes cannot be multiplied "
                f"({mat1.shape[0]}x{mat1.shape[1]} and {mat2.shape[0]}x{mat2.shape[1]})"
            )
        )
    return _added_product("addmm", input, mat1, mat2, beta, alpha)


def baddbmm(input: Tensor, batch1: Tensor, batch2: Tensor, *, beta=1, alpha=1) -> Tensor:  # noqa: A002
    """``beta * input + alpha * bmm(batch1, batch2)`` (``input`` broadcasts to ``[b, n,
    p]``); ``beta=0`` and ``alpha=0`` as in ``addmm``."""
    _check_operands("baddbmm", batch1, batch2)
    shown = f"{_shown(batch1)} and {_shown(batch2)}"
    if batch1.ndim != 3 or batch2.ndim != 3:
        raise at_user_line(ShapeError(f"baddbmm: needs two 3-D batches, got {shown}"))
    if batch1.shape[0] != batch2.shape[0] or batch1.shape[2] != batch2.shape[1]:
        raise at_user_line(ShapeError(f"baddbmm: batch sizes or inner dimensions differ: {shown}"))
    return _added_product("baddbmm", input, batch1, batch2, beta, alpha)


def _shown(value: Tensor) -> str:
    return f"{value.dtype.name}{list(value.shape)}"


def _zero_tie(value: Tensor) -> Tensor:
    """Exactly 0 (``sign(v) - sign(v)``; sign(NaN) is 0) with a zero gradient to ``value``:
    a term left out of the result keeps its place in the graph, as PyTorch's gradient 0."""
    from flame.functional import sign

    link = sign(value)
    return link - link


def _added_product(name: str, input, left: Tensor, right: Tensor, beta, alpha) -> Tensor:  # noqa: A002
    if not isinstance(input, Tensor):
        raise at_user_line(
            TypeError(f"{name}: expected a flame.Tensor input, got {type(input).__name__}")
        )
    if not (input.dtype is left.dtype and left.dtype is right.dtype):
        raise at_user_line(
            TypeError(
                f"{name}: input, and both factors must have the same dtype, got "
                f"{_shown(input)}, {_shown(left)} and {_shown(right)}"
            )
        )
    if not left.dtype.is_float:
        raise at_user_line(
            TypeError(f"{name}: needs float tensors, got {_shown(left)} and {_shown(right)}")
        )
    shape = left.shape[:-1] + right.shape[-1:]
    lead = len(shape) - input.ndim
    if lead < 0 or any(size not in (1, target) for size, target in zip(input.shape, shape[lead:])):
        raise at_user_line(
            ShapeError(
                f"{name}: input {_shown(input)} does not broadcast to the product's {list(shape)}"
            )
        )
    product = matmul(left, right)
    if alpha == 0:
        product = (_zero_tie(left).sum() + _zero_tie(right).sum()).expand(shape)
    elif alpha != 1:
        product = product * alpha
    if beta == 0:
        return product + _zero_tie(input)
    return product + (input if beta == 1 else input * beta)


# --- cross product -----------------------------------------------------------------------


def cross(input: Tensor, other: Tensor, dim: int | None = None) -> Tensor:  # noqa: A002
    """The cross product of 3-vectors along ``dim`` (``input`` and ``other`` have one rank
    and dtype, and broadcast). ``dim=None`` takes the first dim of size 3 and warns, as
    PyTorch's ``torch.cross`` (whose default will become ``linalg.cross``'s ``-1``)."""
    from flame.joining import cat
    from flame.views import expand, narrow, normalize_axis

    _check_operands("cross", input, other)
    if input.ndim != other.ndim:
        raise at_user_line(
            ShapeError(
                f"cross: inputs must have the same number of dimensions, got {_shown(input)} "
                f"and {_shown(other)}"
            )
        )
    if input.dtype is not other.dtype:
        raise at_user_line(
            TypeError(f"cross: inputs must have one dtype, got {_shown(input)} and {_shown(other)}")
        )
    try:
        shape = broadcast_shapes("cross", input.shape, other.shape)
    except ShapeError as error:
        raise at_user_line(error) from None
    if dim is None:
        if 3 not in shape:
            raise at_user_line(ShapeError(f"cross: no dimension of size 3 in {_shown(input)}"))
        dim = shape.index(3)
        warnings.warn(
            "flame.cross without dim= takes the first dim of size 3, as torch.cross (which "
            "deprecates it); pass dim explicitly",
            UserWarning,
            stacklevel=2,
        )
    try:
        axis = normalize_axis(dim, len(shape), "cross")
    except (IndexError, TypeError) as error:
        raise at_user_line(error) from None
    if input.shape[axis] != 3 or other.shape[axis] != 3:
        raise at_user_line(
            ShapeError(
                f"cross: dim {dim} must have length 3, got {_shown(input)} and {_shown(other)}"
            )
        )
    a = [narrow(expand(input, shape), axis, index, 1) for index in range(3)]
    b = [narrow(expand(other, shape), axis, index, 1) for index in range(3)]
    pieces = [a[(k + 1) % 3] * b[(k + 2) % 3] - a[(k + 2) % 3] * b[(k + 1) % 3] for k in range(3)]
    return cat(pieces, axis)


def _rmatmul(self: Tensor, other) -> Tensor:
    return matmul(other, self)


for _name, _function in (
    ("__matmul__", matmul), ("__rmatmul__", _rmatmul), ("matmul", matmul), ("bmm", bmm),
    ("addmm", addmm), ("baddbmm", baddbmm), ("cross", cross),
):  # fmt: skip
    if _name not in Tensor.__dict__:
        setattr(Tensor, _name, _function)

__all__ = [
    "PRECISIONS", "addmm", "baddbmm", "bmm", "cross", "get_matmul_precision", "matmul",
    "matmul_precision", "set_matmul_precision",
]  # fmt: skip
