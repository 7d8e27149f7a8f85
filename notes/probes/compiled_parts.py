"""Where a compiled tiny20 call's host time goes, piece by piece, on the GPU host.

    python3 notes/probes/compiled_parts.py [ROUNDS]

Times, in one process with torch imported (as in the bench), the whole compiled call and each
piece of its path alone: the dispatch's key and lookup, binding, the stream's pointer, the
launch (FLAME's and CuPy's raw driver call), wrapping the result, a new cupy.ndarray. Each
piece: best of 5 runs of 5000 calls per round, rounds interleaved; median over rounds.
"""

import statistics
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
from flame.replay import bind_arrays, wrap
from flame.runtime.storage import Storage


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
    fast, plan = program.fast, program.plan
    launch = plan.launches[0]
    sources = tuple((kind == "arg", value) for kind, value in program.sources)
    args = (x, y)
    storages = [a.node.buffer or a.node.attr("storage") for a in args]
    slots = bind_arrays(sources, args) + [None] * (plan.slot_count - len(sources))
    launch.allocate(slots)
    stream = cupy.cuda.get_current_stream().ptr
    node = program.out_nodes[0]
    out = slots[plan.output_slots[0]]
    buffer, extra, _ = launch._blocks[0]
    launch._fill(buffer, slots)
    raw = (launch.function.ptr, launch.grid, 1, 1, launch.block, 1, 1, 0, stream, 0, extra)

    dispatch, direct = compiled._dispatch, dict(compiled._direct)
    direct_key = next(iter(direct))
    direct[direct_key] = lambda s0, s1: None  # the dispatch alone: key, lookup, no run

    pieces = {
        "compiled(x, y)": lambda: compiled(x, y),
        "program.fast(args)": lambda: fast(args),
        "program.direct(storages)": lambda: program.direct(*storages),
        "dispatch: key + lookup": lambda: dispatch(direct, args),
        "bind_arrays": lambda: bind_arrays(sources, args),
        "get_current_stream().ptr": lambda: cupy.cuda.get_current_stream().ptr,
        "Launch.launch_into": lambda: launch.launch_into(slots, stream),
        "raw launchKernel": lambda: launchKernel(*raw),
        "wrap(Storage(...))": lambda: wrap(
            Storage("cuda", node.dtype, out), node.dtype, node.shape, node.site
        ),
        "cupy.ndarray(1024)": lambda: cupy.ndarray((1024,), cupy.float32),
        "probe": lambda: None,
    }
    samples = {name: [] for name in pieces}
    for index in range(rounds):
        names = list(pieces)
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            value = python_probe_us() if name == "probe" else best_us(pieces[name])
            samples[name].append(value)
    for name, values in samples.items():
        print(
            f"{name:28s} median {statistics.median(values):7.3f} us  "
            f"min {min(values):7.3f}  max {max(values):7.3f}"
        )


if __name__ == "__main__":
    main()
