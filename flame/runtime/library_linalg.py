"""``matmul`` on the GPU: cuBLAS ``gemmEx`` / ``gemmStridedBatchedEx`` through CuPy.

All three float dtypes take one path (CuPy's ``matmul`` would choose its own compute type
and copy non-contiguous inputs): float32 computes in IEEE float32 (``CUBLAS_COMPUTE_32F``,
TF32 tensor cores off even where the handle's math mode allows them) or, when the node says
``precision="tf32"``, with ``CUBLAS_COMPUTE_32F_FAST_TF32``; float16 and bfloat16 (uint16
bits) run on tensor cores and accumulate in float32.

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
import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np

from flame.ir import dtypes
from flame.ir.node import Node
from flame.runtime.library import implements

OP_N, OP_T = 0, 1
CUBLAS_COMPUTE_32F = 68
CUBLAS_COMPUTE_32F_FAST_TF32 = 77
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_DEFAULT_MATH, CUBLAS_TF32_TENSOR_OP_MATH = 0, 3
CUDA_DATA_TYPE = {"float32": 0, "float16": 2, "bfloat16": 14}  # cudaDataType_t
INT_LIMIT = 2**31 - 1  # cuBLAS takes sizes and leading dimensions as int
# alpha and beta are read from host memory (cuBLAS's default pointer mode); the compute
# types used here are all 32F, so they are float32
_ONE = np.ones((), np.float32)
_ZERO = np.zeros((), np.float32)


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


def _operand(array, batch: tuple[int, ...]):
    """(Operand, array): the array is copied only when its matrix layout needs it."""
    rows, columns = array.shape[-2:]
    strides = [stride // array.itemsize for stride in array.strides]
    layout = matrix_layout(rows, columns, strides[-2], strides[-1])
    if layout is None or min(strides, default=0) < 0:
        import cupy

        array = cupy.ascontiguousarray(array)
        strides = [stride // array.itemsize for stride in array.strides]
        layout = matrix_layout(rows, columns, strides[-2], strides[-1])
    own_batch = array.shape[:-2]
    lead = len(batch) - len(own_batch)
    batch_strides = tuple(
        0 if axis < lead or own_batch[axis - lead] == 1 else strides[axis - lead]
        for axis in range(len(batch))
    )
    operand = Operand(array.data.ptr, layout[0], layout[1], batch_strides, rows, strides[-2])
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


@contextlib.contextmanager
def _math_mode(handle, precision: str, dtype_name: str):
    """Keep TF32 off for float32 "highest" even when the handle was set to allow it
    (CuPy does that under CUPY_TF32=1); restore the handle's mode afterwards."""
    from cupy.cuda import cublas

    mode = cublas.getMathMode(handle)
    strict = dtype_name == "float32" and precision == "highest"
    if not strict or (mode & 0xF) != CUBLAS_TF32_TENSOR_OP_MATH:
        yield
        return
    cublas.setMathMode(handle, (mode & ~0xF) | CUBLAS_DEFAULT_MATH)
    try:
        yield
    finally:
        cublas.setMathMode(handle, mode)


def _check_int(what: str, *values: int) -> None:
    if max(values) > INT_LIMIT:
        raise ValueError(f"matmul: {what} {max(values)} exceeds cuBLAS's int range")


@dataclass(frozen=True)
class Gemm:
    """One cuBLAS call's fixed arguments: sizes of ``out (M x N) = left (M x K) @ right``."""

    handle: int
    data_type: int
    compute_type: int
    item_size: int
    rows: int
    columns: int
    inner: int

    def run(self, left: Operand, right: Operand, out_pointer, offsets, count, strides):
        from cupy.cuda import cublas

        left_offset, right_offset, out_offset = (offset * self.item_size for offset in offsets)
        arguments = (self.handle, right.transpose, left.transpose, self.columns, self.rows,
                     self.inner, _ONE.ctypes.data)  # fmt: skip
        right_pointer = right.pointer + right_offset
        left_pointer = left.pointer + left_offset
        out_pointer = out_pointer + out_offset
        _check_int("leading dimension", right.leading, left.leading, self.columns, count)
        if count == 1:
            cublas.gemmEx(
                *arguments, right_pointer, self.data_type, right.leading,
                left_pointer, self.data_type, left.leading, _ZERO.ctypes.data,
                out_pointer, self.data_type, self.columns, self.compute_type, CUBLAS_GEMM_DEFAULT,
            )  # fmt: skip
            return
        left_stride, right_stride, out_stride = strides
        cublas.gemmStridedBatchedEx(
            *arguments, right_pointer, self.data_type, right.leading, right_stride,
            left_pointer, self.data_type, left.leading, left_stride, _ZERO.ctypes.data,
            out_pointer, self.data_type, self.columns, out_stride, count,
            self.compute_type, CUBLAS_GEMM_DEFAULT,
        )  # fmt: skip


def _batched(gemm: Gemm, left: Operand, right: Operand, out, batch) -> None:
    """Strided-batched calls over the collapsible suffix of batch axes, a loop over the rest."""
    kept = [axis for axis, size in enumerate(batch) if size != 1]
    sizes = [batch[axis] for axis in kept]
    left_strides = [left.batch_strides[axis] for axis in kept]
    right_strides = [right.batch_strides[axis] for axis in kept]
    out_strides = [stride // out.itemsize for stride in out.strides[:-2]]
    out_strides = [out_strides[axis] for axis in kept]
    split = collapse_split(sizes, left_strides, right_strides, out_strides)
    count = int(np.prod(sizes[split:], dtype=np.int64))
    stride_lists = (left_strides, right_strides, out_strides)
    strides = tuple(s[-1] if s else 0 for s in stride_lists)
    for outer in itertools.product(*(range(size) for size in sizes[:split])):
        # the outer coordinates pair with the first ``split`` strides of each operand
        offsets = tuple(
            sum(i * s for i, s in zip(outer, axis, strict=False)) for axis in stride_lists
        )
        gemm.run(left, right, out.data.ptr, offsets, count, strides)


@implements("matmul")
def matmul(node: Node, arrays: list):
    import cupy
    from cupy.cuda import cublas

    left, right = arrays
    dtype = node.inputs[0].dtype
    if left.ndim == 1:
        left = left.reshape(1, -1)
    if right.ndim == 1:
        right = right.reshape(-1, 1)
    matrix_axes = (len(node.inputs[0].shape) > 1) + (len(node.inputs[1].shape) > 1)
    batch = tuple(node.shape[: len(node.shape) - matrix_axes])
    rows, inner, columns = left.shape[-2], left.shape[-1], right.shape[-1]
    storage = np.uint16 if dtype is dtypes.bfloat16 else dtype.numpy
    out = cupy.empty(batch + (rows, columns), dtype=storage)
    if out.size == 0 or inner == 0:
        out.fill(0)  # an empty sum is 0 (cuBLAS would leave out unwritten for k == 0)
        return out.reshape(node.shape)
    _check_int("size", rows, columns, inner)
    left_operand, left = _operand(left, batch)
    right_operand, right = _operand(right, batch)
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)
    precision = node.attr("precision", "highest")
    compute = CUBLAS_COMPUTE_32F
    if dtype is dtypes.float32 and precision == "tf32":
        compute = CUBLAS_COMPUTE_32F_FAST_TF32
    gemm = Gemm(handle, CUDA_DATA_TYPE[dtype.name], compute, out.itemsize, rows, columns, inner)
    with _math_mode(handle, precision, dtype.name):
        folded = _fold_rows(left_operand, right_operand, batch, inner)
        if folded is not None:
            whole = dataclasses.replace(gemm, rows=out.size // columns)
            whole.run(folded, right_operand, out.data.ptr, (0, 0, 0), 1, (0, 0, 0))
        else:
            _batched(gemm, left_operand, right_operand, out, batch)
    return out.reshape(node.shape)
