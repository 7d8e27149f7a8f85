"""Creating tensors: from data, from constants, from random numbers, from other libraries.

Constants and random numbers are lazy leaves: ``fl.zeros(n) + x`` and ``fl.randn(n) * 2``
never write the zeros or the random numbers to memory.
"""

from __future__ import annotations

import math
import secrets

import numpy as np

from flame.backend import get_backend
from flame.ir import dtypes
from flame.ir.infer import make_const, make_node
from flame.ir.node import Node, user_site
from flame.ir.shapes import normalize_shape
from flame.runtime.storage import Storage
from flame.tensor import Tensor

# NumPy dtypes FLAME has no counterpart for, and what they become.
_NARROWED = {
    np.dtype(np.float64): dtypes.float32,
    np.dtype(np.int8): dtypes.int32,
    np.dtype(np.int16): dtypes.int32,
    np.dtype(np.uint8): dtypes.int32,
    np.dtype(np.uint16): dtypes.int32,
    np.dtype(np.uint32): dtypes.int64,
}


def _flame_dtype_of(array: np.ndarray) -> dtypes.DType:
    if array.dtype in _NARROWED:
        return _NARROWED[array.dtype]
    try:
        return dtypes.dtype(array.dtype)
    except TypeError:
        raise TypeError(f"tensor: NumPy dtype {array.dtype} has no FLAME dtype") from None


def _buffer(array: np.ndarray, dtype: dtypes.DType, backend_name: str) -> Tensor:
    if backend_name == "reference":
        storage = Storage("reference", dtype, array=array)
    else:
        storage = Storage("cuda", dtype, host=array)
    node = Node("buffer", (), (("storage", storage),), dtype, array.shape, user_site())
    return Tensor(node, backend_name)


def tensor(data, dtype=None) -> Tensor:
    """A tensor holding a copy of ``data`` (array, nested lists or a number)."""
    if isinstance(data, Tensor):
        return data.to(dtype) if dtype is not None else data
    if isinstance(data, (bool, int, float)) and dtype is None:
        dtype = dtypes.scalar_dtype(data)
    array = np.array(data)
    if array.dtype == np.float64 and not isinstance(data, np.ndarray) and dtype is None:
        dtype = dtypes.float32
    target = dtypes.dtype(dtype) if dtype is not None else _flame_dtype_of(array)
    # astype copies into C order and, unlike ascontiguousarray, keeps 0-d arrays 0-d
    return _buffer(array.astype(target.numpy, order="C"), target, get_backend())


def from_numpy(array: np.ndarray) -> Tensor:
    """A tensor over ``array`` (no copy on the reference backend; copied to the GPU when a
    kernel first reads it)."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"from_numpy: expected numpy.ndarray, got {type(array).__name__}")
    target = _flame_dtype_of(array)
    if target.numpy != array.dtype:
        array = array.astype(target.numpy)
    return _buffer(array, target, get_backend())


def full(shape, fill_value, dtype=None) -> Tensor:
    shape = normalize_shape((shape,), "full")
    target = dtypes.dtype(dtype) if dtype is not None else dtypes.scalar_dtype(fill_value)
    site = user_site()
    node = make_const(fill_value, target, site, round_to_dtype=True)
    if shape:
        node = make_node("expand", (node,), {"shape": shape}, site)
    return Tensor(node, get_backend())


def zeros(*shape, dtype=dtypes.float32) -> Tensor:
    return full(normalize_shape(shape, "zeros"), 0, dtype=dtype)


def ones(*shape, dtype=dtypes.float32) -> Tensor:
    return full(normalize_shape(shape, "ones"), 1, dtype=dtype)


def _generated(op: str, shape, dtype, site, **attrs) -> Tensor:
    node = Node(op, (), tuple(sorted(attrs.items())), dtype, shape, site)
    return Tensor(node, get_backend())


def arange(start, end=None, step=1, dtype=None) -> Tensor:
    """``start, start + step, ...`` below ``end`` (PyTorch's rules; ints give int64)."""
    if end is None:
        start, end = 0, start
    if step == 0:
        raise ValueError("arange: step must be nonzero")
    all_ints = all(isinstance(v, (int, np.integer)) for v in (start, end, step))
    target = (
        dtypes.dtype(dtype) if dtype is not None else (dtypes.int64 if all_ints else dtypes.float32)
    )
    count = max(0, math.ceil((end - start) / step))
    return _generated("arange", (count,), target, user_site(), start=start, step=step)


def _random(op, shape, seed, dtype) -> Tensor:
    shape = normalize_shape(shape, op)
    target = dtypes.dtype(dtype)
    if not target.is_float:
        raise TypeError(f"{op}: dtype must be a float type, got {target.name}")
    if seed is None:
        seed = secrets.randbits(63)  # no hidden global generator: say seed= to reproduce
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise TypeError(f"{op}: seed must be a non-negative int, got {seed!r}")
    return _generated(op, shape, target, user_site(), seed=int(seed))


def rand(*shape, seed=None, dtype=dtypes.float32) -> Tensor:
    """Uniform [0, 1) numbers, generated in the consuming kernel (Philox, keyed by seed)."""
    return _random("rand", shape, seed, dtype)


def randn(*shape, seed=None, dtype=dtypes.float32) -> Tensor:
    """Standard normal numbers, generated in the consuming kernel (Philox, keyed by seed)."""
    return _random("randn", shape, seed, dtype)


def zeros_like(other: Tensor, dtype=None) -> Tensor:
    return zeros(other.shape, dtype=dtype or other.dtype)


def ones_like(other: Tensor, dtype=None) -> Tensor:
    return ones(other.shape, dtype=dtype or other.dtype)


def full_like(other: Tensor, fill_value, dtype=None) -> Tensor:
    return full(other.shape, fill_value, dtype=dtype or other.dtype)


def rand_like(other: Tensor, seed=None, dtype=None) -> Tensor:
    return rand(other.shape, seed=seed, dtype=dtype or other.dtype)


def randn_like(other: Tensor, seed=None, dtype=None) -> Tensor:
    return randn(other.shape, seed=seed, dtype=dtype or other.dtype)


def from_dlpack(source) -> Tensor:
    """A tensor over another library's array, without a copy (CUDA arrays stay on the GPU
    and become CUDA-backend tensors; CPU arrays become reference-backend tensors). FLAME
    treats the memory as immutable: do not write to it while FLAME tensors use it."""
    device_type = source.__dlpack_device__()[0] if hasattr(source, "__dlpack_device__") else 1
    site = user_site()
    if device_type == 2 or (device_type != 1 and hasattr(source, "__cuda_array_interface__")):
        array, dtype = _cupy_from_dlpack(source)
        if dtype is not None:  # bfloat16, held as uint16
            storage = Storage("cuda", dtype, array=array)
            node = Node("buffer", (), (("storage", storage),), dtype, array.shape, site)
            return Tensor(node, "cuda")
        dtype = _flame_dtype_of(np.empty(0, array.dtype)) if array.dtype != np.float64 else None
        if dtype is None or dtype.numpy != array.dtype:
            raise TypeError(f"from_dlpack: dtype {array.dtype} is not a FLAME dtype")
        storage = Storage("cuda", dtype, array=array)
        return Tensor(Node("buffer", (), (("storage", storage),), dtype, array.shape, site), "cuda")
    array = np.from_dlpack(source)
    dtype = _flame_dtype_of(array)
    if dtype.numpy != array.dtype:
        raise TypeError(f"from_dlpack: dtype {array.dtype} is not a FLAME dtype")
    storage = Storage("reference", dtype, array=array)
    return Tensor(
        Node("buffer", (), (("storage", storage),), dtype, array.shape, site), "reference"
    )


def _cupy_from_dlpack(source):
    """(CuPy array, None), or (uint16 CuPy array, bfloat16) for a bfloat16 source, which
    CuPy cannot open itself: its capsule is relabelled uint16 first (flame/runtime/dlpack.py)."""
    import cupy

    try:
        return cupy.from_dlpack(source), None
    except Exception as error:  # CuPy's error for an unknown dtype varies between versions
        if not hasattr(source, "__dlpack__"):
            raise
        from flame.runtime.dlpack import (
            K_DL_BFLOAT,
            K_DL_UINT,
            CapsuleSource,
            capsule_dtype,
            relabel,
        )

        stream = cupy.cuda.get_current_stream()
        capsule = source.__dlpack__(stream=stream.ptr or 1)
        if capsule_dtype(capsule) != (K_DL_BFLOAT, 16, 1):
            raise TypeError(f"from_dlpack: {error}") from None
        relabel(capsule, K_DL_UINT, 16)
        wrapped = CapsuleSource(capsule, source.__dlpack_device__())
        return cupy.from_dlpack(wrapped), dtypes.bfloat16


def bernoulli(p, seed=None, shape=None) -> Tensor:
    """1.0 with probability ``p`` (a tensor of probabilities, or a float with ``shape``),
    else 0.0; generated in the consuming kernel from ``seed``."""
    if isinstance(p, Tensor):
        return (
            rand(p.shape, seed=seed, dtype=p.dtype if p.dtype.is_float else dtypes.float32) < p
        ).to(p.dtype if p.dtype.is_float else dtypes.float32)
    if shape is None:
        raise TypeError("bernoulli: with a float p, give shape=")
    return (rand(shape, seed=seed) < float(p)).to(dtypes.float32)
