"""A planned kernel launch: the kernel, its grid, and where each parameter comes from.

A plan (executor.py) is a list of these and of library calls. Running one does only what
changes from call to call: allocate its outputs, write the buffers' addresses into a
parameter block prepared once, and hand the block to the driver's ``cuLaunchKernel``.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np

from flame.runtime.device import device_info

_CUDA_ERROR_INVALID_CONTEXT = 201  # CUresult: no context current in the calling thread
BLOCKS_PER_SM = 1 << 20  # measured: one vector per thread beats a strided loop (notes/)


@dataclass(frozen=True)
class Launch:
    spec: object  # the KernelSpec (render(spec) gives the source, for the dump)
    function: object
    grid: int
    block: int
    # per parameter: ("out", slot) | ("in", slot) | ("scalar", numpy value)
    args: tuple
    writes: tuple[tuple[int, int], ...]  # (slot, output position) for outputs it allocates
    shapes: tuple  # per written slot: (shape, dtype)
    zeroed: tuple[tuple[int, int], ...] = ()  # (slot, bytes) set to 0 first (atomic sums)

    def __post_init__(self):
        # Prepared for the replay loop: (slot, shape, dtype) per output, and the kernel's
        # parameter blocks, launched through the driver API directly. A block is one ctypes
        # holder per parameter (scalars filled in once, buffer addresses at each launch);
        # a launch takes a block from ``_blocks`` and puts it back after the driver has
        # copied the parameters, so threads launching the same kernel at once each fill a
        # block of their own (list.pop and append are atomic) without a lock.
        allocations = tuple(
            (slot, shape, dtype) for (slot, _), (shape, dtype) in zip(self.writes, self.shapes)
        )  # fmt: skip
        setter = object.__setattr__
        setter(self, "_allocations", allocations)
        setter(self, "_buffer_slots", tuple(v for kind, v in self.args if kind != "scalar"))
        setter(self, "_blocks", [self._new_block()])

    @classmethod
    def plan(cls, lowered, function, slot_of) -> Launch:
        """The launch of a lowered kernel (``lower_group``) loaded as ``function``, its
        values in the slots ``slot_of`` gives them."""
        spec = lowered.spec
        arguments = []
        for arg in spec.params:
            if arg.kind == "out":
                arguments.append(("out", slot_of[id(lowered.outputs[arg.operand])]))
            elif arg.kind == "in":
                arguments.append(("in", slot_of[id(lowered.reads[arg.operand])]))
            else:
                scalar = np.int32 if spec.index_type == "int" else np.int64
                arguments.append(("scalar", scalar(arg.value)))
        if lowered.grid_items:  # the lowering chose the grid (reductions: rows or row groups)
            blocks = max(1, min(lowered.grid_items, 2**31 - 1))
        else:
            trip_count = lowered.numel // spec.vec if spec.vec > 1 else lowered.numel
            cap = device_info().multiprocessors * BLOCKS_PER_SM
            blocks = max(1, min(-(-trip_count // spec.block), cap))
        writes = tuple(
            (slot_of[id(node)], position) for position, node in enumerate(lowered.outputs)
        )
        shapes = tuple((node.shape, _cupy_dtype(node.dtype)) for node in lowered.outputs)
        zeroed = tuple(
            (slot_of[id(node)], node.numel * node.dtype.itemsize)
            for node in (lowered.outputs[position] for position in lowered.zeroed)
        )  # fmt: skip
        return cls(spec, function, blocks, spec.block, tuple(arguments), writes, shapes, zeroed)

    def _new_block(self) -> tuple:
        """(holders of the buffer addresses, the parameter array's address, everything the
        array points to, kept alive with it)."""
        holders, buffers = [], []
        for kind, value in self.args:
            if kind == "scalar":
                holder = (ctypes.c_int32 if value.dtype.itemsize == 4 else ctypes.c_int64)(
                    int(value)
                )
            else:
                holder = ctypes.c_void_p(0)
                buffers.append(holder)
            holders.append(holder)
        block = (ctypes.c_void_p * max(1, len(holders)))(*map(ctypes.addressof, holders))
        return tuple(buffers), ctypes.addressof(block), (holders, block)

    def execute(self, slots: list, stream: int | None = None) -> None:
        ndarray = _ndarray()
        for slot, shape, dtype in self._allocations:
            slots[slot] = ndarray(shape, dtype)
        self.launch_into(slots, stream)

    def allocate(self, slots: list) -> None:
        """Fill this launch's output slots with new buffers (before a CUDA-graph capture)."""
        ndarray = _ndarray()
        for slot, shape, dtype in self._allocations:
            slots[slot] = ndarray(shape, dtype)

    def launch_into(self, slots: list, stream: int | None = None) -> None:
        """Launch on ``stream`` (a pointer; the current stream when None) with the buffers
        already in ``slots``."""
        if stream is None:
            stream = _current_stream().ptr
        if self.zeroed:  # a memset node of a captured CUDA graph, too
            for slot, size in self.zeroed:
                _cupy().cuda.runtime.memsetAsync(slots[slot].data.ptr, 0, size, stream)
        blocks = self._blocks
        try:
            block = blocks.pop()
        except IndexError:  # another thread holds every block: make one more
            block = self._new_block()
        holders, params, _ = block
        for holder, slot in zip(holders, self._buffer_slots):
            holder.value = slots[slot].data.ptr
        arguments = (self.function.ptr, self.grid, 1, 1, self.block, 1, 1, 0, stream, params, 0)
        try:
            _launch_kernel(*arguments)
        except Exception as error:
            if getattr(error, "status", None) != _CUDA_ERROR_INVALID_CONTEXT:
                raise
            # A thread whose first CUDA call is this launch (a replay that recycles its
            # result's memory allocates nothing first): the driver API needs the device's
            # context current in the thread, which the runtime makes on its first call.
            _cupy().cuda.runtime.free(0)
            _launch_kernel(*arguments)
        finally:  # the driver has copied the parameters: the block is free again
            blocks.append(block)


@functools.lru_cache(maxsize=1)
def _cupy():
    import cupy

    return cupy


def _ndarray():
    global _ndarray
    ndarray = _cupy().ndarray
    _ndarray = lambda: ndarray  # noqa: E731  bound on first use, as below
    return ndarray


def _current_stream():
    global _current_stream
    _current_stream = _cupy().cuda.get_current_stream  # bound on first use, as below
    return _current_stream()


def _launch_kernel(*arguments) -> None:
    from cupy_backends.cuda.api.driver import launchKernel

    global _launch_kernel
    _launch_kernel = launchKernel  # bound on first use: importing FLAME never loads CUDA
    launchKernel(*arguments)


def _cupy_dtype(dtype):
    return np.uint16 if dtype.name == "bfloat16" else dtype.numpy
