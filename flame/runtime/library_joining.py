"""CUDA implementations of the joining ops (flame/ir/ops/joining.py), through CuPy."""

from __future__ import annotations

import math

from flame.runtime.library import implements


@implements("cat")
def cat(node, arrays):
    """One FLAME kernel for the whole join where every piece is C-contiguous (CuPy's
    concatenate launches a copy per piece, through its generic strided copy, and uploads a
    table of its inputs, which a CUDA-graph capture refuses); CuPy for the rest."""
    import cupy

    dim = node.attr("dim")
    pieces = [array for array in arrays if array.size]
    if pieces and all(array.flags.c_contiguous for array in pieces):
        return _joined(node, pieces, dim)
    from flame.runtime.indexing_kernels import strided_copy

    out = cupy.empty(node.shape, dtype=arrays[0].dtype)
    start = 0
    for array in arrays:  # a strided copy per piece (no table upload: capturable)
        end = start + array.shape[dim]
        if array.size:
            strided_copy(array, out[(slice(None),) * dim + (slice(start, end),)])
        start = end
    return out


def _joined(node, pieces, dim: int):
    import cupy

    from flame.runtime import indexing_kernels as kernels

    out = cupy.empty(node.shape, dtype=pieces[0].dtype)
    if out.size == 0:
        return out
    outer = math.prod(node.shape[:dim])
    widths = [array.size // outer * array.itemsize for array in pieces]  # bytes a row
    vector = next(
        size for size in (16, 8, 4, 2, 1)
        if size >= min(out.itemsize, 16)
        and all(width % size == 0 for width in widths)
        and all(array.data.ptr % size == 0 for array in (out, *pieces))
    )  # fmt: skip
    total = out.nbytes // vector
    offset = "int" if total + 2**24 <= kernels.INT32_LIMIT else "long long"
    function = kernels.kernel("cat", len(pieces), vector, offset)
    arguments = [out, kernels.scalar(offset, total), kernels.scalar(offset, sum(widths) // vector)]
    end = 0
    for array, width in zip(pieces, widths):
        end += width // vector
        arguments += [array, kernels.scalar(offset, end), kernels.scalar(offset, width // vector)]
    kernels.launch(function, total, arguments)
    return out


@implements("pad")
def pad(node, arrays):
    import cupy

    (array,) = arrays
    widths = node.attr("widths")
    value = node.attr("value")
    if node.dtype.name == "bfloat16":  # bits in uint16: pad with the bits of the value
        import ml_dtypes
        import numpy as np

        value = int(np.array(value, dtype=ml_dtypes.bfloat16).view(np.uint16))
    from flame.runtime.indexing_kernels import strided_copy

    out = cupy.full(node.shape, value, dtype=array.dtype)
    inside = tuple(slice(low, low + size) for (low, _), size in zip(widths, array.shape))
    if array.size:
        strided_copy(array, out[inside])
    return out
