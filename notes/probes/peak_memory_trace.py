"""Who holds the memory at a compiled step's peak (the bench's figure: CuPy pool allocations in
use during one call, above what was in use before it).

Builds bench.diffusion's FLAME trainer, calls the step three times (warm-up), then follows every
``malloc`` and ``free`` of CuPy's pool during a fourth call with a ``MemoryHook``, tagging each
allocation with the innermost FLAME function on its stack. At each new peak it snapshots the
live allocations by tag; prints the peak, the planned peak of the step's plan(s), and the
breakdown at the peak (MB), as JSON.

    python3 notes/probes/peak_memory_trace.py OUT.json [unet|dit] [SIZE BATCH]
"""

import json
import sys
import traceback

import cupy
from cupy.cuda.memory_hook import MemoryHook

import flame as fl
from bench.diffusion_cases import flame_batch, flame_trainer

MB = 1e6


def tag_of(stack) -> str:
    for frame in reversed(stack):
        name = frame.filename
        if "/flame/" in name and "/cupy/" not in name:
            return f"{name.split('/flame/', 1)[1]}:{frame.name}"
    return "other"


class Trace(MemoryHook):
    name = "peak_trace"

    def __init__(self):
        self.live = {}
        self.in_use = self.peak = 0
        self.at_peak = {}
        self.count = 0

    def malloc_postprocess(self, **kwargs):
        tag = tag_of(traceback.extract_stack(limit=25))
        self.live[kwargs["mem_ptr"]] = (kwargs["mem_size"], tag)
        self.in_use += kwargs["mem_size"]
        self.count += 1
        if self.in_use > self.peak:
            self.peak = self.in_use
            totals = {}
            for size, name in self.live.values():
                totals[name] = totals.get(name, 0) + size
            self.at_peak = totals

    def free_postprocess(self, **kwargs):
        found = self.live.pop(kwargs["mem_ptr"], None)
        if found is not None:
            self.in_use -= found[0]


def main(out: str, model: str = "unet", size: int = 32, batch: int = 64) -> None:
    with fl.backend("cuda"):
        trainer = flame_trainer((model, "full", int(size), int(batch)))
        inputs = flame_batch(int(size), int(batch))
        for _ in range(3):
            trainer.compiled(*inputs)
        fl.synchronize()
        pool = cupy.get_default_memory_pool()
        pool.free_all_blocks()
        resident = pool.used_bytes()
        hook = Trace()
        with hook:
            trainer.compiled(*inputs)
            fl.synchronize()
        plans = []
        for program in trainer.compiled._state._programs.values():
            plan = getattr(program, "plan", None)
            if plan is not None:
                plans.append({"peak_mb": plan.planned_peak_bytes / MB,
                              "launches": len(plan.launches)})  # fmt: skip
        result = {
            "resident_mb": resident / MB,
            "peak_mb": hook.peak / MB,
            "allocations": hook.count,
            "plans": plans,
            "at_peak_mb": {k: v / MB for k, v in sorted(hook.at_peak.items(), key=lambda i: -i[1])},
        }
    print(json.dumps(result, indent=1))
    with open(out, "w") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
