"""``Storage``: the memory behind a realized value, on one backend.

On the CUDA backend ``array`` is a CuPy array (bfloat16 is held as uint16 bits, since CuPy
has no bfloat16); on the reference backend it is a NumPy array. Data handed in from the host
waits in ``host`` and is copied to the GPU the first time a kernel needs it.
"""

from __future__ import annotations

import numpy as np

from flame.ir import dtypes
from flame.runtime.device_errors import raise_pending


class Storage:
    __slots__ = ("backend", "dtype", "array", "host", "_layout", "__weakref__")

    def __init__(self, backend: str, dtype: dtypes.DType, array=None, host=None):
        self.backend = backend
        self.dtype = dtype
        self.array = array
        self.host = host
        self._layout = None

    def layout(self) -> tuple:
        """(strides, aligned): what a kernel's code depends on, computed once."""
        if self._layout is None:
            self._layout = (self.strides(), self.aligned())
        return self._layout

    def device_array(self):
        """The CuPy array, copying host data to the GPU on first use."""
        if self.array is None:
            import cupy

            host = self.host
            if self.dtype is dtypes.bfloat16:
                host = host.view(np.uint16)
            self.array = cupy.asarray(np.ascontiguousarray(host))
        return self.array

    def numpy(self) -> np.ndarray:
        if self.backend == "reference":
            return self.array
        if self.array is None:
            return self.host
        data = self.array.get()  # waits for the stream: a kernel's recorded error is raised
        raise_pending()
        if self.dtype is dtypes.bfloat16:
            data = data.view(self.dtype.numpy)
        return data

    def strides(self) -> tuple[int, ...]:
        """Strides in elements of the array kernels will read."""
        array = self.array if self.array is not None else self.host
        if self.backend == "cuda" and self.array is None:
            return tuple(_contiguous(array.shape))
        return tuple(stride // array.itemsize for stride in array.strides)

    def aligned(self, vector_bytes: int = 16) -> bool:
        if self.backend != "cuda" or self.array is None:
            return True
        return self.array.data.ptr % vector_bytes == 0


class PlannedInput:
    """What a cached plan keeps of one of its inputs: type and layout, never the memory.

    A plan outlives the call that made it (the executor's cache, lazy mode's recorded walks,
    compiled programs), so its graph is built over these stand-ins: deleting a tensor frees
    its memory even though a plan once read it."""

    __slots__ = ("backend", "dtype", "_layout", "__weakref__")
    array = None
    host = None

    def __init__(self, backend: str, dtype: dtypes.DType, layout: tuple):
        self.backend = backend
        self.dtype = dtype
        self._layout = layout

    def layout(self) -> tuple:
        return self._layout

    def strides(self) -> tuple[int, ...]:
        return self._layout[0]

    def aligned(self, vector_bytes: int = 16) -> bool:
        if vector_bytes != 16:
            raise ValueError("a planned input knows its 16-byte alignment only")
        return self._layout[1]

    def device_array(self):
        raise RuntimeError("a plan's input stand-in holds no memory; bind the caller's array")


def storage_of(node) -> Storage:
    """The memory of a realized node (its memo) or of a data leaf (its attribute)."""
    return node.buffer if node.buffer is not None else node.attr("storage")


def _contiguous(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return reversed(strides)
