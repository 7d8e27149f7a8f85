"""A planned kernel launch: the kernel, its grid, and where each parameter comes from.

A plan (executor.py) is a list of these and of library calls. Running one does only what
changes from call to call: allocate its outputs, pack the buffers' addresses (and the
scalars) into a parameter buffer prepared once, and hand it to the driver's
``cuLaunchKernel`` as one packed buffer (``CU_LAUNCH_PARAM_BUFFER_POINTER``): one
``struct.pack_into`` call per launch, generated for the launch's parameters, instead of a
ctypes holder set per parameter.
"""

from __future__ import annotations

import ctypes
import functools
import math
import operator
import struct
import threading

import numpy as np

from flame.records import Record
from flame.runtime.device import device_info

_CUDA_ERROR_INVALID_CONTEXT = 201  # CUresult: no context current in the calling thread
# cuLaunchKernel's ``extra`` keys (cuda.h): the packed buffer's address, its size, the end
_PARAM_END, _PARAM_BUFFER_POINTER, _PARAM_BUFFER_SIZE = 0, 1, 2
BLOCKS_PER_SM = 1 << 20  # measured: one vector per thread beats a strided loop (notes/)


class Launch(Record, frozen=True):
    """One kernel launch of a plan: the compiled function, its launch shape, and per parameter
    the slot or scalar it takes."""

    spec: object  # the KernelSpec (render(spec) gives the source, for the dump)
    function: object
    grid: int
    block: int
    # per parameter: ("out", slot) | ("in", slot) | ("scalar", numpy value)
    args: tuple
    writes: tuple[tuple[int, int], ...]  # (slot, output position) for outputs it allocates
    shapes: tuple  # per written slot: (shape, dtype)
    zeroed: tuple[tuple[int, int], ...] = ()  # (slot, bytes) set to 0 first (atomic sums)
    shared_bytes: int = 0  # dynamic shared memory a block needs (a row held there)

    def __post_init__(self):
        # Prepared for the replay loop: (slot, shape, dtype) per output, and the kernel's
        # packed parameter buffers. A launch takes a buffer from ``_blocks`` and puts it back
        # after the driver has copied the parameters, so threads launching the same kernel
        # at once each fill a buffer of their own (list.pop and append are atomic) without a
        # lock.
        allocations = tuple(
            (slot, shape, dtype) for (slot, _), (shape, dtype) in zip(self.writes, self.shapes)
        )  # fmt: skip
        setter = object.__setattr__
        setter(self, "_allocations", allocations)
        codes = param_codes(self.args)
        values = tuple(_python_number(value) for _, value in self.args)  # slots and scalars
        packer, make_filler = _packing(codes)
        setter(self, "_params", (codes, values))
        setter(self, "_packer", packer)
        setter(self, "_fill", make_filler(*values))
        setter(self, "_blocks", [self._new_block()])
        if self.shared_bytes > DEFAULT_SHARED_LIMIT and self.function is not None:
            allow_shared(self.function, self.shared_bytes)

    def launch_source(self, slot_names: dict) -> tuple[list[str], dict] | None:
        """``launch_into`` as lines of a generated function's body, and the names they use:
        the arrays are the locals ``slot_names`` names per slot, ``stream`` the local holding
        the stream's pointer. For the straight-line runners of flame/runtime/direct.py. None
        for a launch that reads a slot ``slot_names`` lacks or needs zeroed memory first."""
        codes, values = self._params
        if self.zeroed or any(c == "Q" and v not in slot_names for c, v in zip(codes, values)):
            return None
        lines = [
            "    try:",
            "        block = launch_blocks.pop()",
            "    except IndexError:",
            "        block = the_launch._new_block()",
            "    try:",
            f"        launch_pack(block[0], 0, {_param_list(codes, values, slot_names.get)})",
            "        launch_kernel(launch_function, launch_grid, 1, 1, launch_threads, 1, 1,",
            "                      launch_shared,",
            "                      stream, 0, block[1])",
            "    except Exception as error:",
            "        the_launch.relaunch(error, stream, block[1])",
            "    finally:  # the driver has copied the parameters: the buffer is free again",
            "        launch_blocks.append(block)",
        ]  # fmt: skip
        from cupy_backends.cuda.api.driver import launchKernel

        names = {
            "the_launch": self, "launch_blocks": self._blocks,
            "launch_pack": self._packer.pack_into, "launch_kernel": launchKernel,
            "launch_function": self.function.ptr, "launch_grid": self.grid,
            "launch_threads": self.block, "launch_shared": self.shared_bytes,
        }  # fmt: skip
        return lines, names

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
            elif arg.kind == "value":  # a constant derived from sizes (1/n of a mean)
                number = np.float64 if arg.ctype == "double" else np.float32
                arguments.append(("scalar", number(arg.value)))
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
        threads = lowered.threads or spec.block  # at most spec.block (__launch_bounds__)
        shared = getattr(lowered, "shared_bytes", 0)
        return cls(spec, function, blocks, threads, tuple(arguments), writes, shapes, zeroed,
                   shared)  # fmt: skip

    def _new_block(self) -> tuple:
        """(the parameter buffer, the address of the ``extra`` array pointing at it, what
        that array points to, kept alive with it)."""
        size = self._packer.size
        buffer = ctypes.create_string_buffer(max(size, 1))
        length = ctypes.c_size_t(size)
        extra = (ctypes.c_void_p * 5)(
            _PARAM_BUFFER_POINTER, ctypes.addressof(buffer),
            _PARAM_BUFFER_SIZE, ctypes.addressof(length), _PARAM_END,
        )  # fmt: skip
        return buffer, ctypes.addressof(extra) if size else 0, (length, extra)

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
        except IndexError:  # another thread holds every buffer: make one more
            block = self._new_block()
        try:
            self._fill(block[0], slots)
            _launch_kernel(self.function.ptr, self.grid, 1, 1, self.block, 1, 1,
                           self.shared_bytes, stream, 0, block[1])  # fmt: skip
        except Exception as error:
            self.relaunch(error, stream, block[1])
        finally:  # the driver has copied the parameters: the buffer is free again
            blocks.append(block)

    def relaunch(self, error: Exception, stream: int, extra: int) -> None:
        """After a failed launch: launch again if the thread only lacked a current context,
        else raise ``error``. A thread whose first CUDA call is a launch (a replay that
        recycles its result's memory allocates nothing first) has no context current for the
        driver API; the runtime makes the device's context current on its first call."""
        if getattr(error, "status", None) != _CUDA_ERROR_INVALID_CONTEXT:
            raise error
        _cupy().cuda.runtime.free(0)
        _launch_kernel(self.function.ptr, self.grid, 1, 1, self.block, 1, 1, self.shared_bytes,
                       stream, 0, extra)  # fmt: skip


DEFAULT_SHARED_LIMIT = 48 * 1024  # above it a function must ask for dynamic shared memory


def allow_shared(function, size: int) -> None:
    """Let ``function`` launch with ``size`` bytes of dynamic shared memory (the attribute
    is the function's: the largest size asked for so far stays)."""
    from cupy_backends.cuda.api import driver

    attribute = driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    with _shared_lock:
        if _shared_allowed.get(function.ptr, 0) < size:
            driver.funcSetAttribute(function.ptr, attribute, size)
            _shared_allowed[function.ptr] = size


_shared_allowed: dict[int, int] = {}
_shared_lock = threading.Lock()


def param_codes(args) -> str:
    """One ``struct`` code per kernel parameter: ``Q`` a buffer's address, ``i`` / ``q`` an
    int32 / int64 scalar, ``f`` / ``d`` a float / double one."""
    return "".join(
        _SCALAR_CODES[value.dtype.char] if kind == "scalar" else "Q" for kind, value in args
    )


_SCALAR_CODES = {"i": "i", "l": "q", "q": "q", "f": "f", "d": "d"}  # numpy's char -> struct's


def _python_number(value):
    """A slot (int) or scalar as the Python number ``struct`` packs: ``repr`` of a float
    round-trips, so the generated packers spell it exactly."""
    return float(value) if isinstance(value, (float, np.floating)) else int(value)


def param_format(codes: str) -> str:
    """The ``struct`` format of packed kernel parameters: each at an offset aligned to its
    size, as the CUDA ABI lays kernel parameters out."""
    fmt, offset = "=", 0
    for code in codes:
        size = struct.calcsize("=" + code)
        pad = -offset % size
        fmt += f"{pad}x{code}" if pad else code
        offset += pad + size
    return fmt


def _param_list(codes: str, values: tuple, name_of) -> str:
    """The packed parameters as Python expressions: a buffer's address (``name_of(slot)``
    names the array in the slot), a scalar's value."""
    return ", ".join(
        f"{name_of(value)}.data.ptr" if code == "Q" else _number(value)
        for code, value in zip(codes, values)
    )


def _number(value) -> str:
    """A scalar as Python source: ``repr`` round-trips a float; inf and NaN need spelling."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({repr(value)!r})"
    return repr(value)


def _filler(codes: str, values: tuple):
    """``fill(buffer, slots)``: packs parameters of the kinds ``codes`` lists, ``values``
    holding per parameter a slot (buffers) or a number (scalars), with the arrays in
    ``slots``: one ``pack_into`` call."""
    return _packing(codes)[1](*values)


# Parameter lists at least this long whose buffers come first (the multi-output optimizer
# kernels: up to ~200) are packed by one generic filler: as fast per launch as generated
# code there, and compiling their generated code took ~2-6 ms each.
GENERATED_LIMIT = 48


@functools.lru_cache(maxsize=4096)
def _packing(codes: str) -> tuple:
    """(the ``struct.Struct`` of parameters of the kinds ``codes`` lists, ``make(*values)``
    giving a launch's ``fill(buffer, slots)``). The filler's code is generated and compiled
    once per ``codes`` (a plan of 1,371 launches has a few hundred distinct ones; compiling
    one per launch took ~180 ms of loading the UNet step's plan); each launch's slots and
    scalars are the closure's cells, which the filler reads as fast as constants. Long
    lists of buffers then scalars: ``_pointers_first`` (``GENERATED_LIMIT``)."""
    packer = struct.Struct(param_format(codes))
    pointers = len(codes) - len(codes.lstrip("Q"))
    if len(codes) >= GENERATED_LIMIT and pointers >= 2 and "Q" not in codes[pointers:]:
        return packer, functools.partial(_pointers_first, packer.pack_into, pointers)
    names = [f"v{position}" for position in range(len(codes))]
    listed = ", ".join(
        f"slots[{name}].data.ptr" if code == "Q" else name for code, name in zip(codes, names)
    )  # fmt: skip
    source = (
        f"def make({''.join(name + ', ' for name in names)}):\n"
        f"    def fill(buffer, slots):\n"
        f"        pack_into(buffer, 0, {listed})\n"
        f"    return fill\n"
    )
    namespace = {"pack_into": packer.pack_into}
    exec(compile(source, "<flame launch parameters>", "exec"), namespace)  # noqa: S102
    return packer, namespace["make"]


def _pointers_first(pack_into, count: int, *values):
    """The filler of a long parameter list: ``count`` buffers (``values[:count]`` their
    slots), then the scalars."""
    arrays = operator.itemgetter(*values[:count])  # count >= 2: gives a tuple
    scalars = values[count:]

    def fill(buffer, slots):
        pack_into(buffer, 0, *[array.data.ptr for array in arrays(slots)], *scalars)

    return fill


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
