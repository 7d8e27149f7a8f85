"""Where the first training step of a process goes (bench.diffusion's FLAME UNet step), by
wall time of the main thread in FLAME's parts: each part's own time (time inside nested
parts counted once, in the innermost), plus the step's total. Run once to fill an empty
cache, then again for the warm-disk figures (same FLAME_CACHE_DIR).

    FLAME_CACHE_DIR=DIR python3 notes/probes/warm_step_parts.py [SIZE BATCH [SIZE2 BATCH2]]

With SIZE2 BATCH2, the same parts of the next call at that image size and batch (a new
resolution's first step in a process that has stepped at SIZE BATCH), as a second line.
"""

import functools
import json
import sys
import threading
import time

import flame as fl
from bench.diffusion_cases import flame_batch, flame_trainer

TOTALS: dict[str, list] = {}
_STACK = threading.local()


def timed(owner, name: str, label: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            return original(*args, **kwargs)
        stack = getattr(_STACK, "frames", None)
        if stack is None:
            stack = _STACK.frames = []
        stack.append(0.0)
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent = time.perf_counter() - started
            inner = stack.pop()
            entry = TOTALS.setdefault(label, [0.0, 0])
            entry[0] += spent - inner
            entry[1] += 1
            if stack:
                stack[-1] += spent

    setattr(owner, name, wrapper)


def main(size: int = 32, batch: int = 64, size2: int = 0, batch2: int = 0) -> None:
    import importlib

    import cupy

    compile_module = importlib.import_module("flame.compile")
    from flame.runtime import executor, library_cudnn, plan_store, step_graphs
    from flame.runtime.compiler import KernelCache

    timed(compile_module.CompiledFunction, "_trace", "trace (rest)")
    timed(executor.Executor, "_stored_plan", "plan_for (rest)")
    timed(plan_store.PlanStore, "load", "plan_store.load (rest)")
    timed(executor.Executor, "_plan", "plan (passes, lowering)")
    timed(executor.Executor, "_load", "kernel functions (rest: module loads)")
    timed(KernelCache, "cubins", "kernel cache lookups and compiles")
    timed(step_graphs.StepGraphs, "_capture", "step capture (rest)")
    timed(library_cudnn, "plan", "cudnn plans")
    timed(library_cudnn, "preload", "cudnn plans read before the capture")
    timed(library_cudnn, "_load", "cudnn session (load/wait)")
    with fl.backend("cuda"):
        cupy.cuda.runtime.free(0)
        trainer = flame_trainer(("unet", "full", size, batch))
        calls = [("first_step_ms", size, batch)]
        if size2:
            calls.append(("new_resolution_ms", size2, batch2))
        for label, side, count in calls:
            inputs = flame_batch(side, count)
            fl.synchronize()
            TOTALS.clear()
            info = trainer.compiled.cache_info()
            seen = len(info.kernels)
            started = time.perf_counter()
            trainer.compiled(*inputs)
            fl.synchronize()
            total = time.perf_counter() - started
            ranked = sorted(TOTALS.items(), key=lambda item: -item[1][0])
            parts = {k: [round(v[0] * 1e3, 1), v[1]] for k, v in ranked}
            attributed = sum(v[0] for v in TOTALS.values())
            print(json.dumps({label: round(total * 1e3, 1), "shape": f"{side}x{side} b{count}",
                              "parts_ms_calls": parts,
                              "unattributed_ms": round((total - attributed) * 1e3, 1),
                              "kernel_origins": _origins(info.kernels[seen:]),
                              "cudnn_plans": library_cudnn.plan_counts()},
                             ), flush=True)  # fmt: skip


def _origins(kernels: list) -> dict:
    """How many kernels the call compiled with NVRTC or read from the disk cache."""
    found: dict[str, int] = {}
    for entry in kernels:
        found[entry["origin"]] = found.get(entry["origin"], 0) + 1
    return found


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
