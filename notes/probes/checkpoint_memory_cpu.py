"""Why ``--checkpoint-blocks`` costs memory instead of saving it: the planned peak of the
compiled diffusion step with and without checkpointed blocks, planned on a machine without a
GPU (first_step_cpu.py's stand-ins; kernels are neither compiled nor run).

    .venv/bin/python notes/probes/checkpoint_memory_cpu.py [model size image batch]

For each variant: the step plan's groups, launches, planned peak (intermediates released
after their last reader) and the largest slots live at the peak with the ops that write them.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import first_step_cpu as probe  # noqa: E402


def step_plan(model, size, image, batch, checkpoint: bool):
    import flame as fl
    from bench import diffusion as bd
    from flame.runtime import events

    with fl.backend("reference"):
        trainer = bd.flame_trainer((model, size, image, batch), checkpoint=checkpoint)
        images, labels = bd.flame_batch(image, batch)
    probe.move_to_cuda()
    plans = []
    with (
        fl.backend("cuda"),
        events.recording(lambda kind, data: plans.append(data["plan"]) if kind == "plan" else None),
    ):
        try:
            trainer.compiled(images, labels)
        except Exception:  # noqa: BLE001 (the replay needs a GPU; the plan is what we want)
            pass
    return max(plans, key=lambda plan: len(plan.launches))


def describe(plan) -> dict:
    """The peak, and the biggest buffers live there: writer's index and ops, last reader."""
    from flame.ir.node import format_site
    from flame.runtime.executor import _reads
    from flame.runtime.launch import Launch

    graph, launches = plan.graph, plan.launches
    writer, size_of, text = {}, {}, {}
    slot = len(plan.inputs)
    for index, group in enumerate(graph.groups):
        for node in group.outputs:
            writer[slot], size_of[slot] = index, node.numel * node.dtype.itemsize
            site = format_site(node.site) if node.site else "?"
            text[slot] = f"{node.op}{list(node.shape)} {node.dtype.name} @{site}"
            slot += 1
    last_read = {}
    for index, step in enumerate(launches):
        for read in _reads(step):
            last_read[read] = index
    live, peak, peak_at, alive = 0, 0, 0, set()
    best = set()
    for index, step in enumerate(launches):
        written = [s for s, _ in step.writes] if isinstance(step, Launch) else [step.output]
        alive |= set(written)
        live += sum(size_of.get(s, 0) for s in written)
        if live > peak:
            peak, peak_at, best = live, index, set(alive)
        for s in plan.releases[index]:
            alive.discard(s)
            live -= size_of.get(s, 0)
    biggest = sorted(best, key=lambda s: -size_of.get(s, 0))[:25]
    return {
        "launches": len(launches),
        "planned_peak_MB": round(plan.planned_peak_bytes / 2**20, 1),
        "peak_at_launch": peak_at,
        "live_at_peak": len(best),
        "biggest": [
            f"{size_of[s] / 2**20:.1f} MB written {writer[s]} last read {last_read.get(s)}: "
            f"{text[s]}"
            for s in biggest
        ],
    }


def main() -> None:
    model, size, image, batch = (
        sys.argv[1:5] + ["unet", "full", "32", "64"][len(sys.argv[1:5]) :]
    )[:4]
    os.environ.setdefault("FLAME_CACHE_DIR", tempfile.mkdtemp(prefix="flame-ckpt-"))
    os.environ["FLAME_SIBLING_CLASSES"] = "0"
    os.environ["FLAME_PLAN_CACHE"] = "0"
    timings: dict = {}
    probe.patch_gpu_away(timings)
    from flame.runtime.executor import Executor

    Executor._load = lambda self, sources: [None] * len(sources)  # no NVRTC: plans only
    probe.direct_writes_as_on_gpu(timings)
    for checkpoint in (False, True):
        plan = step_plan(model, size, int(image), int(batch), checkpoint)
        print(json.dumps({"checkpoint": checkpoint, **describe(plan)}, indent=1), flush=True)


if __name__ == "__main__":
    main()
