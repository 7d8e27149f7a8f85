"""CUDA implementations of the joining ops (flame/ir/ops/joining.py), through CuPy."""

from __future__ import annotations

from flame.runtime.library import implements


@implements("cat")
def cat(node, arrays):
    import cupy

    dim = node.attr("dim")
    if not cupy.cuda.get_current_stream().is_capturing():
        return cupy.ascontiguousarray(cupy.concatenate(arrays, axis=dim))
    # under a CUDA-graph capture (flame/runtime/step_graphs.py): CuPy's concatenate uploads a table
    # of its inputs, which a capture refuses; one copy kernel per input instead
    out = cupy.empty(node.shape, dtype=arrays[0].dtype)
    start = 0
    for array in arrays:
        end = start + array.shape[dim]
        out[(slice(None),) * dim + (slice(start, end),)] = array
        start = end
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
    out = cupy.full(node.shape, value, dtype=array.dtype)
    inside = tuple(slice(low, low + size) for (low, _), size in zip(widths, array.shape))
    out[inside] = array
    return out
