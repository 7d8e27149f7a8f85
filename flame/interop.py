"""A tensor's memory seen from outside: DLPack, the CUDA array interface and its address
(``copy_`` and the other in-place writes live in flame/inplace.py). Attached to ``Tensor``
here, as the view methods are in flame/views.py; all of these realize the tensor first."""

from __future__ import annotations

import numpy as np

from flame.ir import dtypes
from flame.tensor import Tensor


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


Tensor.data_ptr = data_ptr
Tensor.__dlpack__ = __dlpack__
Tensor.__dlpack_device__ = __dlpack_device__
Tensor.__cuda_array_interface__ = property(__cuda_array_interface__)
