"""Where a compiled tiny20 call's host time goes, piece by piece, on the GPU host.

    python3 notes/probes/compiled_parts.py [ROUNDS]

Times, in one process with torch imported (as in the bench), the whole compiled call and each
piece of its path alone: the dispatch's key and lookup, binding, the stream's pointer, the
launch (FLAME's and CuPy's raw driver call), wrapping the result, a new cupy.ndarray. Each
piece: best of 5 runs of 5000 calls per round, rounds interleaved; median over rounds.
"""

import sys

import cupy
from cupy_backends.cuda.api.driver import launchKernel
from probe_common import interleaved, print_medians, tiny20_prepared

from flame.replay import bind_arrays, wrap
from flame.runtime.storage import Storage


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    p = tiny20_prepared()
    compiled, program, plan, launch, slots = (
        p["compiled"], p["program"], p["plan"], p["launch"], p["slots"]
    )  # fmt: skip
    args = (p["x"], p["y"])
    stream = cupy.cuda.get_current_stream().ptr
    node = program.out_nodes[0]
    out = slots[plan.output_slots[0]]
    buffer, extra, _ = launch._blocks[0]
    launch._fill(buffer, slots)
    raw = (launch.function.ptr, launch.grid, 1, 1, launch.block, 1, 1, 0, stream, 0, extra)
    dispatch, direct = compiled._state._dispatch, compiled._state._direct
    pieces = {
        "compiled(x, y)": lambda: compiled(*args),
        "program.fast(args)": lambda: program.fast(args),
        "program.entry(args)": lambda: program.entry(args),
        "dispatch: key + lookup": lambda: dispatch(direct, args),
        "bind_arrays": lambda: bind_arrays(p["sources"], args),
        "get_current_stream().ptr": lambda: cupy.cuda.get_current_stream().ptr,
        "Launch.launch_into": lambda: launch.launch_into(slots, stream),
        "raw launchKernel": lambda: launchKernel(*raw),
        "wrap(Storage(...))": lambda: wrap(
            Storage("cuda", node.dtype, out), node.dtype, node.shape, node.site
        ),
        "cupy.ndarray(1024)": lambda: cupy.ndarray((1024,), cupy.float32),
        "probe": None,
    }
    print_medians(interleaved(pieces, rounds))


if __name__ == "__main__":
    main()
