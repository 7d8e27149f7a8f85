"""A captured training step's graph memory with and without the arena (flame/runtime/arena.py),
and what capturing costs: one JSON line per process.

    FLAME_STEP_ARENA=1 python3 notes/probes/step_arena_memory.py unet|dit [SIZE BATCH]
"""

import json
import os
import sys
import time

import cupy

import flame as fl
from bench.diffusion_cases import flame_batch, flame_trainer
from flame.runtime.step_graphs import graph_pool_bytes


def main(model: str = "unet", size: str = "32", batch: str = "64") -> None:
    record = os.environ.get("ARENA_RECORD")  # a file: the recorded lifetimes, as JSON
    if record:
        from flame.runtime import arena

        planned = arena.Recorder.plan

        def keep(recorder):
            ends = [recorder.clock + 1 if end is None else end for end in recorder.ends]
            with open(record, "w") as handle:
                json.dump({"sizes": recorder.sizes, "starts": recorder.starts, "ends": ends},
                          handle)  # fmt: skip
            return planned(recorder)

        arena.Recorder.plan = keep
    with fl.backend("cuda"):
        trainer = flame_trainer((model, "full", int(size), int(batch)))
        inputs = flame_batch(int(size), int(batch))
        times = []
        for _ in range(3):
            started = time.perf_counter()
            trainer.compiled(*inputs)
            fl.synchronize()
            times.append((time.perf_counter() - started) * 1e3)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(20):
            trainer.compiled(*inputs)
        stop.record()
        stop.synchronize()
        info = trainer.compiled.cache_info()
        print(json.dumps({
            "model": model, "arena": os.environ.get("FLAME_STEP_ARENA", "1"),
            "call_ms": times, "step_ms": cupy.cuda.get_elapsed_time(start, stop) / 20,
            "graph_pool_mb": graph_pool_bytes() / 1e6,
            "graph_memory": [{k: v / 1e6 if isinstance(v, int) and k != "arena" else v
                              for k, v in m.items()} for m in info.graph_memory],
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:])
