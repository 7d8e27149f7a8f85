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

import math
import sys

import numpy as np


def one_kernel_runner(plan, header: list[str], storages: list[str], finish: list[str],
                      namespace: dict, recycle_bytes: int | None = None):  # fmt: skip
    """The function ``header`` defines (its ``def`` line and whatever binds the names in
    ``storages``), a binding of each plan input from the expression ``storages`` gives it (a
    ``Storage``), the launch, and ``finish`` (lines using ``out``, the result's array).
    ``namespace``: the names ``header`` and ``finish`` use, and may hold ``recycled`` (a
    ``[None, None]`` list) for runners of one plan to share their recycled buffer. Results
    larger than ``recycle_bytes`` (None: no bound) always get a new buffer. None when the plan
    is not one kernel writing one result."""
    from cupy import ndarray
    from cupy.cuda import get_current_stream

    from flame.runtime.launch import Launch

    if len(plan.launches) != 1 or len(plan.output_slots) != 1:
        return None
    launch = plan.launches[0]
    (out_slot,) = plan.output_slots
    if not isinstance(launch, Launch) or [slot for slot, _ in launch.writes] != [out_slot]:
        return None
    names = {slot: f"x{slot}" for slot in range(len(storages))}
    names[out_slot] = "out"
    launching = launch.launch_source(names)
    if launching is None:
        return None
    ((out_shape, out_dtype),) = launch.shapes
    lines = list(header)
    for slot, storage in enumerate(storages):
        lines += [
            f"    x{slot} = {storage}.array",
            f"    if x{slot} is None:",
            f"        x{slot} = {storage}.device_array()",
        ]  # fmt: skip
    lines.append("    stream = current_stream().ptr")
    nbytes = np.dtype(out_dtype).itemsize * math.prod(out_shape)
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
    launch_lines, launch_names = launching
    lines += [*launch_lines, *finish]
    scope = {
        "recycled": [None, None],  # [array of the last run, its stream's pointer]
        **namespace, **launch_names,  # runners of one plan may share ``recycled``
        "current_stream": get_current_stream, "refcount": sys.getrefcount,
        "ndarray": ndarray, "out_shape": out_shape, "out_dtype": out_dtype,
    }  # fmt: skip
    source = "\n".join(lines) + "\n"
    exec(compile(source, "<flame one-kernel runner>", "exec"), scope)  # noqa: S102
    run = scope[header[0].removeprefix("def ").partition("(")[0]]  # the function ``header`` defines
    run.source = source  # for the curious and for tests
    return run
