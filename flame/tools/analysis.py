"""What the dump says about a graph and its kernels, derived from the processed graph alone:
why each kernel boundary exists, what each kernel moves, how it would be launched, what
NVRTC's ptxas says about its resources, and why a plan or a kernel missed its cache."""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass

from flame.ir.graph import Graph, Group, is_input
from flame.ir.node import format_site
from flame.ir.ops import get_op
from flame.ir.printer import format_type, format_value
from flame.ir.shapes import prod

H100_MULTIPROCESSORS = 132  # launch shapes shown without a GPU assume an H100 SXM


# -- fusion boundaries --------------------------------------------------------------------


def group_label(group: Group) -> str:
    """What a kernel iterates over: a shape, or the rows of a reduction."""
    if group.kind == "library":
        return f"{group.nodes[0].op} -> {format_type(group.outputs[0])}"
    if group.kind == "reduce":
        for node in group.nodes:
            if get_op(node.op).kind == "reduce":
                axes = list(node.attr("axes"))
                return f"rows of {format_type(node.inputs[0])} over axes {axes}"
    return format_type(group.outputs[0])


def group_dependencies(graph: Graph) -> list[set[int]]:
    """Per group: the groups whose written values it reads."""
    producer = {id(out): index for index, group in enumerate(graph.groups) for out in group.outputs}
    needs: list[set[int]] = []
    for index, group in enumerate(graph.groups):
        found = set()
        for node in group.nodes:
            for child in node.inputs:
                source = producer.get(id(child))
                if source is not None and source != index:
                    found.add(source)
        if group.kind == "library":  # a library call may read its input through a view
            for child in group.nodes[0].inputs:
                source = _library_source(child, producer)
                if source is not None and source != index:
                    found.add(source)
        needs.append(found)
    return needs


def _library_source(node, producer):
    while id(node) not in producer and node.inputs and not is_input(node):
        node = node.inputs[0]
    return producer.get(id(node))


def boundary_reasons(graph: Graph) -> list[list[str]]:
    """Per group, why it is a kernel of its own: why each value it writes goes to memory
    (recorded by the fusion pass), and why it is not merged with an earlier kernel of the
    same shape or row key."""
    from flame.ir.printer import node_names

    names = node_names(graph)
    needs = group_dependencies(graph)
    labels = [(group.kind, group_label(group)) for group in graph.groups]
    result = []
    for index, group in enumerate(graph.groups):
        reasons = []
        why = list(group.reasons) if len(group.reasons) == len(group.outputs) else []
        for position, output in enumerate(group.outputs):
            reason = why[position] if why else "value written by this kernel"
            reasons.append(f"writes {names[id(output)]}: {reason}")
        for earlier in range(index):
            if labels[earlier] != labels[index] or group.kind == "library":
                continue
            path = _path(needs, index, earlier)
            if path:
                chain = " <- ".join(f"k{step}" for step in path)
                reasons.append(
                    f"apart from k{earlier} (same {labels[index][1]}): it needs k{earlier}'s "
                    f"results first ({chain})"
                )
            else:
                reasons.append(
                    f"apart from k{earlier} (same {labels[index][1]}): merged, they would wait "
                    "on each other (a dependency cycle) or read a value through a view"
                )
        result.append(reasons)
    return result


def _path(needs: list[set[int]], start: int, goal: int) -> list[int]:
    """Groups from ``start`` back to ``goal`` through what each reads; [] if none."""
    stack = [(start, [start])]
    seen = set()
    while stack:
        index, path = stack.pop()
        if index == goal:
            return path
        if index in seen:
            continue
        seen.add(index)
        stack.extend((source, path + [source]) for source in sorted(needs[index]))
    return []


# -- save or recompute ----------------------------------------------------------------------


def remat_lines(graph: Graph) -> list[str]:
    """What the save-or-recompute pass decided (passes/remat.py), for the dump: the values
    written for later kernels and the values later kernels recompute, with the bytes the
    min-cut compared, and the planned bytes of the plan with and without its saves."""
    from flame.ir.passes.remat import format_bytes as size
    from flame.ir.printer import node_names

    decision = graph.remat
    if decision is None or graph.groups is None or len(graph.groups) < 2:
        return []  # not planned by the pipeline, or one kernel: nothing to share
    if not decision.saved and not decision.recomputed:
        return ["save/recompute: no value is computed by more than one kernel (no min-cut)"]
    names = node_names(graph)
    writer = {id(out): index for index, group in enumerate(graph.groups) for out in group.outputs}
    computing: dict[int, list[int]] = {}
    reading: dict[int, list[int]] = {}
    for index, group in enumerate(graph.groups):
        members = {id(node) for node in group.nodes}
        for node in group.nodes:
            computing.setdefault(id(node), []).append(index)
            for child in node.inputs:
                if id(child) not in members and index not in reading.get(id(child), []):
                    reading.setdefault(id(child), []).append(index)
    lines = [_remat_headline(decision)]
    for node, save, again, _ in decision.saved:
        name = names[id(node)]
        if decision.kept:
            lines.append(
                f"saved {name} (written by k{writer[id(node)]}, read by "
                f"{_kernels(reading.get(id(node), []))}): {size(save)} written+read instead of "
                f"{size(again)} to recompute"
            )
        else:
            lines.append(
                f"not saved {name}: the cut chose {size(save)} written+read over {size(again)} "
                "to recompute, but the fused plan moves more with it"
            )
    for node, save, again, common in decision.recomputed:
        also = f" ({size(common)} of it read for other values too)" if common else ""
        lines.append(
            f"recomputed {names[id(node)]} in {_kernels(computing.get(id(node), []))}: "
            f"{size(again)} extra read to recompute{also} instead of {size(save)} written+read"
        )
    return lines


def _remat_headline(decision) -> str:
    from flame.ir.passes.remat import format_bytes

    def plan(numbers) -> str:
        return f"{numbers[0]:,} bytes in {numbers[1]} kernels"

    if decision.with_saves is None:
        return f"save/recompute (min-cut): nothing saved; the plan moves {plan(decision.without)}"
    if decision.kept:
        less = format_bytes(decision.without[0] - decision.with_saves[0])
        return (
            f"save/recompute (min-cut): saves kept: the plan moves {plan(decision.with_saves)} "
            f"with them, {plan(decision.without)} without ({less} less)"
        )
    return (
        f"save/recompute (min-cut): the cut's saves were not kept: with them the plan would "
        f"move {plan(decision.with_saves)}, without them {plan(decision.without)}"
    )


def _kernels(indices) -> str:
    return ", ".join(f"k{index}" for index in indices)


# -- bytes, launch shape, resources ----------------------------------------------------------


def _size(node) -> int:
    return prod(node.shape) * node.dtype.itemsize


def kernel_bytes(lowered) -> int:
    """Bytes a kernel reads and writes if it touches every operand once: the buffers it
    reads (whole, even when it reads a view of one) and the values it writes."""
    reads = {id(node): node for node in lowered.reads}
    return sum(_size(node) for node in reads.values()) + sum(_size(n) for n in lowered.outputs)


def library_bytes(node) -> int:
    return sum(_size(child) for child in node.inputs) + _size(node)


def launch_shape(lowered) -> tuple[int, int, str]:
    """(grid, block, note) as the executor computes them (flame/runtime/launch.py)."""
    from flame.runtime.device import gpu_available
    from flame.runtime.launch import BLOCKS_PER_SM

    spec = lowered.spec
    threads = lowered.threads or spec.block
    if lowered.grid_items:
        return max(1, min(lowered.grid_items, 2**31 - 1)), threads, "planned, not run"
    trip_count = lowered.numel // spec.vec if spec.vec > 1 else lowered.numel
    if gpu_available():
        from flame.runtime.device import device_info

        multiprocessors, note = device_info().multiprocessors, "planned, not run"
    else:
        multiprocessors = H100_MULTIPROCESSORS
        note = f"planned for {H100_MULTIPROCESSORS} SMs (an H100); no GPU, not run"
    cap = multiprocessors * BLOCKS_PER_SM
    return max(1, min(-(-trip_count // spec.block), cap)), spec.block, note


_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")
_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)  # fmt: skip


def parse_ptxas_log(log: str) -> dict | None:
    """Registers, barriers, shared memory, stack and spills from ``ptxas -v`` lines."""
    used, frame = _USED.search(log), _FRAME.search(log)
    if used is None:
        return None
    resources = {
        "registers": int(used.group(1)),
        "barriers": int(used.group(2) or 0),
        "shared": int(used.group(3) or 0),
    }
    if frame is not None:
        resources["stack"] = int(frame.group(1))
        resources["spill_stores"] = int(frame.group(2))
        resources["spill_loads"] = int(frame.group(3))
    return resources


def compile_with_resources(source: str, name: str, arch: str) -> tuple:
    """Compile with NVRTC and ``--ptxas-options=-v``: ``(resources | None, note, seconds)``.
    Needs NVRTC only, not a GPU. When a number is unavailable the note says why."""
    try:
        from cupy.cuda import nvrtc

        from flame.runtime.compiler import OPTIONS
    except Exception as error:
        return None, f"NVRTC unavailable ({type(error).__name__}: {error})", None
    start = time.perf_counter()
    try:
        program = nvrtc.createProgram(source, f"{name}.cu", [], [])
    except Exception as error:
        return None, f"NVRTC unavailable ({type(error).__name__}: {error})", None
    try:
        options = [f"--gpu-architecture={arch}", *OPTIONS, "--ptxas-options=-v"]
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError:
            log = nvrtc.getProgramLog(program)
            return None, f"NVRTC FAILED to compile it:\n{log}", time.perf_counter() - start
        log = nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)
    seconds = time.perf_counter() - start
    resources = parse_ptxas_log(log)
    if resources is None:
        return None, f"ptxas printed no resource usage (log: {log.strip()[:200]!r})", seconds
    return resources, f"ptxas -v for {arch}", seconds


# -- cache reasons ----------------------------------------------------------------------------


def plan_signature(graph: Graph) -> tuple:
    """(operations, input types, full text) of a processed graph, to explain plan misses."""
    from flame.ir.printer import format_graph

    operations = tuple(
        (node.op, tuple((k, v) for k, v in node.attrs if k not in _SHAPE_ATTRS))
        for node in graph.nodes
        if not is_input(node)
    )
    inputs = tuple(format_type(node) for node in graph.nodes if is_input(node))
    return operations, inputs, _strip_sites(format_graph(graph))


_SHAPE_ATTRS = ("shape", "sizes", "size", "starts", "stops", "stop", "start")


def _strip_sites(text: str) -> str:
    return "\n".join(line.split("  #")[0].rstrip() for line in text.splitlines())


def miss_reason(signature: tuple, earlier: list[tuple[int, tuple]]) -> str:
    """Why a new plan was built, given the signatures of the graphs planned before it."""
    operations, inputs, text = signature
    for index, (other_ops, other_inputs, other_text) in reversed(earlier):
        if other_ops != operations:
            continue
        if other_inputs != inputs:
            changed = [
                f"%{position}: {old} -> {new}"
                for position, (old, new) in enumerate(zip(other_inputs, inputs))
                if old != new
            ]
            return f"new input types or sizes since graph {index}: " + ", ".join(changed)
        if other_text != text:
            return f"same operations as graph {index} with other sizes or attribute values"
        return (
            f"same graph and input types as graph {index}: an input's layout (strides, "
            "alignment) differs, or the plan was evicted from the plan cache"
        )
    return "first graph of this structure in this process"


_CODE_FIELDS = ("index_type", "vec", "block", "helpers", "setup", "prologue", "body", "epilogue")


def spec_difference(spec, earlier: list[tuple[str, object, int]]) -> str:
    """Why a kernel missed the cache: what separates its code from the nearest earlier kernel
    of the same operations, or that no kernel of these operations was seen before."""
    stem = spec.name.rsplit("_", 1)[0]
    for name, other, graph_index in reversed(earlier):
        if name.rsplit("_", 1)[0] != stem or name == spec.name:
            continue
        changed = [f for f in _CODE_FIELDS if getattr(other, f) != getattr(spec, f)]
        scalars = [f for f in changed if not isinstance(getattr(spec, f), tuple)]
        lines = [f for f in changed if f not in scalars][:1]  # the first code change is enough
        differences = [_describe_change(f, getattr(other, f), getattr(spec, f)) for f in scalars]
        theirs = [f"{arg.ctype} {arg.name}" for arg in other.params]
        ours = [f"{arg.ctype} {arg.name}" for arg in spec.params]
        if theirs != ours:
            added = [p for p in ours if p not in theirs] + [
                f"no {p}" for p in theirs if p not in ours
            ]
            differences.append("parameters " + ", ".join(_clip(p, 40) for p in added[:3]))
        differences += [_describe_change(f, getattr(other, f), getattr(spec, f)) for f in lines]
        extras = sorted(k for k in set(spec.extras) | set(other.extras) if
                        spec.extras.get(k) != other.extras.get(k))  # fmt: skip
        differences += [f"{key} changed" for key in extras]
        found = "; ".join(differences) or "code generated differently"
        return f"new code: same operations as {name} (graph {graph_index}), but {found}"
    return (
        "no cubin for this code, arch, NVRTC version, options and FLAME version in the disk "
        "cache (first compile of these operations, or the cache was cleared)"
    )


def _short(value) -> str:
    return format_value(value) if not isinstance(value, str) else value


def _clip(line: str, width: int = 60) -> str:
    line = line.strip()
    return line if len(line) <= width else line[: width - 3] + "..."


def _describe_change(field: str, old, new) -> str:
    if not isinstance(old, tuple):
        return f"{field} {_short(old)} -> {_short(new)}"
    for position, (before, after) in enumerate(zip(old, new)):
        if before != after:
            return f"{field} line {position + 1}: {_clip(before)!r} -> {_clip(after)!r}"
    return f"{field}: {len(old)} -> {len(new)} lines"


# -- the picture's data -----------------------------------------------------------------------


@dataclass
class GraphPicture:
    """Plain data for drawing a processed graph: nodes, edges and fusion groups."""

    nodes: list[dict]  # id, name, op, type, site, input (bool), groups (indices)
    edges: list[tuple[str, str]]
    groups: list[dict]  # index, kind, label, nodes (ids), outputs (ids)

    @classmethod
    def of(cls, graph: Graph, names: dict[int, str]) -> GraphPicture:
        ids: dict[int, str] = {}
        nodes = []
        for position, node in enumerate(graph.nodes):
            if node.op == "const" and node.shape == ():
                continue  # printed inline in its readers' IR, not drawn
            ids[id(node)] = f"v{position}"
            nodes.append({
                "id": f"v{position}",
                "name": names[id(node)],
                "op": "input" if is_input(node) else node.op,
                "type": format_type(node),
                "site": format_site(node.site) if node.site is not None else "",
                "input": is_input(node),
                "groups": [],
            })  # fmt: skip
        by_id = {node["id"]: node for node in nodes}
        groups = []
        for index, group in enumerate(graph.groups or ()):
            members = [ids[id(n)] for n in group.nodes if id(n) in ids]
            for member in members:
                by_id[member]["groups"].append(index)
            groups.append({
                "index": index, "kind": group.kind, "label": group_label(group),
                "nodes": members, "outputs": [ids[id(n)] for n in group.outputs if id(n) in ids],
            })  # fmt: skip
        edges = [
            (ids[id(child)], ids[id(node)])
            for node in graph.nodes if id(node) in ids and not is_input(node)
            for child in node.inputs if id(child) in ids
        ]  # fmt: skip
        return cls(nodes, edges, groups)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
