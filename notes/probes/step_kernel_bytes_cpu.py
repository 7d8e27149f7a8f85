"""Every FLAME kernel of the whole compiled training step (forward, backward, clipping,
AdamW, EMA), planned on the CPU for a stand-in H100, with the bytes each launch must move.

    PYTHONPATH=. .venv/bin/python notes/probes/step_kernel_bytes_cpu.py --model dit \
        --batch 64 --json /tmp/dit_kernels.json [--profile notes/session19-h100/profiles/dit_profile.json]

Uses notes/probes/first_step_cpu.py's machinery (reference interpreter in place of the GPU,
NVRTC left out of the load) to trace ``bench.diffusion``'s FLAME trainer; hooks the
executor's lowering to keep, per lowered group, the kernel's name, template, vector width,
block, size class, index type, lowering extras, the grid the launch got, the nodes of the
group and, per operand read and output written, shape and stored dtype. Bytes = every read
buffer once (its stored elements x itemsize) + every output once. Kernel names are digests of
their code, so they match the GPU profile's names; ``--profile`` joins the two and prints
us/launch, floor at 3.0 TB/s and % of floor for the profile's FLAME kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "notes", "probes"))

BANDWIDTH = 3.0e12  # bytes/s


def node_text(node):
    attrs = {k: v for k, v in dict(node.attrs).items() if k in ("dims", "axes", "axis", "perm", "keepdim", "shape")}
    return f"{node.op}{list(node.shape)}:{node.dtype.name}" + (f"{attrs}" if attrs else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="dit")
    parser.add_argument("--size", default="full")
    parser.add_argument("--image", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--json", default="/tmp/step_kernels.json")
    parser.add_argument("--profile", default=None)
    parser.add_argument("--sources", default=None, help="write each kernel's CUDA source here")
    parser.add_argument("--inspect", nargs="*", default=(),
                        help="kernel name fragments: print who writes what they read and who"
                        " reads what they write (groups of the planned graph)")
    options = parser.parse_args()
    os.environ.setdefault("FLAME_CACHE_DIR", tempfile.mkdtemp(prefix="flame-bytes-"))
    os.environ["FLAME_SIBLING_CLASSES"] = "0"

    import first_step_cpu as fs

    import flame as fl
    from bench import diffusion as bd
    from flame.runtime import executor

    wide = os.environ.get("PROBE_WIDE_SOURCES")  # A/B of materialize.WIDE_SOURCES
    if wide:
        from flame.ir.passes import materialize

        materialize.WIDE_SOURCES = int(wide)
    timings: dict = {}
    fs.patch_gpu_away(timings)
    fs.direct_writes_as_on_gpu(timings)
    # no NVRTC: the names and launch shapes are what we want
    executor.Executor._load = lambda self, sources: [None] * len(sources)

    lowered_log = []
    from flame.codegen.lower import PlanLowering

    lower = PlanLowering.lower

    def lower_logged(self, group):
        result = lower(self, group)
        lowered_log.append((group, result))
        return result

    PlanLowering.lower = lower_logged
    plans = []
    plan = executor.Executor._plan

    def plan_logged(self, pending, inputs):
        start = len(lowered_log)
        result = plan(self, pending, inputs)
        plans.append((result, lowered_log[start:]))
        return result

    executor.Executor._plan = plan_logged

    with fl.backend("reference"):
        trainer = bd.flame_trainer((options.model, options.size, options.image, options.batch))
        images, labels = bd.flame_batch(options.image, options.batch)
    fs.move_to_cuda()
    with fl.backend("cuda"):
        try:
            trainer.compiled(images, labels)
        except Exception as error:
            print("replay not run:", type(error).__name__, error, file=sys.stderr)

    result, lowered = max(plans, key=lambda item: len(item[0].launches))
    print(f"plans: {len(plans)}; biggest: {len(result.launches)} launches, "
          f"{len(lowered)} lowered groups", file=sys.stderr)
    launches = defaultdict(list)
    for item in result.launches:
        spec = getattr(item, "spec", None)
        if spec is not None and hasattr(spec, "name"):
            launches[spec.name].append(item)
    used = defaultdict(int)
    rows = []
    sources = {}
    for group, low in lowered:
        spec = low.spec
        index = used[spec.name]
        used[spec.name] += 1
        launch = launches[spec.name][index] if index < len(launches[spec.name]) else None
        reads = [(list(n.shape), n.dtype.name, n.numel * n.dtype.itemsize, n.op) for n in low.reads]
        outs = [(list(n.shape), n.dtype.name, n.numel * n.dtype.itemsize, n.op) for n in low.outputs]
        nbytes = sum(r[2] for r in reads) + sum(o[2] for o in outs)
        extras = {k: (v if isinstance(v, (int, float, str, bool)) else repr(v)[:80])
                  for k, v in dict(spec.extras).items()}
        rows.append({
            "name": spec.name, "template": spec.template, "vec": spec.vec,
            "spec_block": spec.block, "size_class": spec.size_class,
            "index_type": spec.index_type, "extras": extras,
            "grid": launch.grid if launch else None, "block": launch.block if launch else None,
            "shared": launch.shared_bytes if launch else None,
            "zeroed": [list(z) for z in launch.zeroed] if launch else None,
            "numel": low.numel, "grid_items": low.grid_items,
            "reads": reads, "outputs": outs, "bytes": nbytes,
            # ids of the buffers (one process): who reads a value again
            "read_ids": [id(n) for n in low.reads], "out_ids": [id(n) for n in low.outputs],
            "kind": group.kind,
            "nodes": [node_text(n) for n in group.nodes if n.op not in ("expand",)][:40],
            "reasons": [str(r) for r in getattr(group, "reasons", ())][:3],
        })
        if options.sources and spec.name not in sources:
            from flame.codegen.render import render

            sources[spec.name] = render(spec)
    with open(options.json, "w") as file:
        json.dump(rows, file, indent=1)
    if options.sources:
        os.makedirs(options.sources, exist_ok=True)
        for name, text in sources.items():
            with open(os.path.join(options.sources, name + ".cu"), "w") as file:
                file.write(text)
    print(f"{len(rows)} kernels -> {options.json}; planned bytes of all FLAME kernels "
          f"{sum(r['bytes'] for r in rows) / 1e9:.2f} GB "
          f"({sum(r['bytes'] for r in rows) / BANDWIDTH * 1e3:.2f} ms at 3.0 TB/s)", file=sys.stderr)
    if options.inspect:
        inspect(result.graph, lowered, options.inspect)
    if options.profile:
        report(rows, options.profile)


def inspect(graph, lowered, fragments, limit=3):
    """For groups whose kernel name holds a fragment: the group (or library op) writing each
    value it reads, and the groups reading each value it writes."""
    from flame.ir.ops import get_op

    names = {id(group): low.spec.name for group, low in lowered}
    writer, readers = {}, defaultdict(list)
    for group in graph.groups:
        label = names.get(id(group)) or f"library:{group.nodes[0].op}"
        for node in group.outputs:
            writer[id(node)] = label
        for node in group.nodes:
            for child in node.inputs:
                readers[id(child)].append(label)
    shown = defaultdict(int)
    for group, low in lowered:
        name = low.spec.name
        if not any(f in name for f in fragments) or shown[name] >= limit:
            continue
        shown[name] += 1
        print("##", name, file=sys.stderr)
        for node in low.reads:
            print("   reads", node_text(node), "<-", writer.get(id(node), "input"),
                  [node_text(c) for c in node.inputs][:3], file=sys.stderr)
        for node in low.outputs:
            seen = sorted(set(readers.get(id(node), [])))
            print("   writes", node_text(node), "->", seen[:6], file=sys.stderr)
            # also readers through views (library calls read views of it)
            for other in graph.groups:
                for member in other.nodes:
                    for child in member.inputs:
                        if get_op(child.op).kind == "movement" and child.inputs and child.inputs[0] is node:
                            print("      via", node_text(child), "->",
                                  names.get(id(other)) or f"library:{other.nodes[0].op}", file=sys.stderr)


def report(rows, profile_path, minimum=50.0):
    profile = json.load(open(profile_path))["flame"]["kernels"]
    by_name = defaultdict(list)
    for row in rows:
        by_name[row["name"]].append(row)
    total = 0.0
    for us, count, name in sorted(profile, reverse=True):
        if not name.startswith("flame_") or us <= minimum:
            continue
        found = by_name.get(name, [])
        if not found:
            print(f"{us:8.1f} {count:3d} {us / count:7.2f} us  (not in the CPU plan) {name}")
            continue
        nbytes = sum(r["bytes"] for r in found) / len(found)
        floor = nbytes / BANDWIDTH * 1e6
        total += us - floor * count
        r = found[0]
        print(f"{us:8.1f} {count:3d}/{len(found):3d} {us / count:7.2f} us floor {floor:6.2f} "
              f"({100 * floor / (us / count):5.1f}%) {nbytes / 1e6:7.2f} MB {r['template']} "
              f"vec{r['vec']} blk{r['block']} grid{r['grid']} [{r['size_class']}] {name}")
    print(f"time above floor: {total / 1000:.2f} ms")


if __name__ == "__main__":
    main()
