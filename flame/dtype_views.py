"""Dtype conversions of PyTorch's tensor API: ``x.double()`` (and ``byte char short``),
``x.type(dtype)`` and ``x.view(dtype)`` (the bits of ``x`` read as another dtype).

``view(dtype)`` reinterprets memory, so it works on a realized value: ``x`` is realized and
the result is a buffer over the same memory (writes to one are seen through the other, as in
PyTorch). Between dtypes of one size the shape is kept; otherwise, as in PyTorch, the last
axis (which must be contiguous) is scaled by the ratio of the sizes: a ``float32[4, 6]``
viewed as ``int16`` is ``[4, 12]``, viewed as ``float64`` is ``[4, 3]``. It cannot run while
``flame.compile`` traces (the value is not known then).
"""

from __future__ import annotations

from flame.ir import dtypes
from flame.ir.node import Node, user_site
from flame.runtime.storage import Storage
from flame.tensor import Tensor

# PyTorch's legacy type names (``x.type()``), by FLAME dtype name
TYPE_NAMES = {
    "bool": "BoolTensor", "uint8": "ByteTensor", "int8": "CharTensor",
    "int16": "ShortTensor", "int32": "IntTensor", "int64": "LongTensor",
    "float16": "HalfTensor", "bfloat16": "BFloat16Tensor", "float32": "FloatTensor",
    "float64": "DoubleTensor",
}  # fmt: skip
_BY_TYPE_NAME = {name: dtype for dtype, name in TYPE_NAMES.items()}


def double(tensor: Tensor) -> Tensor:
    """``tensor`` as float64 (PyTorch's ``Tensor.double``)."""
    return tensor.to(dtypes.float64)


def byte(tensor: Tensor) -> Tensor:
    """``tensor`` as uint8 (PyTorch's ``Tensor.byte``)."""
    return tensor.to(dtypes.uint8)


def char(tensor: Tensor) -> Tensor:
    """``tensor`` as int8 (PyTorch's ``Tensor.char``)."""
    return tensor.to(dtypes.int8)


def short(tensor: Tensor) -> Tensor:
    """``tensor`` as int16 (PyTorch's ``Tensor.short``)."""
    return tensor.to(dtypes.int16)


def type_(tensor: Tensor, dtype=None):
    """PyTorch's ``Tensor.type``: with no argument the type's name (``'flame.FloatTensor'``,
    ``'flame.cuda.FloatTensor'`` on the GPU); with a dtype (a FLAME, NumPy or PyTorch dtype,
    a name, or a type name such as ``'torch.DoubleTensor'``) the tensor cast to it."""
    if dtype is None:
        device = "cuda." if tensor.backend == "cuda" else ""
        return f"flame.{device}{TYPE_NAMES[tensor.dtype.name]}"
    return tensor.to(resolve_dtype(dtype))


def resolve_dtype(spec) -> dtypes.DType:
    """A dtype from anything ``type`` and ``view`` take, type names included."""
    if isinstance(spec, str):
        name = spec.rsplit(".", 1)[-1]
        if name in _BY_TYPE_NAME:
            return dtypes.dtype(_BY_TYPE_NAME[name])
    return dtypes.dtype(spec)


def is_dtype(argument) -> bool:
    """Whether ``view``'s argument is a dtype (FLAME, NumPy or PyTorch) rather than a size:
    ``views.py``'s ``view`` asks before it reshapes."""
    import numpy as np

    if isinstance(argument, (dtypes.DType, np.dtype)):
        return True
    if isinstance(argument, type) and issubclass(argument, np.generic):
        return True
    return str(argument).startswith("torch.") and hasattr(argument, "is_floating_point")


def viewed_shape(shape: tuple[int, ...], source: dtypes.DType, target: dtypes.DType):
    """The shape of a ``source`` tensor of ``shape`` viewed as ``target`` (PyTorch's rule);
    raises naming the sizes when the bits do not divide."""
    if source.itemsize == target.itemsize:
        return tuple(shape)
    shown = f"{source.name}{list(shape)} as {target.name}"
    if not shape:
        raise RuntimeError(f"view: cannot view a 0-dimensional {shown}: sizes differ")
    last = shape[-1] * source.itemsize
    if last % target.itemsize:
        raise RuntimeError(
            f"view: cannot view {shown}: the last axis holds {last} bytes, not a multiple of "
            f"{target.itemsize}"
        )
    return tuple(shape[:-1]) + (last // target.itemsize,)


def view_dtype(tensor: Tensor, dtype) -> Tensor:
    """The bits of ``tensor`` read as ``dtype`` (PyTorch's ``Tensor.view(dtype)``)."""
    target = resolve_dtype(dtype)
    source = tensor.dtype
    if target is source:
        return tensor
    shape = viewed_shape(tuple(tensor.shape), source, target)
    storage = tensor._storage()
    array = storage.numpy() if storage.backend == "reference" else storage.device_array()
    if array.ndim and source.itemsize != target.itemsize:
        if array.strides[-1] != array.itemsize and array.shape[-1] != 1:
            raise RuntimeError(
                f"view: the last axis of {source.name}{list(tensor.shape)} must be contiguous "
                f"to view it as {target.name}"
            )
    viewed = array.view(_array_dtype(target, storage.backend)).reshape(shape)
    if storage.backend == "reference":
        result = Storage("reference", target, array=viewed)
    else:
        result = Storage("cuda", target, array=viewed)
    node = Node("buffer", (), (("storage", result),), target, shape, user_site())
    return Tensor(node, tensor.backend)


def _array_dtype(dtype: dtypes.DType, backend: str):
    """The array dtype of ``dtype``'s storage on ``backend`` (CuPy holds bfloat16 as uint16)."""
    import numpy as np

    if backend != "reference" and dtype is dtypes.bfloat16:
        return np.dtype(np.uint16)
    return dtype.numpy


for _name, _function in (
    ("double", double), ("byte", byte), ("char", char), ("short", short), ("type", type_),
):  # fmt: skip
    if _name not in Tensor.__dict__:
        setattr(Tensor, _name, _function)

__all__ = [
    "byte", "char", "double", "is_dtype", "resolve_dtype", "short", "type_", "view_dtype",
    "viewed_shape",
]  # fmt: skip
