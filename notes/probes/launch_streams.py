"""What cuLaunchKernel costs the host on different streams: the legacy default stream (0),
the per-thread default stream (2), a created blocking stream and a created non-blocking one.

    python3 notes/probes/launch_streams.py [ROUNDS]

compiled tiny20's kernel, prepared parameters (packed, as FLAME launches; the figures in
notes/performance.md were taken with the kernelParams form, which costs the driver the same);
best of 5 x 5000 launches, rounds interleaved, median over rounds.
"""

import sys

import cupy
from cupy_backends.cuda.api.driver import launchKernel
from probe_common import best_us, interleaved, print_medians, tiny20_prepared


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    p = tiny20_prepared()
    launch, slots = p["launch"], p["slots"]
    buffer, extra, _ = launch._blocks[0]
    launch._fill(buffer, slots)
    f, grid, block = launch.function.ptr, launch.grid, launch.block
    blocking = cupy.cuda.Stream(non_blocking=False)
    non_blocking = cupy.cuda.Stream(non_blocking=True)
    streams = {
        "legacy default (0)": 0,
        "per-thread default (2)": 2,
        "created, blocking": blocking.ptr,
        "created, non-blocking": non_blocking.ptr,
    }

    def launches(stream):
        return lambda: launchKernel(f, grid, 1, 1, block, 1, 1, 0, stream, 0, extra)

    pieces = {name: launches(stream) for name, stream in streams.items()}
    pieces["probe"] = None

    def timer(piece):
        return best_us(piece, synchronize=cupy.cuda.Device().synchronize)

    print_medians(interleaved(pieces, rounds, timer))


if __name__ == "__main__":
    main()
