"""Files to GPU memory: the cuda path of ``flame.load_file`` (flame/io.py).

The data is read in large chunks into a ring of page-locked buffers, several threads at a
time, and each chunk is copied asynchronously (one ``cudaMemcpyAsync`` per tensor piece, on
the current stream, which FLAME's kernels use) into the tensors' GPU memory while the next
chunk is read. The bytes pass through host memory once (page cache -> page-locked buffer ->
GPU) and nothing stays on the host. ``HOST_READ = "mmap"`` copies from a memory mapping
instead of ``pread`` (bench/weights.py compares the two).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from flame.ir import dtypes

HOST_READ = "pread"  # how the cuda path reads the file: "pread" or "mmap"
CHUNK_BYTES = 32 << 20  # one staging buffer; 4 of them make the ring
_READ_THREADS = min(8, os.cpu_count() or 1)  # one reader cannot keep up with the copy


class WeightsFileError(ValueError):
    """A safetensors file FLAME cannot load; the message names the file and the key."""


# --- saving --------------------------------------------------------------------------------


def read_exactly(descriptor: int, buffer: memoryview, offset: int, path: str) -> None:
    """Fill ``buffer`` from the file at ``offset`` (``pread`` may return less than asked)."""
    done = 0
    while done < len(buffer):
        got = os.preadv(descriptor, [buffer[done:]], offset + done)
        if got == 0:
            raise WeightsFileError(f"load_file: {path}: the file ended at byte {offset + done} "
                                   "while reading (did it change while loading?)")  # fmt: skip
        done += got


class _Staging:
    """A ring of page-locked buffers, kept between loads (allocating them costs more than
    filling them); a buffer is refilled once the copies that read it last have run."""

    def __init__(self, slots: int = 4):
        self.lock = threading.Lock()
        self.buffers: list = [None] * slots
        self.events: list = [None] * slots
        self.pool = ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="flame-load")

    def buffer(self, slot: int, nbytes: int) -> np.ndarray:
        import cupy

        memory = self.buffers[slot]
        if memory is None or memory.size() < nbytes:
            memory = self.buffers[slot] = cupy.cuda.alloc_pinned_memory(nbytes)
        return np.frombuffer(memory, dtype=np.uint8, count=nbytes)


_staging: _Staging | None = None
_staging_lock = threading.Lock()


def _ring() -> _Staging:
    global _staging
    with _staging_lock:
        if _staging is None:
            _staging = _Staging()
        return _staging


def read_to_gpu(path: str, entries: list) -> dict:
    """Every tensor in its own CuPy array (bfloat16 as uint16 bits), copied from page-locked
    chunks of the file on the current stream (FLAME's kernels queued later read them)."""
    import cupy

    arrays = {}
    for entry in entries:
        host = np.dtype(np.uint16) if entry.dtype is dtypes.bfloat16 else entry.dtype.numpy
        arrays[entry.name] = cupy.empty(entry.shape, dtype=host)
    if not entries:
        return arrays
    start, stop = entries[0].begin, entries[-1].end
    ring, stream = _ring(), cupy.cuda.get_current_stream()
    chunk = min(CHUNK_BYTES, max(stop - start, 1))
    with ring.lock, _Source(path) as source:
        first, slot = 0, 0  # the first entry that reaches into the current chunk
        for position in range(start, stop, chunk):
            end = min(position + chunk, stop)
            if ring.events[slot] is not None:
                ring.events[slot].synchronize()
            staged = ring.buffer(slot, chunk)[: end - position]
            source.fill(staged, position, ring.pool)
            while entries[first].end <= position:
                first += 1
            index = first
            while index < len(entries) and entries[index].begin < end:
                entry = entries[index]
                low, high = max(entry.begin, position), min(entry.end, end)
                if high > low:
                    cupy.cuda.runtime.memcpyAsync(
                        arrays[entry.name].data.ptr + (low - entry.begin),
                        staged.ctypes.data + (low - position), high - low,
                        cupy.cuda.runtime.memcpyHostToDevice, stream.ptr,
                    )  # fmt: skip
                index += 1
            ring.events[slot] = stream.record()
            slot = (slot + 1) % len(ring.buffers)
    return arrays


class _Source:
    """The file, read in parallel pieces into a staging buffer (``pread``, or copies from a
    memory mapping when ``HOST_READ == "mmap"``)."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        self.descriptor = os.open(self.path, os.O_RDONLY)
        self.mapping = None
        if HOST_READ == "mmap":
            self.mapping = mmap.mmap(self.descriptor, 0, access=mmap.ACCESS_READ)
            if hasattr(mmap, "MADV_SEQUENTIAL"):
                self.mapping.madvise(mmap.MADV_SEQUENTIAL)
            self.mapped = np.frombuffer(self.mapping, dtype=np.uint8)
        return self

    def __exit__(self, *exc_info):
        if self.mapping is not None:
            del self.mapped
            with contextlib.suppress(BufferError):  # a view kept by a traceback: GC closes it
                self.mapping.close()
        os.close(self.descriptor)

    def fill(self, staged: np.ndarray, offset: int, pool: ThreadPoolExecutor) -> None:
        piece = max(-(-len(staged) // _READ_THREADS), 1 << 20)
        starts = range(0, len(staged), piece)
        jobs = [pool.submit(self._read, staged[at : at + piece], offset + at) for at in starts]
        for job in jobs:
            job.result()

    def _read(self, target: np.ndarray, offset: int) -> None:
        if self.mapping is None:
            read_exactly(self.descriptor, memoryview(target), offset, self.path)
        else:
            if offset + len(target) > len(self.mapped):
                raise WeightsFileError(f"load_file: {self.path}: the file is shorter than its "
                                       "header says (did it change while loading?)")  # fmt: skip
            np.copyto(target, self.mapped[offset : offset + len(target)])
