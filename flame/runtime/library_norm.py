"""CUDA implementation of ``global_norm`` (flame/ir/ops/multi_tensor.py): two launches for any
number of tensors of any float dtypes.

1. ``flame_mt_norm_<kind>_partials``: one block per chunk of ``CHUNK`` elements of one
   tensor (a table of per-tensor addresses, lengths, dtypes and alignment, and a table of
   chunks, as the multi-tensor elementwise kernels have); each block writes the float32
   sum of ``|x|^p`` (or ``max |x|``) over its chunk.
2. ``flame_mt_norm_<kind>_finish``: one block combines the partial results in a fixed order
   (the result does not depend on timing) and takes the root.

A tensor is read as one block of memory when its view covers one (any order of its axes:
a transposed gradient needs no copy, the order of the terms of a sum does not matter);
otherwise (a broadcast, a slice with gaps) a contiguous copy is read. The chunk table
depends only on the lengths and is kept on the GPU per set of lengths; the address table is
copied at each call through page-locked staging buffers (no wait for the GPU). Under a
CUDA-graph capture (flame/runtime/step_graphs.py) both are copied from page-locked memory of
their own, kept for the process, which the graph reads again at each replay.
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np

from flame.codegen.multi_tensor import (
    CHUNK,
    NORM_BLOCK,
    NORM_DTYPE_CODES,
    NORM_FINISH_BLOCK,
    NORM_WIDTH,
    lower_global_norm,
    norm_kind,
)
from flame.codegen.render import render, spec_key
from flame.runtime.library import implements
from flame.runtime.staging import StagedUploads

CHUNK_TABLES = 64  # chunk tables kept on the GPU (per set of tensor lengths)

_lock = threading.Lock()
_functions: dict[tuple, tuple] = {}  # (id(executor), kind) -> (partials, finish) functions
_chunk_tables: dict[tuple, object] = {}  # lengths -> device chunk table
_captured: dict[bytes, tuple] = {}  # table bytes -> (device array, pinned host) for graphs
_uploads = StagedUploads()


def kernels(kind: str):
    """The (partials, finish) functions of a norm kind, compiled once per executor."""
    from flame.runtime.executor import default_executor

    executor = default_executor()
    key = (id(executor), kind)
    found = _functions.get(key)
    if found is None:
        specs = [lower_global_norm(kind, stage) for stage in ("partials", "finish")]
        sources = [(functools.partial(render, spec), spec.name, spec_key(spec)) for spec in specs]
        found = tuple(executor._load(sources))
        with _lock:
            _functions[key] = found
    return found


def dense_extent(array) -> int | None:
    """The address of the first element when ``array``'s elements fill one block of memory
    each once (contiguous in some order of its axes), else None."""
    if array.size == 0 or array.flags.c_contiguous:
        return array.data.ptr
    axes = sorted((stride, size) for stride, size in zip(array.strides, array.shape) if size != 1)
    expected = array.itemsize
    for stride, size in axes:
        if stride != expected:
            return None
        expected *= size
    return array.data.ptr


def _table(node, arrays, held: list) -> np.ndarray:
    table = np.empty((len(arrays), NORM_WIDTH), dtype=np.int64)
    for row, (child, array) in enumerate(zip(node.inputs, arrays)):
        address = dense_extent(array)
        if address is None:  # a broadcast or a slice with gaps: read a copy
            import cupy

            array = cupy.ascontiguousarray(array)
            held.append(array)  # alive until the launch is queued
            address = array.data.ptr
        table[row] = (address, array.size, NORM_DTYPE_CODES[child.dtype.name], address % 16 == 0)
    return table


def _chunks(lengths: tuple, capturing: bool):
    """The device table of chunks (tensor, first element) for ``lengths``; None when every
    tensor is empty."""
    device = None if capturing else _chunk_tables.get(lengths)
    if device is not None:
        return device
    rows = [
        (tensor, start)
        for tensor, length in enumerate(lengths)
        for start in range(0, length, CHUNK)
    ]  # fmt: skip
    if not rows:
        return None
    host = np.asarray(rows, dtype=np.int64)
    if capturing:
        return _captured_copy(host)
    import cupy

    device = cupy.asarray(host)
    with _lock:
        if len(_chunk_tables) >= CHUNK_TABLES:
            _chunk_tables.pop(next(iter(_chunk_tables)))
        _chunk_tables[lengths] = device
    return device


def _captured_copy(values: np.ndarray):
    """``values`` on the GPU under a capture: copied from page-locked memory of its own that
    the graph reads at each replay, kept for the process (one per distinct table)."""
    import cupy

    key = values.tobytes()
    found = _captured.get(key)
    if found is None:
        stream = cupy.cuda.get_current_stream()
        host = cupy.cuda.alloc_pinned_memory(values.nbytes)
        np.frombuffer(host, dtype=values.dtype, count=values.size)[...] = values.ravel()
        memory = cupy.get_default_memory_pool().malloc(values.nbytes)  # not the graph's
        device = cupy.ndarray(values.shape, values.dtype, memptr=memory)
        cupy.cuda.runtime.memcpyAsync(
            device.data.ptr, host.ptr, values.nbytes,
            cupy.cuda.runtime.memcpyHostToDevice, stream.ptr,
        )  # fmt: skip
        with _lock:
            found = _captured.setdefault(key, (device, host))
    return found[0]


@implements("global_norm")
def global_norm(node, arrays):
    import cupy

    p = float(node.attr("p"))
    partials_kernel, finish_kernel = kernels(norm_kind(p))
    capturing = cupy.cuda.get_current_stream().is_capturing()
    held: list = []
    table = _table(node, arrays, held)
    chunks = _chunks(tuple(int(length) for length in table[:, 1]), capturing)
    count = 0 if chunks is None else int(chunks.shape[0])
    partials = cupy.empty(count, dtype=np.float32)
    out = cupy.empty((), dtype=np.float32)
    finite = math.isfinite(p)
    if count:
        device_table = _captured_copy(table) if capturing else _uploads.put(table)
        arguments = [device_table, chunks, partials, np.float32(p if finite else 0.0)]
        partials_kernel((count,), (NORM_BLOCK,), arguments)
    inverse = np.float32(1.0 / p if finite else 0.0)
    finish_kernel((1,), (NORM_FINISH_BLOCK,), [partials, np.int32(count), inverse, out])
    del held  # the copies' memory returns to the pool; later users are ordered on the stream
    return out
