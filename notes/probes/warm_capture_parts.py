"""Where a warm process's step capture and cuDNN plan reads go (bench.diffusion's FLAME UNet
step): run after a process that filled FLAME_CACHE_DIR (e.g. ``bench.diffusion
--first-step-child flame``). Times, in the first step: each cuDNN plan read split into the
disk read, a new graph and ``deserialize``; the capture split into FLAME kernel launches,
their allocations and library calls by op. Then the same again in the same process: the
plans read a second time (memory dropped) and the step captured a second time, so what
the first time paid once per process (the library's kernel loading) stands apart from the
per-call Python. One JSON line. ``PROBE_NO_BIND=1``: the second reads leave the cuDNN
handle bound to the stream of the first capture (destroyed by then), as FLAME did before it
re-bound the handle for reads and builds.

    FLAME_CACHE_DIR=DIR python3 notes/probes/warm_capture_parts.py [SIZE BATCH]
"""

import collections
import json
import os
import sys
import time

import flame as fl
from bench.diffusion_cases import flame_batch, flame_trainer

TIMES: dict = collections.defaultdict(lambda: [0.0, 0])


def timed(owner, name: str, label):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            entry = TIMES[label(*args) if callable(label) else label]
            entry[0] += time.perf_counter() - started
            entry[1] += 1

    setattr(owner, name, wrapper)


def snapshot() -> dict:
    out = {key: [round(value[0] * 1e3, 1), value[1]] for key, value in TIMES.items()}
    TIMES.clear()
    return dict(sorted(out.items(), key=lambda item: -item[1][0]))


def main(size: int = 32, batch: int = 64) -> None:
    import cupy

    from flame.runtime import launch, library_cudnn, plans, step_graphs

    captured = {}
    original_capture = step_graphs.StepGraphs._capture

    def capture(self, arrays, targets):
        captured["call"] = (self, arrays, targets)
        return original_capture(self, arrays, targets)

    step_graphs.StepGraphs._capture = capture
    timed(step_graphs.StepGraphs, "_capture", "capture (whole)")
    timed(library_cudnn, "preload", "cudnn preload (whole)")
    timed(library_cudnn, "_disk", "cudnn: disk cache object")
    timed(library_cudnn, "_new_graph", "cudnn: new graph")
    timed(library_cudnn, "_deserialize", "cudnn: deserialize")
    timed(library_cudnn, "execute", "cudnn: execute")
    timed(launch.Launch, "launch_into", "flame kernels: launch_into")
    timed(launch.Launch, "allocate", "flame kernels: allocate")
    timed(plans.LibraryCall, "execute", lambda self, slots: f"library: {self.node.op}")
    result = {}
    with fl.backend("cuda"):
        cupy.cuda.runtime.free(0)
        trainer = flame_trainer(("unet", "full", size, batch))
        inputs = flame_batch(size, batch)
        fl.synchronize()
        TIMES.clear()
        started = time.perf_counter()
        trainer.compiled(*inputs)
        fl.synchronize()
        result["first_step_ms"] = round((time.perf_counter() - started) * 1e3, 1)
        result["first"] = snapshot()
        entries = [(made.key, made.key[1]) for made in library_cudnn._PLANS.values()]
        library_cudnn._PLANS.clear()
        if os.environ.get("PROBE_NO_BIND") == "1":  # the handle left on the capture's stream
            library_cudnn._bind_stream = lambda session: None
            library_cudnn._SESSION["stream"] = -1
        started = time.perf_counter()
        read = library_cudnn.preload(entries)
        result["second_read_ms"] = round((time.perf_counter() - started) * 1e3, 1)
        result["second_read_plans"] = read
        result["second_read"] = snapshot()
        graphs, arrays, targets = captured["call"]
        started = time.perf_counter()
        graphs._capture(arrays, targets)
        fl.synchronize()
        result["second_capture_ms"] = round((time.perf_counter() - started) * 1e3, 1)
        result["second_capture"] = snapshot()
    print(json.dumps(result))


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
