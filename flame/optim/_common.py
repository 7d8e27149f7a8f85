"""What the optimizers share: their state buffers and the per-step scalar buffer."""

from __future__ import annotations

import numpy as np

from flame.ir.dtypes import float32
from flame.tensor import Tensor


def zeros_state(param: Tensor) -> Tensor:
    """A realized buffer of zeros shaped and typed like ``param``, on its backend."""
    from flame.backend import backend
    from flame.creation import zeros

    with backend(param.backend):
        return zeros(param.shape, dtype=param.dtype).realize()


def scalars(values, like: Tensor, uploads: ScalarUploads | None = None) -> Tensor:
    """The per-step values (computed on the host in float64) as a float32 tensor the update
    kernel reads: data, so a new learning rate is never new code. On the GPU, through
    ``uploads`` (the optimizer's own) when given: copied without waiting for the GPU."""
    from flame.backend import backend
    from flame.creation import tensor

    host = np.asarray(values, dtype=np.float32)
    if uploads is not None and like.backend == "cuda":
        array = uploads.put(host)
        if array is not None:
            from flame.replay import wrap
            from flame.runtime.storage import Storage

            return wrap(Storage("cuda", float32, array=array), float32, host.shape, None)
    with backend(like.backend):
        return tensor(host)


class ScalarUploads:
    """Per-step values copied to the GPU without making the host wait for it.

    A copy from ordinary (pageable) host memory is synchronous: it starts after the work
    already queued on the stream -- the forward and backward a training step just launched --
    and the host waits for it, so the GPU then idles while the host launches the update and
    the next step. These values go through a ring of page-locked buffers instead, copied
    asynchronously on the current stream; a buffer is written again only once the event
    recorded after its previous copy has passed (``SLOTS`` steps later: in practice at once).
    One per optimizer, not shared between threads."""

    SLOTS = 8
    CAPACITY = 64  # float32 values per buffer; more go the ordinary way

    def __init__(self):
        self._slots: list[list] = []  # [host view, pinned memory, event or None]
        self._next = 0

    def put(self, values: np.ndarray):
        """A new device array holding ``values``, or None when they do not fit a buffer."""
        if values.size > self.CAPACITY or values.ndim != 1:
            return None
        import cupy

        if len(self._slots) < self.SLOTS:
            memory = cupy.cuda.alloc_pinned_memory(self.CAPACITY * 4)
            view = np.frombuffer(memory, dtype=np.float32, count=self.CAPACITY)
            self._slots.append([view, memory, None])
        slot = self._slots[self._next]
        self._next = (self._next + 1) % self.SLOTS
        if slot[2] is not None:
            slot[2].synchronize()  # that buffer's previous copy has been read
        slot[0][: values.size] = values
        stream = cupy.cuda.get_current_stream()
        array = cupy.empty(values.size, dtype=np.float32)
        array.set(slot[0][: values.size], stream=stream)
        slot[2] = stream.record()
        return array


def in_float32(*tensors: Tensor) -> list[Tensor]:
    """The update rules' operands in float32: the arithmetic of a step runs in float32 and
    its results are rounded once, when they are written back to parameters and state of a
    narrower type (the per-step values are zero-dimensional, so they do not widen a
    float16/bfloat16 parameter by promotion, as in PyTorch)."""
    from flame.ir import dtypes

    return [t if t.dtype is dtypes.float32 else t.to(dtypes.float32) for t in tensors]


def grad_of(param: Tensor) -> Tensor:
    grad = param.grad
    if grad.node.shape == param.node.shape and grad.node.dtype is param.node.dtype:
        return grad
    if grad.shape != param.shape:
        raise ValueError(
            f"optimizer: a gradient of shape {list(grad.shape)} for a parameter of shape "
            f"{list(param.shape)}"
        )
    if grad.dtype != param.dtype:
        grad = grad.to(param.dtype)
    return grad
