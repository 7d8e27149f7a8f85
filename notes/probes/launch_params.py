"""cuLaunchKernel's parameters: an array of pointers to holders (kernelParams) or one packed
buffer (extra, CU_LAUNCH_PARAM_BUFFER_POINTER), and what filling each costs from Python.

    python3 notes/probes/launch_params.py [ROUNDS]

Uses compiled tiny20's kernel; each variant best of 5 x 5000 calls, rounds interleaved,
median over rounds.
"""

import ctypes
import struct
import sys

import cupy
from cupy_backends.cuda.api.driver import launchKernel
from probe_common import interleaved, print_medians, tiny20_prepared


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    p = tiny20_prepared()
    plan, launch, slots = p["plan"], p["launch"], p["slots"]
    stream = cupy.cuda.get_current_stream().ptr
    print("params:", list(launch.args))
    # kernelParams: one ctypes holder per parameter, an array of their addresses
    holders, pointers = [], []
    for kind, value in launch.args:
        if kind == "scalar":
            width = ctypes.c_int32 if value.dtype.itemsize == 4 else ctypes.c_int64
            holders.append(width(int(value)))
        else:
            holders.append(ctypes.c_void_p(slots[value].data.ptr))
            pointers.append((holders[-1], value))
    pointer_array = (ctypes.c_void_p * len(holders))(*map(ctypes.addressof, holders))
    params = ctypes.addressof(pointer_array)
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
    listed = ", ".join(
        f"slots[{value}].data.ptr" if kind != "scalar" else str(int(value))
        for kind, value in launch.args
    )
    namespace = {"pack_into": packer.pack_into}
    exec(f"def fill(buffer, slots):\n    pack_into(buffer, 0, {listed})\n", namespace)  # noqa: S102
    fill = namespace["fill"]

    def holders_fill():
        for holder, slot in pointers:
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
    samples = interleaved(pieces, rounds)
    check = slots[plan.output_slots[0]].copy()
    out = cupy.empty_like(check)
    slots_out = list(slots)
    slots_out[plan.output_slots[0]] = out
    fill(buffer, slots_out)
    launchKernel(f, grid, 1, 1, block, 1, 1, 0, stream, 0, extra_ptr)
    print("packed launch result equal:", bool((out == check).all()))
    print_medians(samples)


if __name__ == "__main__":
    main()
