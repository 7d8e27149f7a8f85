"""The scan and sort ops on the GPU (semantics: ``flame/ir/ops/scan.py``).

``cumsum``, ``cumprod`` and ``argsort`` are CuPy's routines (a parallel scan; a stable
segmented sort). ``logcumsumexp`` and the running arg-extreme of ``cummax``/``cummin`` have no
CuPy routine: a small kernel walks each row in order, one thread a row (linear work); long
rows, too few to fill the GPU, are cut into blocks first (see ``_scan_rows``).

float16 and bfloat16 (uint16 bits here) are computed in float32 and rounded once at the end,
as the reference computes them.
"""

from __future__ import annotations

import threading

import numpy as np

from flame.ir.ops.scan import stable_argsort
from flame.runtime import indexing_kernels as kernels
from flame.runtime.library import implements
from flame.runtime.library_indexing import _convert

NARROW = ("float16", "bfloat16")


def _widened(array, dtype_name: str):
    """``array`` in float32 where FLAME stores it narrower; anything else as it is."""
    if dtype_name == "float16":
        return array.astype(np.float32)
    if dtype_name == "bfloat16":
        return _convert(array, "bfloat16", "float32")
    return array


def _narrowed(array, dtype_name: str):
    import cupy

    if dtype_name == "float16":
        return cupy.ascontiguousarray(array.astype(np.float16))
    if dtype_name == "bfloat16":
        return _convert(array, "float32", "bfloat16")
    return cupy.ascontiguousarray(array)


def _cupy_scan(node, arrays, routine_name: str):
    import cupy

    (array,) = arrays
    dtype_name = node.inputs[0].dtype.name
    wide = _widened(array, dtype_name)
    if wide.ndim == 0:
        return _narrowed(wide.copy(), dtype_name)
    routine = getattr(cupy, routine_name)
    return _narrowed(routine(wide, axis=node.attr("dim", 0)), dtype_name)


@implements("cumsum")
def cumsum(node, arrays):
    return _cupy_scan(node, arrays, "cumsum")


@implements("cumprod")
def cumprod(node, arrays):
    return _cupy_scan(node, arrays, "cumprod")


@implements("argsort")
def argsort(node, arrays):
    import cupy

    (array,) = arrays
    dtype_name = node.inputs[0].dtype.name
    wide = _widened(array, dtype_name)
    if wide.dtype == np.bool_:
        wide = wide.astype(np.uint8)
    order = stable_argsort(wide, node.attr("dim", 0), node.attr("descending", False), xp=cupy)
    return cupy.ascontiguousarray(order)


# --- row kernels ------------------------------------------------------------------------------

_ROW_LOOP = """
    const offset_t stride = (offset_t)gridDim.x * blockDim.x;
    for (offset_t row = (offset_t)blockIdx.x * blockDim.x + threadIdx.x; row < rows;
         row += stride) {
        const value_t* in = source + row * length;
"""


def _extreme_source(name: str, value_type: str, largest: bool, is_float: bool) -> str:
    compare = ">=" if largest else "<="
    # PyTorch's rule: a NaN replaces the extreme, and then nothing replaces the NaN
    better = (
        f"isnan(value) || (value {compare} best && !isnan(best))"
        if is_float
        else f"value {compare} best"
    )
    return f"""
typedef long long offset_t;
typedef {value_type} value_t;
extern "C" __global__ void {name}(const value_t* __restrict__ source,
        long long* __restrict__ out, offset_t rows, offset_t length) {{
    {_ROW_LOOP}
        long long* written = out + row * length;
        value_t best = in[0];
        long long best_index = 0;
        for (offset_t i = 0; i < length; ++i) {{
            const value_t value = in[i];
            if ({better}) {{ best = value; best_index = i; }}
            written[i] = best_index;
        }}
    }}
}}
"""


def _logcumsumexp_source(name: str, value_type: str) -> str:
    return f"""
typedef long long offset_t;
typedef {value_type} value_t;
extern "C" __global__ void {name}(const value_t* __restrict__ source,
        value_t* __restrict__ out, offset_t rows, offset_t length) {{
    {_ROW_LOOP}
        value_t* written = out + row * length;
        // NVRTC has no math.h: infinity from its bits (a float infinity widens to double's)
        const value_t infinity = (value_t)__int_as_float(0x7f800000);
        value_t total = -infinity;
        for (offset_t i = 0; i < length; ++i) {{
            const value_t value = in[i];
            if (isnan(value) || isnan(total)) {{
                total = infinity - infinity;  // NaN
            }} else if (value != total) {{  // log(e^a + e^b) = max + log1p(e^-|a - b|)
                const value_t high = value > total ? value : total;
                total = high + log1p(exp(-fabs(total - value)));
            }} else if (!isinf(total)) {{
                total = total + (value_t)0.69314718055994530942;  // equal: + log 2
            }}
            written[i] = total;
        }}
    }}
}}
"""


_functions: dict[tuple, object] = {}
_modules: list = []  # a loaded module must outlive its functions
_lock = threading.Lock()


def _row_kernel(kind: str, value_type: str, *flags):
    key = (kind, value_type, *flags)
    function = _functions.get(key)
    if function is not None:
        return function
    import cupy

    from flame.runtime.compiler import default_kernel_cache

    name = "flame_" + "_".join(str(part).replace(" ", "_") for part in key)
    if kind == "cumextreme":
        source = _extreme_source(name, value_type, *flags)
    else:
        source = _logcumsumexp_source(name, value_type)
    _, cubin = default_kernel_cache().cubin(source, name)
    with _lock:
        if key not in _functions:
            module = cupy.cuda.function.Module()
            module.load(cubin)
            _modules.append(module)
            _functions[key] = module.get_function(name)
        return _functions[key]


_C_TYPES = {
    np.dtype(np.float32): "float", np.dtype(np.float64): "double",
    np.dtype(np.int32): "int", np.dtype(np.int64): "long long",
    np.dtype(np.uint8): "unsigned char", np.dtype(np.int8): "signed char",
    np.dtype(np.int16): "short", np.dtype(np.bool_): "bool",
}  # fmt: skip


def _rows(array, dim: int):
    """``array`` with ``dim`` moved last, as contiguous [rows, length] (and its moved shape)."""
    import cupy

    moved = cupy.ascontiguousarray(cupy.moveaxis(array, dim, -1))
    length = moved.shape[-1] if moved.ndim else 1
    return moved.reshape(-1, length), moved.shape


# A row kernel runs one thread a row: enough rows fill the GPU, a few long ones would leave it
# idle. Rows longer than BLOCKED_FROM with fewer than ENOUGH_ROWS of them are cut into blocks
# (more rows), scanned, and the blocks' running totals are scanned in turn (recursively) and
# combined with each block: O(n) work in three passes instead of one thread walking n.
ENOUGH_ROWS = 16384
BLOCKED_FROM = 2048
SMALLEST_BLOCK = 64


def _direct(kind: str, rows, flags):
    import cupy

    out_dtype = np.int64 if kind == "cumextreme" else rows.dtype
    out = cupy.empty(rows.shape, dtype=out_dtype)
    if out.size:
        function = _row_kernel(kind, _C_TYPES[rows.dtype], *flags)
        arguments = [rows, out, np.int64(rows.shape[0]), np.int64(rows.shape[1])]
        kernels.launch(function, rows.shape[0], arguments)
    return out


def _filler(kind: str, dtype, flags):
    """A value that changes no scan it is appended to (padding of the last block)."""
    largest = kind == "logcumsumexp" or flags[0]
    if np.dtype(dtype).kind == "f":
        return -np.inf if largest else np.inf
    limits = np.iinfo(dtype)
    return limits.min if largest else limits.max


def _scan_rows(kind: str, rows, flags):
    """The scan of every row of the contiguous [rows, length] array ``rows``."""
    import cupy

    count, length = rows.shape
    if length <= BLOCKED_FROM or count >= ENOUGH_ROWS or count == 0:
        return _direct(kind, rows, flags)
    block = max(SMALLEST_BLOCK, -(-length // (ENOUGH_ROWS // count)))
    blocks_per_row = -(-length // block)
    padded = cupy.full((count, blocks_per_row * block), _filler(kind, rows.dtype, flags),
                       dtype=rows.dtype)  # fmt: skip
    padded[:, :length] = rows
    blocks = padded.reshape(count * blocks_per_row, block)
    local = _direct(kind, blocks, flags)
    if kind == "logcumsumexp":
        combined = _combine_logcumsumexp(local, count, blocks_per_row, flags)
    else:
        combined = _combine_extreme(blocks, local, count, blocks_per_row, flags)
    return cupy.ascontiguousarray(combined.reshape(count, -1)[:, :length])


def _combine_logcumsumexp(local, count, blocks_per_row, flags):
    import cupy

    totals = cupy.ascontiguousarray(local[:, -1].reshape(count, blocks_per_row))
    running = _scan_rows("logcumsumexp", totals, flags)
    before = cupy.full((count, blocks_per_row), -np.inf, dtype=local.dtype)
    before[:, 1:] = running[:, :-1]  # what the earlier blocks add up to
    return cupy.logaddexp(before.reshape(-1, 1), local)


def _combine_extreme(blocks, local, count, blocks_per_row, flags):
    """Each element's running extreme: its block's, unless the earlier blocks' beats it by
    the rule of the row kernel (ties and NaN: the later one; a NaN stays until a later one)."""
    import cupy

    largest, is_float = flags
    block = blocks.shape[1]
    offsets = (cupy.arange(blocks_per_row, dtype=np.int64) * block).reshape(1, -1, 1)
    local_index = local.reshape(count, blocks_per_row, block) + offsets
    local_value = cupy.take_along_axis(blocks, local, 1).reshape(count, blocks_per_row, block)
    total_value = cupy.ascontiguousarray(local_value[:, :, -1])
    best_block = _scan_rows("cumextreme", total_value, flags)
    best_value = cupy.take_along_axis(total_value, best_block, 1)
    best_index = cupy.take_along_axis(local_index[:, :, -1], best_block, 1)
    earlier_value = cupy.empty_like(best_value)
    earlier_value[:, 1:] = best_value[:, :-1]
    earlier_value[:, :1] = best_value[:, :1]  # unused: the first block takes its own
    earlier_index = cupy.zeros_like(best_index)
    earlier_index[:, 1:] = best_index[:, :-1]
    earlier = earlier_value[:, :, None]
    better = local_value >= earlier if largest else local_value <= earlier
    if is_float:
        better = cupy.isnan(local_value) | (better & ~cupy.isnan(earlier))
    better[:, 0, :] = True
    return cupy.where(better, local_index, earlier_index[:, :, None])


def _run_rows(kind: str, node, array, *flags):
    import cupy

    dim = node.attr("dim", 0)
    rows, moved_shape = _rows(array, dim if array.ndim else 0)
    shaped = _scan_rows(kind, rows, flags).reshape(moved_shape)
    return cupy.moveaxis(shaped, -1, dim) if array.ndim else shaped.reshape(())


@implements("cumextreme_index")
def cumextreme_index(node, arrays):
    import cupy

    (array,) = arrays
    dtype = node.inputs[0].dtype
    wide = _widened(array, dtype.name)
    flags = (bool(node.attr("largest", True)), dtype.is_float)
    if wide.dtype == np.bool_:
        wide = wide.astype(np.uint8)  # the padding of long rows needs an ordered type
    return cupy.ascontiguousarray(_run_rows("cumextreme", node, wide, *flags))


@implements("logcumsumexp")
def logcumsumexp(node, arrays):
    (array,) = arrays
    dtype_name = node.dtype.name
    wide = _widened(array, dtype_name)
    return _narrowed(_run_rows("logcumsumexp", node, wide), dtype_name)
