"""Straight-line runners for plans of one kernel and one result, the commonest small
programs: their per-call path generated as Python, with no loops, lists or intermediate
calls.

A runner binds the inputs' memory, takes the result's buffer, packs the kernel's parameters
in one ``struct.pack_into`` call and launches it. Its callers say how its inputs arrive and
what becomes of the result: ``flame.compile`` passes the arguments' storages and wraps the
result as a tensor (flame/replay.py); lazy mode passes the nodes a recorded walk matched and
memoizes the result on the graph's root (executor.py).

The result's buffer is recycled: when nobody holds the previous run's result any more
(nothing but the runner holds its array, checked by reference count) and the stream is the
same, the kernel writes into that array again instead of asking the pool for a new one.
Anything that keeps the memory alive -- the tensor, its node, a view, DLPack or the CUDA array
interface (each holds the tensor, the node or the array) -- keeps it from being reused.
Threads running at once each hold the array they test in a local, so two never both find it
free. ``recycle_bytes`` bounds the buffers a runner keeps this way.
"""

from __future__ import annotations

import sys

import numpy as np


def one_kernel_runner(plan, header: list[str], storages: list[str], finish: list[str],
                      namespace: dict, recycle_bytes: int | None = None):  # fmt: skip
    """``run``, generated from ``header`` (its ``def`` line and whatever binds the names in
    ``storages``), a binding of each plan input from the expression ``storages`` gives it (a
    ``Storage``), the launch, and ``finish`` (lines using ``out``, the result's array).
    ``namespace``: the names ``header`` and ``finish`` use. Results larger than
    ``recycle_bytes`` (None: no bound) always get a new buffer. None when the plan is not one
    kernel writing one result."""
    from cupy import ndarray
    from cupy.cuda import get_current_stream
    from cupy_backends.cuda.api.driver import launchKernel

    from flame.runtime.launch import Launch

    if len(plan.launches) != 1 or len(plan.output_slots) != 1:
        return None
    launch = plan.launches[0]
    if not isinstance(launch, Launch) or launch.zeroed:
        return None
    (out_slot,) = plan.output_slots
    if [slot for slot, _ in launch.writes] != [out_slot]:
        return None
    ((_, out_shape, out_dtype),) = launch._allocations
    names = {slot: f"x{slot}" for slot in range(len(storages))}
    names[out_slot] = "out"
    if any(kind != "scalar" and value not in names for kind, value in launch.args):
        return None  # reads a slot that is neither an input nor the result
    lines = list(header)
    for slot, storage in enumerate(storages):
        lines += [
            f"    x{slot} = {storage}.array",
            f"    if x{slot} is None:",
            f"        x{slot} = {storage}.device_array()",
        ]  # fmt: skip
    lines.append("    stream = current_stream().ptr")
    nbytes = np.dtype(out_dtype).itemsize
    for size in out_shape:
        nbytes *= size
    if recycle_bytes is None or nbytes <= recycle_bytes:
        # 3 references when free: the list, ``last``, and getrefcount's own argument
        lines += [
            "    last = recycled[0]",
            "    if last is not None and refcount(last) == 3 and recycled[1] == stream:",
            "        out = last",
            "    else:",
            "        out = ndarray(out_shape, out_dtype)",
            "        recycled[0] = out",
            "        recycled[1] = stream",
        ]  # fmt: skip
    else:
        lines.append("    out = ndarray(out_shape, out_dtype)")
    lines += [
        "    try:",
        "        block = blocks.pop()",
        "    except IndexError:",
        "        block = launch._new_block()",
        "    try:",
        f"        pack_into(block[0], 0, {', '.join(launch.param_values(names))})",
        "        launch_kernel(function, grid, 1, 1, threads, 1, 1, 0, stream, 0, block[1])",
        "    except Exception as error:",
        "        launch.relaunch(error, stream, block[1])",
        "    finally:",
        "        blocks.append(block)",
        *finish,
    ]  # fmt: skip
    scope = {
        **namespace,
        "current_stream": get_current_stream, "refcount": sys.getrefcount,
        "recycled": [None, None],  # [array of the last run, its stream's pointer]
        "ndarray": ndarray, "out_shape": out_shape, "out_dtype": out_dtype,
        "launch": launch, "blocks": launch._blocks, "pack_into": launch._packer.pack_into,
        "launch_kernel": launchKernel, "function": launch.function.ptr,
        "grid": launch.grid, "threads": launch.block,
    }  # fmt: skip
    source = "\n".join(lines) + "\n"
    exec(compile(source, "<flame one-kernel runner>", "exec"), scope)  # noqa: S102
    run = scope["run"]
    run.source = source  # for the curious and for tests
    return run
