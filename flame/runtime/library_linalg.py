"""``matmul`` on the GPU: cuBLAS ``gemmEx`` / ``gemmStridedBatchedEx`` (flame/runtime/cublas.py:
bound with ctypes, so products can be captured into CUDA graphs).

All four float dtypes take one path (CuPy's ``matmul`` would choose its own compute type
and copy non-contiguous inputs): float32 computes in IEEE float32 (``CUBLAS_COMPUTE_32F``,
TF32 tensor cores off even where the handle's math mode allows them) or, when the node says
``precision="tf32"``, with ``CUBLAS_COMPUTE_32F_FAST_TF32``; float16 and bfloat16 (uint16
bits) run on tensor cores and accumulate in float32; float64 computes in double
(``CUBLAS_COMPUTE_64F``, alpha and beta double too).

cuBLAS is column-major. A row-major ``out = left @ right`` is computed as the column-major
``out^T = right^T @ left^T``: a row-major operand is already the transposed matrix cuBLAS
wants (``OP_N``), a column-major one (a transposed view, e.g. ``b.T``) is passed with
``OP_T``. Strides are read from the arrays, so views reach cuBLAS without a copy; only a
layout no leading dimension can describe (both strides > 1, zero or negative strides) is
copied. Batch axes become one strided-batched call where every operand's batch strides
collapse into one, and a Python loop over the outer axes where they do not; a batch of
rows times one matrix (``x @ W`` with ``x`` 3-D) becomes a single large GEMM.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from flame.ir import dtypes
from flame.ir.node import Node
from flame.runtime.library import implements

OP_N, OP_T = 0, 1
CUBLAS_COMPUTE_32F = 68
CUBLAS_COMPUTE_32F_FAST_TF32 = 77
CUBLAS_COMPUTE_64F = 70
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_DEFAULT_MATH, CUBLAS_TF32_TENSOR_OP_MATH = 0, 3
CUDA_DATA_TYPE = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 14}  # cudaDataType_t
INT_LIMIT = 2**31 - 1  # cuBLAS takes sizes and leading dimensions as int
# alpha and beta are read from host memory (cuBLAS's default pointer mode), in the compute
# type's precision: float32 for the 32F compute types, double for 64F
_SCALARS = {
    compute: (np.ones((), dtype), np.zeros((), dtype))
    for compute, dtype in ((CUBLAS_COMPUTE_32F, np.float32), (CUBLAS_COMPUTE_64F, np.float64))
}  # alive as long as the module: cuBLAS reads them through their addresses
_SCALARS[CUBLAS_COMPUTE_32F_FAST_TF32] = _SCALARS[CUBLAS_COMPUTE_32F]
_POINTERS = {
    compute: (one.ctypes.data, zero.ctypes.data) for compute, (one, zero) in _SCALARS.items()
}


@dataclass(frozen=True)
class Operand:
    """One operand as the column-major call reads it: where its first matrix starts (bytes),
    ``OP_N``/``OP_T``, the leading dimension, and one stride per result batch axis
    (elements, 0 where the operand is broadcast)."""

    pointer: int
    transpose: int
    leading: int
    batch_strides: tuple[int, ...]
    rows: int
    row_stride: int  # the actual stride between rows (for folding batch axes into rows)


def matrix_layout(rows: int, columns: int, row_stride: int, column_stride: int):
    """``(OP_N | OP_T, leading dimension)`` for a matrix with these element strides, or None
    when no leading dimension describes it. Axes of size 1 may have any stride."""
    if (column_stride == 1 or columns == 1) and (rows == 1 or row_stride >= max(1, columns)):
        return OP_N, (row_stride if rows > 1 else max(1, columns))
    if (row_stride == 1 or rows == 1) and (columns == 1 or column_stride >= max(1, rows)):
        return OP_T, (column_stride if columns > 1 else max(1, rows))
    return None


def _operand(array, batch: tuple[int, ...], xp, pointer_of):
    """(Operand, array): the array is copied only when its matrix layout needs it."""
    rows, columns = array.shape[-2:]
    strides = [stride // array.itemsize for stride in array.strides]
    layout = matrix_layout(rows, columns, strides[-2], strides[-1])
    if layout is None or min(strides, default=0) < 0:
        array = xp.ascontiguousarray(array)
        strides = [stride // array.itemsize for stride in array.strides]
        layout = matrix_layout(rows, columns, strides[-2], strides[-1])
    own_batch = array.shape[:-2]
    lead = len(batch) - len(own_batch)
    batch_strides = tuple(
        0 if axis < lead or own_batch[axis - lead] == 1 else strides[axis - lead]
        for axis in range(len(batch))
    )
    operand = Operand(pointer_of(array), layout[0], layout[1], batch_strides, rows, strides[-2])
    return operand, array


def collapse_split(sizes, *stride_lists) -> int:
    """The first axis of the longest suffix of batch axes that every operand can step
    through with a single stride (``stride[i] == stride[i + 1] * sizes[i + 1]``)."""
    split = len(sizes) - 1 if sizes else 0
    while split > 0:
        if not all(s[split - 1] == s[split] * sizes[split] for s in stride_lists):
            break
        split -= 1
    return split


def _fold_rows(left: Operand, right: Operand, batch, inner: int) -> Operand | None:
    """``left`` with its batch axes folded into its rows, when ``right`` is the same matrix
    for every batch entry and ``left``'s rows are evenly spaced across batch entries."""
    if any(right.batch_strides) or left.transpose != OP_N or not batch:
        return None
    pairs = [
        (size, stride) for size, stride in zip(batch, left.batch_strides, strict=True) if size != 1
    ]
    if left.rows != 1:
        pairs.append((left.rows, left.row_stride))
    if not pairs:
        return None
    sizes, strides = [size for size, _ in pairs], [stride for _, stride in pairs]
    if collapse_split(sizes, strides) != 0 or strides[-1] < max(1, inner):
        return None
    return Operand(left.pointer, OP_N, strides[-1], (), left.rows, strides[-1])


class GemmCall(NamedTuple):
    """One cuBLAS call, column-major: ``C = op(A) @ op(B)`` where ``A`` is the right operand
    and ``B`` the left one (see the module docstring). Pointers in bytes, the rest in
    elements; ``count > 1`` makes it a strided-batched call."""

    transpose_a: int
    transpose_b: int
    m: int
    n: int
    k: int
    a: int
    lda: int
    stride_a: int
    b: int
    ldb: int
    stride_b: int
    c: int
    ldc: int
    stride_c: int
    count: int


def _batch_steps(left: Operand, right: Operand, out, batch):
    """``(count, (left, right, out) stride, [(left, right, out) offset, ...])``: one
    strided-batched call per offset triple, over the collapsible suffix of batch axes."""
    kept = [axis for axis, size in enumerate(batch) if size != 1]
    sizes = [batch[axis] for axis in kept]
    out_strides = [stride // out.itemsize for stride in out.strides[:-2]]
    stride_lists = tuple(
        [strides[axis] for axis in kept]
        for strides in (left.batch_strides, right.batch_strides, out_strides)
    )
    split = collapse_split(sizes, *stride_lists)
    count = int(np.prod(sizes[split:], dtype=np.int64))
    steps = tuple(strides[-1] if strides else 0 for strides in stride_lists)
    offsets = [
        # the outer coordinates pair with the first ``split`` strides of each operand
        tuple(sum(i * s for i, s in zip(outer, strides, strict=False)) for strides in stride_lists)
        for outer in itertools.product(*(range(size) for size in sizes[:split]))
    ]
    return count, steps, offsets


def plan_gemms(left, right, out, xp, pointer_of) -> tuple[list[GemmCall], list]:
    """The cuBLAS calls that compute ``out = left @ right`` (arrays of rank >= 2 whose batch
    axes broadcast to ``out``'s), and the arrays they read, which must stay alive until the
    calls have run (copies, where a layout needed one). ``xp`` is the array module (CuPy;
    NumPy in the CPU tests) and ``pointer_of(array)`` an array's address."""
    batch = tuple(out.shape[:-2])
    rows, inner = left.shape[-2:]
    columns = right.shape[-1]
    left_operand, left = _operand(left, batch, xp, pointer_of)
    right_operand, right = _operand(right, batch, xp, pointer_of)
    out_pointer = pointer_of(out)
    folded = _fold_rows(left_operand, right_operand, batch, inner)
    if folded is not None:
        call = GemmCall(
            right_operand.transpose, OP_N, columns, out.size // columns, inner,
            right_operand.pointer, right_operand.leading, 0,
            folded.pointer, folded.leading, 0, out_pointer, columns, 0, 1,
        )  # fmt: skip
        return [call], [left, right]
    count, (left_step, right_step, out_step), offsets = _batch_steps(
        left_operand, right_operand, out, batch
    )
    item = out.itemsize
    shape = (right_operand.transpose, left_operand.transpose, columns, rows, inner)
    calls = [
        GemmCall(
            *shape,
            right_operand.pointer + right_offset * item, right_operand.leading, right_step,
            left_operand.pointer + left_offset * item, left_operand.leading, left_step,
            out_pointer + out_offset * item, columns, out_step, count,
        )
        for left_offset, right_offset, out_offset in offsets
    ]  # fmt: skip
    return calls, [left, right]


PLAN_CACHE_SIZE = 256
# layout -> calls with pointers relative to (right, left, out): planning costs ~40 us of
# Python, more than a small batched GEMM takes on the GPU
_plans: dict[tuple, tuple[GemmCall, ...]] = {}


def cached_gemms(left, right, out, xp, pointer_of) -> tuple[list[GemmCall], list]:
    """``plan_gemms``, remembered per layout (shapes, strides, item size) when no operand
    had to be copied: a repeated matmul only rebases the calls onto its arrays."""
    key = (left.shape, left.strides, right.shape, right.strides, out.shape, out.itemsize)
    bases = (pointer_of(right), pointer_of(left), pointer_of(out))
    template = _plans.get(key)
    if template is not None:
        return [_rebased(call, bases, 1) for call in template], [left, right]
    calls, alive = plan_gemms(left, right, out, xp, pointer_of)
    if alive[0] is left and alive[1] is right:
        if len(_plans) >= PLAN_CACHE_SIZE:
            _plans.pop(next(iter(_plans)))
        _plans[key] = tuple(_rebased(call, bases, -1) for call in calls)
    return calls, alive


def _rebased(call: GemmCall, bases, sign: int) -> GemmCall:
    right, left, out = bases
    return call._replace(a=call.a + sign * right, b=call.b + sign * left, c=call.c + sign * out)


@contextlib.contextmanager
def _math_mode(handle, precision: str, dtype_name: str):
    """Keep TF32 off for float32 "highest" even when the handle was set to allow it
    (CuPy does that under CUPY_TF32=1); restore the handle's mode afterwards."""
    from flame.runtime import cublas

    strict = dtype_name == "float32" and precision == "highest"
    if not strict:
        yield
        return
    mode = cublas.math_mode(handle)
    if (mode & 0xF) != CUBLAS_TF32_TENSOR_OP_MATH:
        yield
        return
    cublas.library().SetMathMode(handle, (mode & ~0xF) | CUBLAS_DEFAULT_MATH)
    try:
        yield
    finally:
        cublas.library().SetMathMode(handle, mode)


def _issue(call: GemmCall, handle: int, data_type: int, compute_type: int) -> None:
    from flame.runtime.cublas import library

    cublas = library()
    largest = max(call.m, call.n, call.k, call.lda, call.ldb, call.ldc, call.count)
    if largest > INT_LIMIT:
        raise ValueError(f"matmul: size {largest} exceeds cuBLAS's int range")
    one, zero = _POINTERS[compute_type]
    head = (handle, call.transpose_a, call.transpose_b, call.m, call.n, call.k, one)
    if call.count == 1:
        cublas.GemmEx(
            *head, call.a, data_type, call.lda, call.b, data_type, call.ldb,
            zero, call.c, data_type, call.ldc, compute_type, CUBLAS_GEMM_DEFAULT,
        )  # fmt: skip
        return
    cublas.GemmStridedBatchedEx(
        *head, call.a, data_type, call.lda, call.stride_a, call.b, data_type, call.ldb,
        call.stride_b, zero, call.c, data_type, call.ldc, call.stride_c,
        call.count, compute_type, CUBLAS_GEMM_DEFAULT,
    )  # fmt: skip


@implements("matmul")
def matmul(node: Node, arrays: list):
    import cupy

    from flame.runtime.cublas import library

    left, right = arrays
    dtype = node.inputs[0].dtype
    # 1-D operands: a row on the left, a column on the right; reshape is a view here
    left = left.reshape(1, -1) if left.ndim == 1 else left
    right = right.reshape(-1, 1) if right.ndim == 1 else right
    matrix_axes = (len(node.inputs[0].shape) > 1) + (len(node.inputs[1].shape) > 1)
    batch = tuple(node.shape[: len(node.shape) - matrix_axes])
    storage = np.uint16 if dtype is dtypes.bfloat16 else dtype.numpy
    out = cupy.empty(batch + (left.shape[-2], right.shape[-1]), dtype=storage)
    if out.size == 0 or left.shape[-1] == 0:
        out.fill(0)  # an empty sum is 0 (cuBLAS leaves C unwritten when k == 0)
        return out.reshape(node.shape)
    calls, _alive = cached_gemms(left, right, out, cupy, lambda array: array.data.ptr)
    precision = node.attr("precision", "highest")
    compute = CUBLAS_COMPUTE_64F if dtype is dtypes.float64 else CUBLAS_COMPUTE_32F
    if dtype is dtypes.float32 and precision == "tf32":
        compute = CUBLAS_COMPUTE_32F_FAST_TF32
    handle = cupy.cuda.device.get_cublas_handle()
    library().SetStream(handle, cupy.cuda.get_current_stream().ptr)
    with _math_mode(handle, precision, dtype.name):
        for call in calls:
            _issue(call, handle, CUDA_DATA_TYPE[dtype.name], compute)
    return out.reshape(node.shape)
