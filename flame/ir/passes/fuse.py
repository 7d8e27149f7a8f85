"""Elementwise fusion: group the graph into kernels.

Afterwards: ``graph.groups`` lists kernels in an order that respects their dependencies, and
every computed node of the graph is in at least one group. A group iterates over one shape
and writes its ``outputs``; everything else it computes lives in registers.

The rules:

1. A value is *materialized* (written to memory) when it is a graph output, or when it is a
   computed value that a larger tensor broadcasts and recomputing it per element would cost
   more than ``RECOMPUTE_LIMIT`` ops. Smaller broadcast computations are recomputed inside the
   consumer's kernel: an extra kernel launch costs more than a few ops per element.
2. Materialized values of the same shape share one kernel (several outputs), so work they
   share is computed once. Values of different shapes get one kernel per shape.
3. A kernel reads materialized values of other kernels from memory, never recomputes them:
   every realized value is computed exactly once.
"""

from __future__ import annotations

import graphlib

from flame.ir.graph import Graph, Group, is_input
from flame.ir.node import Node
from flame.ir.ops import get_op

RECOMPUTE_LIMIT = 8


def _computed_size(root: Node, stops: set[int]) -> int:
    """Number of elementwise ops under ``root`` that a kernel would recompute."""
    count = 0
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen or is_input(node) or (node is not root and id(node) in stops):
            continue
        seen.add(id(node))
        if node.inputs and node.op != "expand":
            count += 1
        stack.extend(node.inputs)
    return count


def _materialized(graph: Graph) -> tuple[dict[int, Node], dict[int, str]]:
    chosen = {id(node): node for node in graph.outputs if not is_input(node)}
    reasons: dict[int, str] = {id(node): "graph output" for node in chosen.values()}
    for node in graph.nodes:
        if get_op(node.op).kind != "library":
            continue
        chosen[id(node)] = node
        reasons.setdefault(id(node), f"{node.op} runs as a library call")
        for child in node.inputs:
            if not is_input(child) and id(child) not in chosen:
                chosen[id(child)] = child
                reasons[id(child)] = f"input of {node.op}, which reads memory"
    for node in graph.nodes:  # inputs first, so inner broadcasts are decided before outer ones
        if node.op != "expand":
            continue
        source = node.inputs[0]
        if is_input(source) or id(source) in chosen:
            continue
        cost = _computed_size(source, set(chosen))
        if cost > RECOMPUTE_LIMIT:
            chosen[id(source)] = source
            ratio = node.numel // max(source.numel, 1)
            reasons[id(source)] = (
                f"broadcast of {cost} ops would be recomputed {ratio}x: written once instead"
            )
    return chosen, reasons


def _members(roots: list[Node], materialized: dict[int, Node]) -> list[Node]:
    root_ids = {id(root) for root in roots}
    members: dict[int, Node] = {}
    stack = list(roots)
    while stack:
        node = stack.pop()
        if id(node) in members or is_input(node):
            continue
        if id(node) in materialized and id(node) not in root_ids:
            continue
        members[id(node)] = node
        stack.extend(node.inputs)
    return list(members.values())


def _order_groups(groups: list[Group], materialized: dict[int, Node]) -> list[Group] | None:
    """Kernels in dependency order, or None when merging made a cycle."""
    producer = {id(out): index for index, group in enumerate(groups) for out in group.outputs}
    # graphlib (stdlib) rather than networkx: this runs on every new plan, and importing
    # networkx costs about a second in a fresh process.
    dependencies = graphlib.TopologicalSorter({index: set() for index in range(len(groups))})
    for index, group in enumerate(groups):
        for node in group.nodes:
            for child in node.inputs:
                source = producer.get(id(child))
                if source is not None and source != index and id(child) in materialized:
                    dependencies.add(index, source)
    try:
        dependencies.prepare()
    except graphlib.CycleError:
        return None
    order = []
    while dependencies.is_active():
        ready = sorted(dependencies.get_ready())  # deterministic: lowest group first
        order.extend(ready)
        dependencies.done(*ready)
    return [groups[index] for index in order]


def _build_groups(graph, buckets, materialized, reasons) -> list[Group]:
    groups = []
    position = {id(node): index for index, node in enumerate(graph.nodes)}
    for roots in buckets:
        members = sorted(_members(roots, materialized), key=lambda node: position[id(node)])
        outputs = tuple(sorted(roots, key=lambda node: position[id(node)]))
        why = tuple(f"{reasons[id(root)]}" for root in outputs)
        groups.append(Group("elementwise", tuple(members), outputs, why))
    return groups


def _library_group(node: Node, reasons) -> Group:
    return Group("library", (node,), (node,), (reasons[id(node)],))


def fuse(graph: Graph) -> Graph:
    materialized, reasons = _materialized(graph)
    by_shape: dict[tuple, list[Node]] = {}
    library = []
    for node in graph.nodes:
        if id(node) not in materialized:
            continue
        if get_op(node.op).kind == "library":
            library.append(_library_group(node, reasons))
        else:
            by_shape.setdefault(node.shape, []).append(node)
    kernels = _build_groups(graph, list(by_shape.values()), materialized, reasons)
    groups = _order_groups(kernels + library, materialized)
    if groups is None:  # merging same-shape values closed a cycle: one kernel per value
        singles = [
            [node] for node in graph.nodes
            if id(node) in materialized and get_op(node.op).kind != "library"
        ]  # fmt: skip
        kernels = _build_groups(graph, singles, materialized, reasons)
        groups = _order_groups(kernels + library, materialized)
    return Graph(graph.outputs, graph.name, tuple(groups))
