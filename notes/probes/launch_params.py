"""cuLaunchKernel's parameters: an array of pointers to holders (kernelParams) or one packed
buffer (extra, CU_LAUNCH_PARAM_BUFFER_POINTER), and what filling each costs from Python.

    python3 notes/probes/launch_params.py [ROUNDS]

Uses compiled tiny20's kernel; each variant best of 5 x 5000 calls, rounds interleaved,
median over rounds.
"""

import ctypes
import statistics
import struct
import sys
import time

try:
    import torch  # noqa: F401 (its audit hooks, as in the bench)
except ImportError:
    pass
import cupy
from cupy_backends.cuda.api.driver import launchKernel

import flame as fl
from bench import expressions
from bench.timing import python_probe_us
from flame.replay import bind_arrays


def best_us(function, calls=5000, runs=5):
    for _ in range(200):
        function()
    cupy.cuda.get_current_stream().synchronize()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            function()
        cupy.cuda.get_current_stream().synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    x = fl.randn(1024, seed=0).realize()
    y = fl.randn(1024, seed=1).realize()
    ops = expressions.flame_ops(fl)
    compiled = fl.compile(expressions.bind(expressions.tiny20, ops))
    compiled(x, y)
    ((_, program),) = compiled._programs.items()
    plan = program.plan
    launch = plan.launches[0]
    sources = tuple((kind == "arg", value) for kind, value in program.sources)
    slots = bind_arrays(sources, (x, y)) + [None] * (plan.slot_count - len(sources))
    launch.allocate(slots)
    stream = cupy.cuda.get_current_stream().ptr
    print("params:", [(kind, value) for kind, value in launch.args])
    # kernelParams: one ctypes holder per parameter, an array of their addresses
    holders, buffer_slots = [], []
    for kind, value in launch.args:
        if kind == "scalar":
            holders.append(
                (ctypes.c_int32 if value.dtype.itemsize == 4 else ctypes.c_int64)(int(value))
            )
        else:
            holders.append(ctypes.c_void_p(slots[value].data.ptr))
            buffer_slots.append(value)
    pointer_array = (ctypes.c_void_p * len(holders))(*map(ctypes.addressof, holders))
    params = ctypes.addressof(pointer_array)
    holders = [h for h in holders if isinstance(h, ctypes.c_void_p)]
    f, grid, block = launch.function.ptr, launch.grid, launch.block

    # the packed buffer: each parameter at an offset aligned to its size
    fmt, values, offset = "=", [], 0
    for kind, value in launch.args:
        size = 8 if kind != "scalar" else value.dtype.itemsize
        pad = -offset % size
        fmt += f"{pad}x" if pad else ""
        offset += pad + size
        fmt += "Q" if kind != "scalar" else ("i" if size == 4 else "q")
        values.append(slots[value].data.ptr if kind != "scalar" else int(value))
    packer = struct.Struct(fmt)
    buffer = ctypes.create_string_buffer(packer.size)
    packer.pack_into(buffer, 0, *values)
    size = ctypes.c_size_t(packer.size)
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buffer), 2, ctypes.addressof(size), 0)
    extra_ptr = ctypes.addressof(extra)
    pack_into = packer.pack_into
    order = [(kind, value) for kind, value in launch.args]
    source = (
        "def fill(buffer, slots):\n    pack_into(buffer, 0, "
        + ", ".join(
            f"slots[{value}].data.ptr" if kind != "scalar" else str(int(value))
            for kind, value in order
        )
        + ")\n"
    )
    namespace = {"pack_into": pack_into}
    exec(source, namespace)
    fill = namespace["fill"]

    def holders_fill():
        for holder, slot in zip(holders, buffer_slots):
            holder.value = slots[slot].data.ptr

    pieces = {
        "Launch.launch_into": lambda: launch.launch_into(slots, stream),
        "raw kernelParams": lambda: launchKernel(f, grid, 1, 1, block, 1, 1, 0, stream, params, 0),
        "raw extra": lambda: launchKernel(f, grid, 1, 1, block, 1, 1, 0, stream, 0, extra_ptr),
        "fill holders": holders_fill,
        "fill packed": lambda: fill(buffer, slots),
        "packed fill + launch": lambda: (
            fill(buffer, slots),
            launchKernel(f, grid, 1, 1, block, 1, 1, 0, stream, 0, extra_ptr),
        ),
        "probe": None,
    }
    samples = {name: [] for name in pieces}
    for index in range(rounds):
        names = list(pieces)
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            value = python_probe_us() if name == "probe" else best_us(pieces[name])
            samples[name].append(value)
    out = cupy.empty_like(slots[plan.output_slots[0]])
    check = slots[plan.output_slots[0]].copy()
    slots_out = list(slots)
    slots_out[plan.output_slots[0]] = out
    fill(buffer, slots_out)
    launchKernel(f, grid, 1, 1, block, 1, 1, 0, stream, 0, extra_ptr)
    print("packed launch result equal:", bool((out == check).all()))
    for name, values in samples.items():
        print(
            f"{name:24s} median {statistics.median(values):7.3f} us  "
            f"min {min(values):7.3f}  max {max(values):7.3f}"
        )


if __name__ == "__main__":
    main()
