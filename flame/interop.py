"""A tensor's memory seen from outside: DLPack, the CUDA array interface, its address, and
writing into it in place (``copy_``). Attached to ``Tensor`` here, as the view methods are in
flame/views.py; all of these realize the tensor first."""

from __future__ import annotations

import numpy as np

from flame.ir import dtypes
from flame.ir.node import format_site, user_site
from flame.ir.shapes import ShapeError, broadcast_shapes
from flame.tensor import Tensor


def copy_(self: Tensor, source) -> Tensor:
    """Write ``source`` (broadcast, cast to this dtype) into this tensor's memory in place, as
    PyTorch's ``copy_``: the memory keeps its address, so everything that reads it (a compiled
    function closing over a weight, an optimizer's state) sees the new values without
    retracing."""
    from flame.creation import tensor as make_tensor

    if not isinstance(source, Tensor):
        source = make_tensor(np.asarray(source), dtype=self.dtype)
    if source.backend != self.backend:
        raise ValueError(
            f"copy_: source is on the {source.backend} backend, this tensor on {self.backend}"
        )
    try:
        fits = broadcast_shapes("copy_", source.shape, self.shape) == self.shape
    except ShapeError:
        fits = False
    if not fits:
        raise ShapeError(
            f"copy_: cannot broadcast a source of shape {list(source.shape)} to this tensor's "
            f"shape {list(self.shape)} [at {format_site(user_site())}]"
        )
    storage = self._storage()
    values = source.to(self.dtype)
    if values.shape != self.shape:
        values = values.broadcast_to(self.shape)
    values = values._storage()
    if storage.backend == "reference":
        from flame.foreach import writable_array

        writable_array(storage)[...] = np.asarray(values.numpy()).reshape(self.shape)
    else:
        storage.device_array()[...] = values.device_array().reshape(self.shape)
    return self


def data_ptr(self: Tensor) -> int:
    """The address of this tensor's memory on the GPU (realizes it), as PyTorch's."""
    storage = self._storage()
    if storage.backend != "cuda":
        raise ValueError("data_ptr: a reference-backend tensor lives in NumPy memory")
    return storage.device_array().data.ptr


def __dlpack__(self: Tensor, stream=None, **kwargs):  # noqa: N807 (the protocol's name)
    storage = self._storage()
    if storage.backend == "reference" or storage.array is None:
        return np.ascontiguousarray(storage.numpy()).__dlpack__(**_numpy_dlpack_args(kwargs))
    if self.dtype is dtypes.bfloat16:  # CuPy holds it as uint16: relabel the capsule
        from flame.runtime.dlpack import K_DL_BFLOAT, relabel

        capsule = storage.device_array().__dlpack__(stream=stream, **kwargs)
        return relabel(capsule, K_DL_BFLOAT, 16)
    return storage.device_array().__dlpack__(stream=stream, **kwargs)


def __dlpack_device__(self: Tensor):  # noqa: N807
    if self.backend == "reference":
        return (1, 0)  # kDLCPU
    import cupy

    return (2, cupy.cuda.runtime.getDevice())  # kDLCUDA


def __cuda_array_interface__(self: Tensor):  # noqa: N807
    if self.backend != "cuda":
        raise AttributeError("a reference-backend tensor lives on the CPU")
    if self.dtype is dtypes.bfloat16:
        raise AttributeError(
            "the CUDA array interface has no bfloat16 type; use DLPack (torch.from_dlpack, "
            "jax.dlpack.from_dlpack), which does"
        )
    return self._storage().device_array().__cuda_array_interface__


def _numpy_dlpack_args(kwargs):
    return {key: value for key, value in kwargs.items() if key in ("max_version", "copy")}


Tensor.copy_ = copy_
Tensor.data_ptr = data_ptr
Tensor.__dlpack__ = __dlpack__
Tensor.__dlpack_device__ = __dlpack_device__
Tensor.__cuda_array_interface__ = property(__cuda_array_interface__)
