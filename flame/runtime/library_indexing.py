"""The indexing ops on the GPU (semantics and out-of-range behaviour: ``flame/ir/ops/indexing.py``).

Every gather-like op is the one strided gather kernel of ``indexing_kernels.py`` with its
own per-axis strides, so transposed or broadcast inputs are read where they lie.
``scatter_add`` copies the input into an accumulator and adds with atomics: float32, int32
and int64 accumulate in their own type; float16 and bfloat16 accumulate in float32 and are
rounded once at the end (as the reference does: it lifts them to float32). The order of the
atomic additions varies from run to run, so float results may differ in the last bits.
"""

from __future__ import annotations

import numpy as np

from flame.ir import dtypes
from flame.ir.node import Node
from flame.ir.ops.indexing import take_along_shapes
from flame.runtime import device_errors
from flame.runtime import indexing_kernels as kernels
from flame.runtime.library import implements


def _strides(array) -> list[int]:
    return [stride // array.itemsize for stride in array.strides]


def _reporting(node: Node, size: int, dim=None, message: str | None = None) -> list:
    """The kernel arguments through which an out-of-range index reaches the host."""
    where = "the flattened input" if dim is None else f"dim {dim}"
    message = message or f"{node.op}: index {{value}} is out of bounds for {where} with size {size}"
    code = device_errors.site_code(node.op, message, node.site)
    return [np.uint64(device_errors.word_pointer()), np.uint64(code)]


def run_gather(node, source, index, shape, index_strides, source_strides, dim, wrap=False,
               dim_name=None):  # fmt: skip
    """``out[p] = source[sum(p * source_strides) + index[sum(p * index_strides)] * stride]``
    over the result positions ``p``; ``dim`` is (size, stride) of the indexed source axis,
    ``dim_name`` the user's dim an out-of-range index is reported against."""
    import cupy

    out = cupy.empty(tuple(shape), dtype=source.dtype)
    if out.size == 0:
        return out
    dim_size, dim_stride = dim
    sizes, (index_strides, source_strides) = kernels.collapse(shape, index_strides, source_strides)
    offset = kernels.offset_type(out.size, sizes, (index_strides, source_strides),
                                 extra=max(dim_size - 1, 0) * abs(dim_stride))  # fmt: skip
    function = kernels.kernel("gather", len(sizes), source.itemsize, index.dtype.name, offset)
    arguments = [source, index, out, kernels.scalar(offset, out.size), np.int64(dim_size)]
    arguments += [kernels.scalar(offset, dim_stride), np.int32(wrap)]
    arguments += _reporting(node, dim_size, dim_name)
    for size, index_stride, source_stride in zip(sizes, index_strides, source_strides, strict=True):
        arguments += [
            kernels.scalar(offset, value) for value in (size, index_stride, source_stride)
        ]
    kernels.launch(function, out.size, arguments)
    return out


@implements("gather")
def gather(node: Node, arrays):
    source, index = arrays
    dim = node.attr("dim", 0)
    source_strides = _strides(source)
    dim_stride, source_strides[dim] = source_strides[dim], 0
    return run_gather(node, source, index, node.shape, _strides(index), source_strides,
                      (source.shape[dim], dim_stride), dim_name=dim)  # fmt: skip


@implements("index_select")
def index_select(node: Node, arrays):
    source, index = arrays
    dim = node.attr("dim", 0)
    source_strides = _strides(source)
    dim_stride, source_strides[dim] = source_strides[dim], 0
    index_strides = [0] * len(node.shape)
    index_strides[dim] = _strides(index)[0] if index.ndim else 0
    return run_gather(node, source, index, node.shape, index_strides, source_strides,
                      (source.shape[dim], dim_stride), dim_name=dim)  # fmt: skip


@implements("take_along_dim")
def take_along_dim(node: Node, arrays):
    import cupy

    source, index = arrays
    dim = node.attr("dim")
    if dim is None:
        flat_source, flat_index = source.reshape(-1), index.reshape(-1)
        dim_axis = (flat_source.size, _strides(flat_source)[0] if flat_source.size else 1)
        return run_gather(node, flat_source, flat_index, node.shape, _strides(flat_index),
                          [0], dim_axis)  # fmt: skip
    _, source_shape, index_shape = take_along_shapes(source.shape, index.shape, dim)
    source = cupy.broadcast_to(source, source_shape)  # stride-0 views, no copies
    index = cupy.broadcast_to(index, index_shape)
    source_strides = _strides(source)
    dim_stride, source_strides[dim] = source_strides[dim], 0
    return run_gather(node, source, index, node.shape, _strides(index), source_strides,
                      (source.shape[dim], dim_stride), wrap=True, dim_name=dim)  # fmt: skip


@implements("embedding")
def embedding(node: Node, arrays):
    index, weight = arrays
    row_stride, column_stride = _strides(weight)
    index_strides = _strides(index) + [0]
    source_strides = [0] * index.ndim + [column_stride]
    return run_gather(node, weight, index, node.shape, index_strides, source_strides,
                      (weight.shape[0], row_stride), dim_name=0)  # fmt: skip


@implements("index_tensor")
def index_tensor(node: Node, arrays):
    source, index = arrays
    strides = _strides(source)
    index_strides = _strides(index) + [0] * (source.ndim - 1)
    source_strides = [0] * index.ndim + strides[1:]
    return run_gather(node, source, index, node.shape, index_strides, source_strides,
                      (source.shape[0], strides[0]), wrap=True, dim_name=0)  # fmt: skip


@implements("one_hot")
def one_hot(node: Node, arrays):
    import cupy

    (labels,) = arrays
    classes = node.attr("num_classes", 0)
    message = f"one_hot: class {{value}} is out of range for num_classes={classes}"
    labels = run_check(node, labels, classes, message=message)
    # an out-of-range label matches no class: its row is all zeros
    rows = labels.reshape(-1, 1) == cupy.arange(classes, dtype=labels.dtype)
    return rows.astype(cupy.int64).reshape(node.shape)


def run_check(node: Node, index, size: int, ignore=None, dim=None, message=None):
    """A contiguous copy of the int array ``index``; values outside [0, size) other than
    ``ignore`` are reported to the host (raised at its next read)."""
    import cupy

    out = cupy.empty(index.shape, dtype=index.dtype)
    if out.size:
        index = cupy.ascontiguousarray(index)
        function = kernels.kernel("check", index.dtype.name)
        arguments = [index, out, np.int64(out.size), np.int64(size), np.int32(ignore is not None)]
        arguments.append(np.int64(0 if ignore is None else ignore))
        kernels.launch(function, out.size, arguments + _reporting(node, size, dim, message))
    return out


@implements("check_index")
def check_index(node: Node, arrays):
    (index,) = arrays
    size, ignore = node.attr("size"), node.attr("ignore")
    return run_check(node, index, size, ignore, message=node.attr("message"))


def _convert(array, source: str, target: str):
    """A contiguous copy of ``array`` converted between float32 and float16/bfloat16 storage."""
    import cupy

    array = cupy.ascontiguousarray(array)
    storage = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[target]
    out = cupy.empty(array.shape, dtype=storage)
    if out.size:
        function = kernels.kernel("convert", source, target)
        kernels.launch(function, out.size, [array, out, np.int64(out.size)])
    return out


@implements("scatter_add")
def scatter_add(node: Node, arrays):
    import cupy

    target, index, source = arrays
    dim = node.attr("dim", 0)
    dtype = node.dtype
    narrow = dtype in (dtypes.float16, dtypes.bfloat16)
    if narrow:
        out = _convert(target, dtype.name, "float32")
    else:
        out = cupy.array(target, order="C", copy=True)
    if index.size:
        _scatter(node, out, index, source, dim, dtype.name)
    return _convert(out, "float32", dtype.name) if narrow else out


def _scatter(node: Node, out, index, source, dim: int, dtype_name: str) -> None:
    out_strides = _strides(out)
    dim_size, dim_stride = out.shape[dim], out_strides[dim]
    out_strides[dim] = 0
    stride_lists = (_strides(index), _strides(source), out_strides)
    sizes, stride_lists = kernels.collapse(index.shape, *stride_lists)
    offset = kernels.offset_type(max(index.size, out.size), sizes, stride_lists,
                                 extra=(dim_size - 1) * dim_stride)  # fmt: skip
    function = kernels.kernel("scatter_add", len(sizes), dtype_name, index.dtype.name, offset)
    arguments = [source, index, out, kernels.scalar(offset, index.size), np.int64(dim_size)]
    arguments.append(kernels.scalar(offset, dim_stride))
    arguments += _reporting(node, dim_size, dim)
    for axis, size in enumerate(sizes):
        arguments.append(kernels.scalar(offset, size))
        arguments += [kernels.scalar(offset, strides[axis]) for strides in stride_lists]
    kernels.launch(function, index.size, arguments)


@implements("scatter_extreme")
def scatter_extreme(node: Node, arrays):
    """CuPy's ``maximum.at``/``minimum.at`` (atomic) on a float32 copy of the input; 16-bit
    floats go through float32 and are rounded once; float64, which CuPy's gets wrong there,
    through the NumPy reference on the host (a sync)."""
    import cupy

    target, index, source = arrays
    dim = node.attr("dim", 0)
    largest, include_self = node.attr("largest", True), node.attr("include_self", True)
    dtype = node.dtype
    if dtype is dtypes.float64:  # CuPy's maximum.at gives wrong float64 results on the GPU
        from flame.ir.ops.indexing import _scatter_extreme_ref

        host = _scatter_extreme_ref(
            target.get(), index.get(), source.get(), dim, largest, include_self
        )  # fmt: skip
        return cupy.asarray(host)
    narrow = dtype in (dtypes.float16, dtypes.bfloat16)
    out = _convert(target, dtype.name, "float32") if narrow else cupy.array(target, copy=True)
    values = source[tuple(slice(0, size) for size in index.shape)]
    if narrow:
        values = _convert(cupy.ascontiguousarray(values), dtype.name, "float32")
    if index.size:
        index = run_check(node, index, target.shape[dim], dim=dim)  # maximum.at never checks
        rank = len(index.shape)
        coordinates = tuple(
            index.astype(cupy.int64) if axis == dim else cupy.broadcast_to(
                cupy.arange(size).reshape([size if a == axis else 1 for a in range(rank)]),
                index.shape,
            )
            for axis, size in enumerate(index.shape)
        )  # fmt: skip
        if not include_self:
            out[coordinates] = -cupy.inf if largest else cupy.inf
        (cupy.maximum if largest else cupy.minimum).at(out, coordinates, values)
    return _convert(out, "float32", dtype.name) if narrow else out
