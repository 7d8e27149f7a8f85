"""Which kernels a compiled training step needs anew at a new resolution or batch size, and why.

    .venv/bin/python notes/probes/new_resolution_cpu.py [--model {unet,dit}] [--size full]
        [--image 32] [--batch 64] [--shapes 64x64:16,48x48:64,32x32:16] [--json OUT]
        [--dump DIR] [--profile OUT.pstats]

Builds bench.diffusion's FLAME trainer as notes/probes/first_step_cpu.py does (the GPU
replaced by the reference interpreter; tracing, the passes, lowering, rendering and NVRTC run
as on the GPU), calls the compiled step at ``--image``/``--batch``, then at each of
``--shapes`` (``SIDExSIDE:BATCH``) in the same process with one kernel cache. For each new
shape it lists every kernel the plan loads that no earlier shape loaded (a new ``spec_key``:
on the GPU, an NVRTC compile or a disk load), with

- flame's own explanation (``flame.codegen.explain``, what ``cache_info``/the dump show), and
- the spec fields that differ from the closest kernel of the same operations loaded before
  (``explain.spec_differences``: the field and where inside it),

and the host seconds of the call: trace, passes, lowering, loads, and ``fusions``: how many
fusion-pass calls of the call's plans reused a grouping recorded at an earlier shape,
were fused in full, or were refused one (flame/ir/passes/reuse.py; ``FLAME_PLAN_REUSE=0``
for the plans without reuse). Run with a warm
``FLAME_CACHE_DIR`` to skip the first shape's NVRTC (a kernel is "new" by key, whatever its
origin). Sibling size classes (flame/runtime/siblings.py) are not compiled, as in
first_step_cpu.py, but the row kernels each plan hands them are recorded: for each new kernel
``sibling`` says whether the background thread would have had it ready (a sibling class of a
row kernel an earlier shape planned), given a quiet moment between the calls.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import os
import sys
import tempfile
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import first_step_cpu as probe  # noqa: E402


def record_loads(found: list) -> None:
    """Every kernel a plan loads: (name, spec_key, spec), in ``found`` (replaces the first
    step probe's load, which compiles without loading a module)."""
    from flame.runtime.executor import Executor

    def load(self, sources):
        start = time.perf_counter()
        self.kernels.cubins(sources)
        found.append(("load_seconds", time.perf_counter() - start, None))
        for _source, name, identity, spec, *_ in sources:
            found.append((name, identity, spec))
        return [None] * len(sources)

    Executor._load = load


def record_siblings(found: list) -> None:
    """The (group, lowered) pairs each plan hands the background size-class compiler."""
    from flame.runtime.siblings import SiblingCompiler

    def submit(self, groups_and_lowered):
        found.extend(groups_and_lowered)

    SiblingCompiler.submit = submit


def sibling_keys(rows: list, done: set) -> set:
    """spec_keys of the other row-cache classes of ``rows`` (what siblings.py compiles)."""
    from flame.codegen.reduce import sibling_specs
    from flame.codegen.render import spec_key
    from flame.runtime.executor import _layout_of

    keys = set()
    for group, lowered in rows:
        if lowered.spec.name in done:
            continue
        done.add(lowered.spec.name)
        keys.update(spec_key(spec) for spec in sibling_specs(group, _layout_of, lowered))
    return keys


def record_big_plan(timings: dict) -> None:
    """The groups, steps, planned peak (MiB) and grouping hash of each call's biggest plan."""
    from flame.runtime import executor

    plan = executor.Executor._plan

    def plan_recorded(self, pending, inputs):
        result = plan(self, pending, inputs)
        groups = len(result.graph.groups)
        if groups > timings.get("big_plan", {}).get("groups", 0):
            position = {id(node): index for index, node in enumerate(result.graph.nodes)}
            members = [
                (group.kind, *(position.get(id(node), -1) for node in group.nodes), "|",
                 *(position.get(id(node), -1) for node in group.outputs))
                for group in result.graph.groups
            ]  # fmt: skip
            timings["big_plan"] = {
                "groups": groups,
                "steps": len(result.launches),
                "peak_mib": round(result.planned_peak_bytes / 2**20, 1),
                # the groups by node position: equal for two plans of the same grouping
                "grouping": hashlib.blake2b(repr(members).encode(), digest_size=6).hexdigest(),
            }
        return result

    executor.Executor._plan = plan_recorded


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        side, batch = item.split(":")
        shapes.append((int(side.split("x")[0]), int(batch)))
    return shapes


def closest(spec, earlier: list):
    """The earlier spec of the same operations (name stem) whose code differs in the fewest
    fields, and those differences."""
    from flame.codegen.explain import spec_differences, stem

    best = None
    for other in earlier:
        if stem(other.name) != stem(spec.name):
            continue
        differences = spec_differences(other, spec)
        if best is None or len(differences) < len(best[1]):
            best = (other, differences)
    return best


def step_at(trainer, image: int, batch: int, timings: dict, loads: list, profile=None):
    """Call the compiled step with a new batch; returns (seconds, events of kind trace/kernel)."""
    import flame as fl
    from bench import diffusion as bd
    from flame.runtime import events
    from flame.runtime.executor import default_executor

    with fl.backend("reference"):
        images, labels = bd.flame_batch(image, batch)
    probe.move_to_cuda()
    timings.clear()
    decisions = default_executor().decisions
    before = (decisions.reused, decisions.fused, decisions.refused)
    del loads[:]
    recorded = []
    with fl.backend("cuda"):
        start = time.perf_counter()
        with events.recording(lambda kind, data: recorded.append((kind, data))):
            if profile is not None:
                profile.enable()
            try:
                trainer.compiled(images, labels)
            except Exception as error:  # noqa: BLE001  the replay needs a GPU
                timings["replay"] = f"not run ({type(error).__name__})"
            if profile is not None:
                profile.disable()
        seconds = time.perf_counter() - start
    after = (decisions.reused, decisions.fused, decisions.refused)
    timings["fusions"] = dict(zip(("reused", "fused", "refused"), map(int.__sub__, after, before)))
    return seconds, recorded


def summary(seconds: float, recorded: list, timings: dict, loads: list) -> dict:
    trace = sum(data["seconds"] for kind, data in recorded if kind == "trace")
    plan = timings.get("plan", 0.0)
    result = {
        "call": seconds,
        "trace_total": trace,
        "trace_without_plan": trace - plan,
        "plan": plan,
        "load": sum(value for name, value, _ in loads if name == "load_seconds"),
    }
    for key, value in timings.items():
        if key.startswith("passes.") or key in (
            "lower", "groups", "nodes", "realizes", "fusions", "big_plan"
        ):  # fmt: skip
            result[key] = value
    origins = Counter(data["origin"] for kind, data in recorded if kind == "kernel")
    result["kernel_events"] = dict(origins)
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="unet", choices=("unet", "dit"))
    parser.add_argument("--size", default="full")
    parser.add_argument("--image", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--shapes", default="64x64:64,48x48:64,32x32:16,64x64:16")
    parser.add_argument("--json", default=None)
    parser.add_argument("--dump", default=None, help="write each new kernel's source here")
    parser.add_argument("--profile", default=None, help="cProfile of the new shapes' calls")
    options = parser.parse_args()
    os.environ.setdefault("FLAME_CACHE_DIR", tempfile.mkdtemp(prefix="flame-new-res-"))
    os.environ["FLAME_SIBLING_CLASSES"] = "0"

    import flame as fl
    from bench import diffusion as bd
    from flame.codegen.render import render

    timings: dict = {}
    loads: list = []
    probe.patch_gpu_away(timings)
    record_loads(loads)
    probe.record_passes(timings)
    record_big_plan(timings)
    rows: list = []
    record_siblings(rows)
    probe.direct_writes_as_on_gpu(timings)
    with fl.backend("reference"):
        case = (options.model, options.size, options.image, options.batch)
        trainer = bd.flame_trainer(case)
    import cupy  # noqa: F401

    profile = cProfile.Profile() if options.profile else None
    report: dict = {"model": options.model, "size": options.size, "shapes": []}
    seen: dict[str, object] = {}  # spec_key -> spec, over every shape so far
    siblings: set = set()  # spec_keys the sibling thread would compile after the calls so far
    sibling_done: set = set()
    shapes = [(options.image, options.batch), *parse_shapes(options.shapes)]
    for index, (image, batch) in enumerate(shapes):
        seconds, recorded = step_at(
            trainer, image, batch, timings, loads, profile if index else None
        )  # fmt: skip
        kernels = [(name, key, spec) for name, key, spec in loads if spec is not None]
        reasons = {
            data["name"]: data.get("reason", "")
            for kind, data in recorded
            if kind == "kernel" and data["origin"] != "memory"
        }
        new = {}
        for name, key, spec in kernels:
            if key not in seen and key not in new:
                new[key] = (name, spec)
        entry = {
            "image": image,
            "batch": batch,
            "kernels_loaded": len(kernels),
            "distinct": len({key for _, key, _ in kernels}),
            "new": len(new),
            **summary(seconds, recorded, timings, loads),
            "kernels": [],
        }
        earlier = list(seen.values())
        entry["new_not_siblings"] = sum(1 for key in new if key not in siblings)
        for key, (name, spec) in new.items():
            match = closest(spec, earlier) if index else None
            item = {
                "kernel": name,
                "size_class": spec.size_class,
                "flame_reason": reasons.get(name, "(memory hit: loaded by an earlier plan)"),
            }
            if index:
                item["closest"] = match[0].name if match else None
                item["closest_class"] = match[0].size_class if match else None
                item["differences"] = match[1] if match else ["no kernel of these operations"]
                item["sibling"] = key in siblings
            entry["kernels"].append(item)
            if options.dump and index:
                folder = os.path.join(options.dump, f"{image}x{image}b{batch}")
                os.makedirs(folder, exist_ok=True)
                with open(os.path.join(folder, f"{name}.cu"), "w") as file:
                    file.write(render(spec))
                if match:
                    with open(os.path.join(folder, f"{name}.before.cu"), "w") as file:
                        file.write(render(match[0]))
        seen.update({key: spec for key, (_, spec) in new.items()})
        start = time.perf_counter()
        siblings |= sibling_keys(rows, sibling_done)
        entry["sibling_lowering_seconds"] = round(time.perf_counter() - start, 3)
        del rows[:]
        report["shapes"].append(entry)
        print_entry(entry, first=index == 0)
    if profile is not None:
        profile.dump_stats(options.profile)
    if options.json:
        with open(options.json, "w") as file:
            json.dump(report, file, indent=1)


def print_entry(entry: dict, first: bool) -> None:
    head = {k: v for k, v in entry.items() if k != "kernels"}
    print(json.dumps(head), flush=True)
    if first:
        return
    causes = Counter(
        "; ".join(item["differences"][:3]) if item["differences"] else "(no code difference)"
        for item in entry["kernels"]
    )
    classes = Counter(
        f"{item['closest_class']} -> {item['size_class']}" for item in entry["kernels"]
    )
    print(f"  new kernels by size class change: {dict(classes)}")
    for item in entry["kernels"]:
        print(f"  {item['kernel']} [{item['size_class']}] vs {item['closest']}"
              f" [{item['closest_class']}]{' (a sibling)' if item['sibling'] else ''}")  # fmt: skip
        print(f"      flame: {item['flame_reason']}")
        for line in item["differences"][:6]:
            print(f"      {line}")
    print(f"  {len(causes)} distinct difference sets", flush=True)


if __name__ == "__main__":
    main()
