"""Small host-to-device copies that do not make the host wait for the GPU.

A copy from ordinary (pageable) host memory is synchronous: it starts after the work already
queued on the stream, and the host waits for it. Made every training step -- an optimizer's
per-step values, a multi-tensor kernel's table of addresses -- it makes the host wait for the
forward and backward just launched, and the GPU then idles while the host launches what comes
next. ``StagedUploads`` copies through a ring of page-locked buffers instead, asynchronously on
the current stream; a buffer is written again only once the event recorded after its previous
copy has passed (``slots`` copies later: in practice at once).
"""

from __future__ import annotations

import threading

import numpy as np


class StagedUploads:
    """A ring of page-locked staging buffers; ``put`` returns a new device array."""

    def __init__(self, slots: int = 8):
        self._slots: list[list] = [[None, 0, None] for _ in range(slots)]  # memory, bytes, event
        self._next = 0
        self._lock = threading.Lock()

    @property
    def slots(self) -> int:
        return len(self._slots)

    def put(self, values: np.ndarray, into=None):
        """A new CuPy array on the current device holding ``values`` (any shape and dtype),
        its copy queued on the current stream; with ``into`` (a CuPy array of the same
        shape and dtype), the copy lands there instead and ``into`` is returned."""
        import cupy

        values = np.ascontiguousarray(values)
        nbytes = max(values.nbytes, 1)
        with self._lock:
            slot = self._slots[self._next]
            self._next = (self._next + 1) % len(self._slots)
            if slot[2] is not None:
                slot[2].synchronize()  # the copy that last read this buffer has run
            if slot[1] < nbytes:
                size = max(nbytes, 256)
                slot[0], slot[1] = cupy.cuda.alloc_pinned_memory(size), size
            staged = np.frombuffer(slot[0], dtype=values.dtype, count=values.size)
            staged = staged.reshape(values.shape)
            staged[...] = values
            stream = cupy.cuda.get_current_stream()
            array = cupy.empty(values.shape, dtype=values.dtype) if into is None else into
            array.set(staged, stream=stream)
            slot[2] = stream.record()
        return array
