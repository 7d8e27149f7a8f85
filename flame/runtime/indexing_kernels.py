"""The CUDA kernels behind the indexing ops: one strided *gather* kernel that every gather-like
op uses, one *scatter-add* kernel, an index *check* and a storage conversion kernel. The
gather, scatter and check kernels report an out-of-range index to the host through
``device_errors.py``'s mapped word (arguments ``errors`` and ``site``).

The gather kernel walks the result in order. Per result axis it gets a size, a stride into
the index array and a stride into the source (0 where that axis comes from the index); the
index value found there steps along the source's indexed dim (``dim_stride``). Every
gather-like op is this kernel with different strides (see ``library_indexing.py``), so views
(transposes, broadcasts) are read in place. Elements are moved as raw bits of their size,
so one kernel serves every dtype, bfloat16 included.

Kernels are generated per (rank after merging axes, element size, index type, offset type:
32-bit when every offset fits, which makes the divisions cheaper) and compiled through
FLAME's kernel cache (NVRTC, memory and disk), like the fused kernels.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from flame.runtime.device_errors import REPORT_SOURCE

BLOCK = 256
BLOCKS_PER_SM = 32  # a grid-stride loop; enough blocks in flight to hide memory latency
BITS_TYPE = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}
INDEX_TYPE = {"int32": "int", "int64": "long long"}
INT32_LIMIT = 2**31 - 1

# Storage <-> float conversions, as in templates/prelude.cuh.j2 (no CUDA headers needed).
CONVERSIONS = r"""
__device__ __forceinline__ float flame_load_f16(unsigned short bits) {
    float value;
    asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(bits));
    return value;
}
__device__ __forceinline__ unsigned short flame_store_f16(float value) {
    unsigned short bits;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(value));
    return bits;
}
__device__ __forceinline__ float flame_load_bf16(unsigned short bits) {
    return __uint_as_float(((unsigned int)bits) << 16);
}
__device__ __forceinline__ unsigned short flame_store_bf16(float value) {
    unsigned int raw = __float_as_uint(value);
    if ((raw & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    raw += 0x7fffu + ((raw >> 16) & 1u);
    return (unsigned short)(raw >> 16);
}
__device__ __forceinline__ void flame_atomic_add(float* address, float value) {
    atomicAdd(address, value);
}
__device__ __forceinline__ void flame_atomic_add(double* address, double value) {
    atomicAdd(address, value);
}
__device__ __forceinline__ void flame_atomic_add(int* address, int value) {
    atomicAdd(address, value);
}
__device__ __forceinline__ void flame_atomic_add(long long* address, long long value) {
    atomicAdd((unsigned long long*)address, (unsigned long long)value);  // two's complement
}
"""

LOOP = "for (offset_t flat = (offset_t)blockIdx.x * blockDim.x + threadIdx.x; flat < total;\n"
LOOP += "         flat += (offset_t)gridDim.x * blockDim.x) {"


def collapse(sizes, *stride_lists):
    """``(sizes, stride_lists)`` without size-1 axes and with neighbouring axes merged where
    every stride list steps through them evenly: fewer divisions per element."""
    merged_sizes: list[int] = []
    merged: list[list[int]] = [[] for _ in stride_lists]
    for axis, size in enumerate(sizes):
        if size == 1:
            continue
        if merged_sizes and all(
            m[-1] == s[axis] * size for m, s in zip(merged, stride_lists, strict=True)
        ):
            merged_sizes[-1] *= size
            for target, strides in zip(merged, stride_lists, strict=True):
                target[-1] = strides[axis]
            continue
        merged_sizes.append(size)
        for target, strides in zip(merged, stride_lists, strict=True):
            target.append(strides[axis])
    if not merged_sizes:
        return (1,), tuple((0,) for _ in stride_lists)
    return tuple(merged_sizes), tuple(tuple(m) for m in merged)


def offset_type(total: int, sizes, stride_lists, extra: int = 0) -> str:
    """``int`` when the element count and every offset fit in 32 bits, else ``long long``."""
    largest = max(
        (
            sum((size - 1) * abs(stride) for size, stride in zip(sizes, strides, strict=True))
            for strides in stride_lists
        ),
        default=0,
    )
    # margin: the grid-stride loop steps ``flat`` past ``total`` by up to one grid
    return "int" if max(total + 2**24, largest + extra) <= INT32_LIMIT else "long long"


def _coordinates(rank: int, names: tuple[str, ...]) -> str:
    """C statements that split ``flat`` into per-axis coordinates and sum each name's offset."""
    lines = ["offset_t rest = flat;"]
    lines += [f"offset_t {name}_offset = 0;" for name in names]
    for axis in reversed(range(rank)):
        if axis:
            lines.append(f"const offset_t c{axis} = rest % size{axis}; rest /= size{axis};")
        else:
            lines.append("const offset_t c0 = rest;")
        lines += [f"{name}_offset += c{axis} * {name}_stride{axis};" for name in names]
    return "\n        ".join(lines)


def _axis_params(rank: int, names: tuple[str, ...]) -> str:
    params = []
    for axis in range(rank):
        params.append(f"offset_t size{axis}")
        params += [f"offset_t {name}_stride{axis}" for name in names]
    return ", ".join(params)


def gather_source(name: str, rank: int, item_size: int, index: str, offset: str) -> str:
    data = BITS_TYPE[item_size]
    names = ("index", "source")
    return f"""{REPORT_SOURCE}
typedef {offset} offset_t;
extern "C" __global__ void {name}(
        const {data}* __restrict__ source, const {INDEX_TYPE[index]}* __restrict__ index,
        {data}* __restrict__ out, offset_t total, long long dim_size, offset_t dim_stride,
        int wrap, unsigned long long* errors, unsigned long long site,
        {_axis_params(rank, names)}) {{
    {LOOP}
        {_coordinates(rank, names)}
        const long long given = (long long)index[index_offset];
        const long long position = (wrap && given < 0) ? given + dim_size : given;
        const bool inside = position >= 0 && position < dim_size;
        // out of range: zero bits, never a read outside the source, and the host is told
        if (!inside) flame_report(errors, site, given);
        out[flat] = inside ? source[source_offset + (offset_t)position * dim_stride] : ({data})0;
    }}
}}
"""


# per source dtype: (C storage type, accumulator type, load expression)
SCATTER_TYPES = {
    "float32": ("float", "float", "{}"),
    "float64": ("double", "double", "{}"),
    "float16": ("unsigned short", "float", "flame_load_f16({})"),
    "bfloat16": ("unsigned short", "float", "flame_load_bf16({})"),
    "int32": ("int", "int", "{}"),
    "int64": ("long long", "long long", "{}"),
}


def scatter_add_source(name: str, rank: int, dtype: str, index: str, offset: str) -> str:
    storage, accumulator, load = SCATTER_TYPES[dtype]
    names = ("index", "source", "out")
    value = load.format("source[source_offset]")
    return f"""{CONVERSIONS}{REPORT_SOURCE}
typedef {offset} offset_t;
extern "C" __global__ void {name}(
        const {storage}* __restrict__ source, const {INDEX_TYPE[index]}* __restrict__ index,
        {accumulator}* out, offset_t total, long long dim_size, offset_t dim_stride,
        unsigned long long* errors, unsigned long long site, {_axis_params(rank, names)}) {{
    {LOOP}
        {_coordinates(rank, names)}
        const long long position = (long long)index[index_offset];
        if (position < 0 || position >= dim_size) {{  // out of range: dropped, the host told
            flame_report(errors, site, position);
            continue;
        }}
        flame_atomic_add(out + out_offset + (offset_t)position * dim_stride, {value});
    }}
}}
"""


def check_source(name: str, index: str) -> str:
    """A contiguous copy of an index array; a value outside [0, size) other than ``ignore``
    is reported to the host (``check_index``: nll_loss's and cross_entropy's targets)."""
    return f"""{REPORT_SOURCE}
typedef long long offset_t;
extern "C" __global__ void {name}(const {INDEX_TYPE[index]}* __restrict__ index,
        {INDEX_TYPE[index]}* __restrict__ out, offset_t total, long long size, int has_ignore,
        long long ignore, unsigned long long* errors, unsigned long long site) {{
    {LOOP}
        const long long value = (long long)index[flat];
        if ((value < 0 || value >= size) && !(has_ignore && value == ignore)) {{
            flame_report(errors, site, value);
        }}
        out[flat] = index[flat];
    }}
}}
"""


def convert_source(name: str, source: str, target: str) -> str:
    """Contiguous float32 <-> float16/bfloat16 storage conversion (round to nearest even)."""
    types = {"float32": "float", "float16": "unsigned short", "bfloat16": "unsigned short"}
    if source == "float32":
        value = f"flame_store_{'f16' if target == 'float16' else 'bf16'}(source[flat])"
    else:
        value = f"flame_load_{'f16' if source == 'float16' else 'bf16'}(source[flat])"
    return f"""{CONVERSIONS}
typedef long long offset_t;
extern "C" __global__ void {name}(const {types[source]}* __restrict__ source,
        {types[target]}* __restrict__ out, offset_t total) {{
    {LOOP}
        out[flat] = {value};
    }}
}}
"""


VECTOR_TYPES = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}


def cat_source(name: str, count: int, vector_bytes: int, offset: str) -> str:
    """``cat`` of ``count`` contiguous inputs: the result seen as [outer, width] (width: the
    joined axis times everything inside it), input k as [outer, width_k], all in vectors of
    ``vector_bytes``. Each vector of the result is read from the one input whose columns
    hold it: both sides walk memory in order (one launch for the whole join)."""
    data = VECTOR_TYPES[vector_bytes]
    params = ", ".join(
        f"const {data}* __restrict__ in{k}, offset_t end{k}, offset_t width{k}"
        for k in range(count)
    )
    picks = []
    for k in range(count):
        start = f"end{k - 1}" if k else "0"
        condition = f"if (column < end{k}) " if k < count - 1 else ""
        keyword = "else " if k else ""
        picks.append(f"{keyword}{condition}value = in{k}[row * width{k} + (column - {start})];")
    pick = "\n        ".join(picks)
    return f"""typedef {offset} offset_t;
extern "C" __global__ void {name}({data}* __restrict__ out, offset_t total, offset_t width,
        {params}) {{
    {LOOP}
        const offset_t row = flat / width;
        const offset_t column = flat - row * width;
        {data} value;
        {pick}
        out[flat] = value;
    }}
}}
"""


def copy_source(name: str, rank: int, vector_bytes: int, offset: str) -> str:
    """A strided copy of raw bits (vectors of ``vector_bytes``) between two views: a piece of
    a ``cat`` that is not contiguous, a ``pad``'s interior."""
    data = VECTOR_TYPES[vector_bytes]
    names = ("source", "out")
    return f"""typedef {offset} offset_t;
extern "C" __global__ void {name}(const {data}* __restrict__ source, {data}* __restrict__ out,
        offset_t total, {_axis_params(rank, names)}) {{
    {LOOP}
        {_coordinates(rank, names)}
        out[out_offset] = source[source_offset];
    }}
}}
"""


def strided_copy(source, target) -> None:
    """``target[...] = source`` for two CuPy views of one shape (any strides, one dtype)."""
    item = source.itemsize
    sizes, (source_strides, target_strides) = collapse(
        source.shape,
        [stride // item for stride in source.strides],
        [stride // item for stride in target.strides],
    )
    vector = item
    if source_strides[-1] == 1 and target_strides[-1] == 1:
        for size in (16, 8, 4, 2):
            lanes = size // item
            if size <= item or sizes[-1] % lanes:
                continue
            steps = list(source_strides[:-1]) + list(target_strides[:-1])
            if all(step % lanes == 0 for step in steps) and all(
                array.data.ptr % size == 0 for array in (source, target)
            ):
                vector = size
                break
    lanes = vector // item
    if lanes > 1:  # the innermost axis (stride 1 on both sides) in vectors
        sizes = (*sizes[:-1], sizes[-1] // lanes)
        source_strides = (*(s // lanes for s in source_strides[:-1]), 1)
        target_strides = (*(s // lanes for s in target_strides[:-1]), 1)
    total = math.prod(sizes)
    offset = offset_type(total, sizes, (source_strides, target_strides))
    function = kernel("copy", len(sizes), vector, offset)
    arguments = [source, target, scalar(offset, total)]
    for size, source_stride, target_stride in zip(sizes, source_strides, target_strides):
        arguments += [scalar(offset, size), scalar(offset, source_stride)]
        arguments += [scalar(offset, target_stride)]
    launch(function, total, arguments)


_functions: dict[tuple, object] = {}
_modules: list = []  # a loaded module must outlive its functions
_lock = threading.Lock()


def kernel(kind: str, *key):
    """The loaded CUDA function of ``kind`` (gather, scatter_add, check, convert, cat) for
    ``key``, the generator's arguments after the kernel name."""
    signature = (kind, *key)
    function = _functions.get(signature)
    if function is not None:
        return function
    import cupy

    from flame.runtime.compiler import default_kernel_cache

    name = "flame_" + "_".join(str(part).replace(" ", "") for part in signature)
    generate = {
        "gather": gather_source,
        "scatter_add": scatter_add_source,
        "convert": convert_source,
        "check": check_source,
        "cat": cat_source,
        "copy": copy_source,
    }
    source = generate[kind](name, *key)
    _, cubin = default_kernel_cache().cubin(source, name)
    with _lock:
        if signature not in _functions:
            module = cupy.cuda.function.Module()
            module.load(cubin)
            _modules.append(module)
            _functions[signature] = module.get_function(name)
        return _functions[signature]


def launch(function, total: int, arguments) -> None:
    from flame.runtime.device import device_info

    blocks = max(1, min(-(-total // BLOCK), device_info().multiprocessors * BLOCKS_PER_SM))
    function((blocks,), (BLOCK,), tuple(arguments))


def scalar(offset: str, value: int):
    return np.int32(value) if offset == "int" else np.int64(value)
