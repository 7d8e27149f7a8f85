"""Creating tensors: from data, from constants, from random numbers, from other libraries.

Constants and random numbers are lazy leaves: ``fl.zeros(n) + x`` and ``fl.randn(n) * 2``
never write the zeros or the random numbers to memory.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from flame.backend import get_backend
from flame.ir import dtypes
from flame.ir.infer import make_const, make_node
from flame.ir.node import Node, builder_site, user_site
from flame.ir.shapes import normalize_shape
from flame.runtime.storage import Storage
from flame.tensor import Tensor

# NumPy dtypes FLAME has no counterpart for, and what they become (the next signed type
# that holds every value). float64, int8, uint8 and int16 are FLAME dtypes, kept as they are.
_NARROWED = {
    np.dtype(np.uint16): dtypes.int32,
    np.dtype(np.uint32): dtypes.int64,
}


def creation(function):
    """PyTorch's keyword arguments of a creation function: ``device=`` (``"cuda"``, or
    ``"cpu"`` for the reference backend; a ``*_like`` function defaults to its input's) and
    ``requires_grad=``; ``layout=`` and ``pin_memory=`` are accepted for their defaults."""

    @functools.wraps(function)
    def create(*args, device=None, requires_grad=False, layout=None, pin_memory=False, **kwargs):
        if (
            device is None
            and args
            and isinstance(args[0], Tensor)
            and function.__name__.endswith("_like")
        ):
            device = args[0].device
        if device is not None:
            from flame.backend import backend as use_backend
            from flame.devices import device as as_device

            with use_backend(as_device(device).backend):
                result = function(*args, **kwargs)
        else:
            result = function(*args, **kwargs)
        return result.requires_grad_() if requires_grad else result

    return create


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


@creation
def tensor(data, dtype=None) -> Tensor:
    """A tensor holding a copy of ``data`` (array, nested lists or a number)."""
    if isinstance(data, Tensor):
        return data.to(dtype) if dtype is not None else data
    from_numpy_data = isinstance(data, (np.ndarray, np.generic))
    if isinstance(data, (bool, int, float)) and not from_numpy_data and dtype is None:
        dtype = dtypes.scalar_dtype(data)
    array = np.array(data)
    # Python floats give the default float (as torch.tensor); NumPy float64 data stays float64
    if array.dtype == np.float64 and not from_numpy_data and dtype is None:
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


@creation
def full(shape, fill_value, dtype=None) -> Tensor:
    shape = normalize_shape((shape,), "full")
    target = dtypes.dtype(dtype) if dtype is not None else dtypes.scalar_dtype(fill_value)
    site = builder_site()
    node = make_const(fill_value, target, site, round_to_dtype=True)
    if shape:
        node = make_node("expand", (node,), {"shape": shape}, site)
    return Tensor(node, get_backend())


@creation
def zeros(*shape, dtype=dtypes.float32) -> Tensor:
    # ``full`` itself, not its keyword-argument wrapper: one frame less to the user's line
    return full.__wrapped__(normalize_shape(shape, "zeros"), 0, dtype=dtype)


@creation
def ones(*shape, dtype=dtypes.float32) -> Tensor:
    return full(normalize_shape(shape, "ones"), 1, dtype=dtype)


def _generated(op: str, shape, dtype, site, **attrs) -> Tensor:
    node = Node(op, (), tuple(sorted(attrs.items())), dtype, shape, site)
    return Tensor(node, get_backend())


@creation
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


def _random(op, shape, seed, dtype, generator=None) -> Tensor:
    shape = normalize_shape(shape, op)
    target = dtypes.dtype(dtype if dtype is not None else dtypes.float32)
    if not target.is_float:
        raise TypeError(f"{op}: dtype must be a float type, got {target.name}")
    if seed is None:  # the generator's numbers (flame/random.py)
        from flame import random

        draw = random.draw_uniform if op == "rand" else random.draw_normal
        result = draw(shape, generator).to(target)
    else:
        if generator is not None:
            raise TypeError(f"{op}: give seed= or generator=, not both")
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise TypeError(f"{op}: seed must be a non-negative int, got {seed!r}")
        result = _generated(op, shape, target, user_site(), seed=int(seed))
    return result


@creation
def rand(*shape, seed=None, generator=None, dtype=None) -> Tensor:
    """Uniform [0, 1) numbers, generated in the consuming kernel (Philox): from
    ``generator`` (default: the default generator, ``fl.manual_seed``), or keyed by ``seed``."""
    return _random("rand", shape, seed, dtype, generator)


@creation
def randn(*shape, seed=None, generator=None, dtype=None) -> Tensor:
    """Standard normal numbers, generated in the consuming kernel (Philox): from
    ``generator`` (default: the default generator), or keyed by ``seed``."""
    return _random("randn", shape, seed, dtype, generator)


@creation
def randint(low, high=None, size=None, *, generator=None, dtype=None):
    """Integers uniform in [low, high) (``randint(high, size)`` as PyTorch too)."""
    if size is None:
        if high is None or not isinstance(high, (tuple, list)):
            raise TypeError(
                "randint: give size, e.g. randint(low, high, (n,)) or randint(high, (n,))"
            )
        low, high, size = 0, low, high
    elif high is None:
        low, high = 0, low
    low, high = int(low), int(high)
    if high <= low:
        raise ValueError(f"randint: high ({high}) must be greater than low ({low})")
    shape = normalize_shape((size,), "randint")
    target = dtypes.dtype(dtype if dtype is not None else dtypes.int64)
    from flame import random

    bits = random.random_bits(shape, generator, words=2)
    span = high - low
    if span <= 1 << 24:  # one word: bits * span >> 24 is uniform up to 2^-24 relative bias
        value = bits[0] * span // (1 << 24)
    else:  # 48 bits
        value = (bits[0] * (1 << 24) + bits[1]) % span
    value = value + low
    return value.to(target) if target is not dtypes.int64 else value


@creation
def randint_like(other: Tensor, low=0, high=None, *, generator=None, dtype=None) -> Tensor:
    if high is None:
        low, high = 0, low
    return randint(low, high, other.shape, generator=generator, dtype=dtype or other.dtype)


@creation
def randperm(n: int, *, generator=None, dtype=None) -> Tensor:
    """A random permutation of 0..n-1, drawn on the host from the generator (as PyTorch
    does on the CPU); not inside ``flame.compile``."""
    from flame import random

    rng = random.host_rng(generator, int(n), "randperm")
    values = rng.permutation(int(n)).astype(np.int64)
    return tensor(values, dtype=dtype or dtypes.int64)


def multinomial(input: Tensor, num_samples: int, replacement: bool = False, *, generator=None):  # noqa: A002
    """Indices drawn from the rows of ``input`` (non-negative weights), as PyTorch: reads
    the weights (a sync, as PyTorch's), draws on the host from the generator."""
    from flame import random

    weights = np.asarray(input.numpy(), dtype=np.float64)
    if weights.ndim not in (1, 2):
        raise ValueError(f"multinomial: input must be 1-d or 2-d, got {list(weights.shape)}")
    rows = weights.reshape(-1, weights.shape[-1])
    if (rows < 0).any() or not np.isfinite(rows).all() or (rows.sum(-1) <= 0).any():
        raise RuntimeError(
            "multinomial: invalid probability distribution (sum <= 0, inf, nan or < 0)"
        )
    if not replacement and num_samples > rows.shape[-1]:
        raise RuntimeError(
            f"multinomial: cannot sample {num_samples} > {rows.shape[-1]} without replacement"
        )
    rng = random.host_rng(generator, rows.shape[0] * int(num_samples), "multinomial")
    picks = np.stack([
        rng.choice(row.size, size=num_samples, replace=replacement, p=row / row.sum())
        for row in rows
    ]).astype(np.int64)  # fmt: skip
    with_backend = picks.reshape(weights.shape[:-1] + (num_samples,))
    from flame.backend import backend as use_backend

    with use_backend(input.backend):
        return tensor(with_backend)


@creation
def normal(mean=0.0, std=1.0, size=None, *, generator=None, dtype=None) -> Tensor:
    """Normal numbers of ``mean`` and ``std`` (numbers or tensors, broadcast)."""
    shapes = [t.shape for t in (mean, std) if isinstance(t, Tensor)]
    if size is not None:
        shape = normalize_shape((size,), "normal")
    elif shapes:
        from flame.ir.shapes import broadcast_shapes

        shape = broadcast_shapes("normal", *shapes)
    else:
        raise TypeError("normal: with number mean and std, give size=")
    return randn(shape, generator=generator, dtype=dtype) * std + mean


@creation
def empty(*shape, dtype=dtypes.float32) -> Tensor:
    """As ``zeros``: FLAME never hands out uninitialized memory (a lazy constant costs
    nothing until a kernel reads it)."""
    return zeros(*shape, dtype=dtype)


@creation
def empty_like(other: Tensor, dtype=None) -> Tensor:
    return zeros(other.shape, dtype=dtype or other.dtype)


@creation
def zeros_like(other: Tensor, dtype=None) -> Tensor:
    return zeros(other.shape, dtype=dtype or other.dtype)


@creation
def ones_like(other: Tensor, dtype=None) -> Tensor:
    return ones(other.shape, dtype=dtype or other.dtype)


@creation
def full_like(other: Tensor, fill_value, dtype=None) -> Tensor:
    return full(other.shape, fill_value, dtype=dtype or other.dtype)


@creation
def rand_like(other: Tensor, seed=None, dtype=None, *, generator=None):
    return rand(
        other.shape, seed=seed, generator=generator, dtype=dtype or other.dtype
    )  # fmt: skip


@creation
def randn_like(other: Tensor, seed=None, dtype=None, *, generator=None):
    return randn(
        other.shape, seed=seed, generator=generator, dtype=dtype or other.dtype
    )  # fmt: skip


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
        dtype = _flame_dtype_of(np.empty(0, array.dtype))
        if dtype.numpy != array.dtype:
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


def bernoulli(p, seed=None, shape=None, *, generator=None) -> Tensor:
    """1.0 with probability ``p`` (a tensor of probabilities, as ``torch.bernoulli``, or a
    float with ``shape``), else 0.0; generated in the consuming kernel from the generator
    (or ``seed``)."""
    if isinstance(p, Tensor):
        dtype = p.dtype if p.dtype.is_float else dtypes.float32
        return (rand(p.shape, seed=seed, generator=generator, dtype=dtype) < p).to(dtype)
    if shape is None:
        raise TypeError("bernoulli: with a float p, give shape=")
    return (rand(shape, seed=seed, generator=generator) < float(p)).to(dtypes.float32)
