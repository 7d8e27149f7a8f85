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

from flame.amp.autocast_mode import lower_precision
from flame.ir import dtypes
from flame.ir.node import format_site, user_site
from flame.ir.ops import linalg as _declarations  # noqa: F401  (registers matmul)
from flame.ir.ops.linalg import PRECISIONS
from flame.ir.shapes import ShapeError
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


def _rmatmul(self: Tensor, other) -> Tensor:
    return matmul(other, self)


for _name, _function in (
    ("__matmul__", matmul), ("__rmatmul__", _rmatmul), ("matmul", matmul), ("bmm", bmm),
):  # fmt: skip
    if _name not in Tensor.__dict__:
        setattr(Tensor, _name, _function)

__all__ = [
    "PRECISIONS", "bmm", "get_matmul_precision", "matmul", "matmul_precision",
    "set_matmul_precision",
]  # fmt: skip
