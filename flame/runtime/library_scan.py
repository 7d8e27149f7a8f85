"""The scan and sort ops on the GPU (semantics: ``flame/ir/ops/scan.py``).

``cumsum``, ``cumprod`` and ``argsort`` are CuPy's routines (a parallel scan; a stable
segmented sort). ``logcumsumexp`` and the running arg-extreme of ``cummax``/``cummin`` have no
CuPy routine: a small kernel walks each row in order, one thread a row, which is linear work
and fast while there are thousands of rows; a long single row is the slow case (a parallel
scan with an associative (value, index) combine would fix it; not written yet).

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
        value_t total = -INFINITY;
        for (offset_t i = 0; i < length; ++i) {{
            const value_t value = in[i];
            if (isnan(value) || isnan(total)) {{
                total = NAN;
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


def _run_rows(kind: str, node, array, out_dtype, *flags):
    import cupy

    dim = node.attr("dim", 0)
    rows, moved_shape = _rows(array, dim if array.ndim else 0)
    out = cupy.empty(rows.shape, dtype=out_dtype)
    if out.size:
        function = _row_kernel(kind, _C_TYPES[rows.dtype], *flags)
        arguments = [rows, out, np.int64(rows.shape[0]), np.int64(rows.shape[1])]
        kernels.launch(function, rows.shape[0], arguments)
    shaped = out.reshape(moved_shape)
    return cupy.moveaxis(shaped, -1, dim) if array.ndim else shaped.reshape(())


@implements("cumextreme_index")
def cumextreme_index(node, arrays):
    import cupy

    (array,) = arrays
    dtype = node.inputs[0].dtype
    wide = _widened(array, dtype.name)
    flags = (bool(node.attr("largest", True)), dtype.is_float)
    return cupy.ascontiguousarray(_run_rows("cumextreme", node, wide, np.int64, *flags))


@implements("logcumsumexp")
def logcumsumexp(node, arrays):
    (array,) = arrays
    dtype_name = node.dtype.name
    wide = _widened(array, dtype_name)
    return _narrowed(_run_rows("logcumsumexp", node, wide, wide.dtype), dtype_name)
