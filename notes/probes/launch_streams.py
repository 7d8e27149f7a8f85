"""What cuLaunchKernel costs the host on different streams: the legacy default stream (0),
the per-thread default stream (2), a created blocking stream and a created non-blocking one.

    python3 notes/probes/launch_streams.py [ROUNDS]

compiled tiny20's kernel, prepared parameters; best of 5 x 5000 launches, rounds
interleaved, median over rounds.
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
from flame.replay import bind_arrays


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    x = fl.randn(1024, seed=0).realize()
    y = fl.randn(1024, seed=1).realize()
    compiled = fl.compile(expressions.bind(expressions.tiny20, expressions.flame_ops(fl)))
    compiled(x, y)
    ((_, program),) = compiled._programs.items()
    plan = program.plan
    launch = plan.launches[0]
    sources = tuple((kind == "arg", value) for kind, value in program.sources)
    slots = bind_arrays(sources, (x, y)) + [None] * (plan.slot_count - len(sources))
    launch.allocate(slots)
    holders, params, _ = launch._blocks[0]
    for holder, slot in zip(holders, launch._buffer_slots):
        holder.value = slots[slot].data.ptr
    f, grid, block = launch.function.ptr, launch.grid, launch.block
    blocking = cupy.cuda.Stream(non_blocking=False)
    non_blocking = cupy.cuda.Stream(non_blocking=True)
    streams = {
        "legacy default (0)": 0,
        "per-thread default (2)": 2,
        "created, blocking": blocking.ptr,
        "created, non-blocking": non_blocking.ptr,
    }

    def best_us(stream, calls=5000, runs=5):
        for _ in range(200):
            launchKernel(f, grid, 1, 1, block, 1, 1, 0, stream, params, 0)
        cupy.cuda.Device().synchronize()
        best = float("inf")
        for _ in range(runs):
            start = time.perf_counter()
            for _ in range(calls):
                launchKernel(f, grid, 1, 1, block, 1, 1, 0, stream, params, 0)
            cupy.cuda.Device().synchronize()
            best = min(best, (time.perf_counter() - start) / calls * 1e6)
        return best

    samples = {name: [] for name in [*streams, "probe"]}
    for index in range(rounds):
        names = list(samples)
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(python_probe_us() if name == "probe" else best_us(streams[name]))
    for name, values in samples.items():
        print(
            f"{name:24s} median {statistics.median(values):7.3f} us  "
            f"min {min(values):7.3f}  max {max(values):7.3f}"
        )


if __name__ == "__main__":
    main()
