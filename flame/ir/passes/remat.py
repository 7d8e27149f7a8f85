"""Save or recompute: which values that several kernels need are written to memory once
("saved") and which each kernel recomputes from what it reads, chosen by a minimum cut.

Forward and backward are one schedule here (``flame.compile`` traces a training step as one
joint graph), so "saved for the backward" means "written by the kernel that computes it and
read by the later kernels that need it". The fusion pass writes what must be written (graph
outputs, library calls and their inputs, reductions other kernels read, ...; fuse.py) and
lets every kernel recompute any other value it needs from those. A value that more than one
kernel computes is the decision this pass makes, over the fused plan:

* reading a value that is in memory anyway (an input, a library result, a reduction, an
  output) costs its bytes once in each kernel that reads it;
* saving a value costs one write (in the first kernel that computes it) and one read in
  each later kernel that needs it;
* recomputing it costs reading the in-memory values its recomputation needs, in each later
  kernel that would not read them anyway (layer norm's backward reads x anyway, so
  recomputing x - mean there is free).

As a flow network (AOTAutograd's ``min_cut_rematerialization_partition``, with FLAME's kernel
boundaries in place of its forward/backward split): every shared value ``v`` is an edge
``v_in -> v_out`` whose capacity is the cost of saving it (movement ops cannot be saved: a
view is saved as its source); every in-memory value ``m`` that a recomputation reads is an
edge ``source -> m_in -> m_out`` whose capacity is what the later kernels would read of it
for recomputation only; data flows along infinite edges; a shared value that a later kernel
uses is joined to the sink. A minimum cut is the cheapest set of values to read: cut value
edges are saved, cut input edges are re-read and recomputed from. Values that cannot be
recomputed (library calls, reductions other kernels read) are in memory already and are
never a question. Random numbers are counter-based (Philox keyed by seed and element), so
recomputing them reproduces them exactly: they are recomputed like any other value.

The cut works on one plan's kernel boundaries, and saving a value can move boundaries (a
value written joins a kernel of its shape). So the pass fuses again with the cut's saves,
counts the bytes both plans move and keeps the cheaper one; the dump shows both numbers.
Graphs where no value is computed by two kernels skip the cut.
"""

from __future__ import annotations

from flame.ir.graph import Graph, Group, Remat, is_input
from flame.ir.node import Node
from flame.ir.ops import get_op
from flame.ir.passes.fuse import fuse
from flame.ir.passes.library_views import library_view
from flame.ir.shapes import prod
from flame.ir.views import MOVEMENT_OPS


def remat(graph: Graph) -> Graph:
    if not graph.groups:
        return graph
    shared = Shared(graph)
    if not shared.needed:  # no later kernel recomputes anything: nothing to decide
        return Graph(graph.outputs, graph.name, graph.groups, Remat())
    return decide(graph, shared, shared.refine(shared.min_cut()))


def decide(graph: Graph, shared: Shared, saves: dict[int, Node]) -> Graph:
    """The plan with ``saves`` written when, fused again, it moves fewer bytes in no more
    kernels than ``graph``'s; else ``graph``'s plan. Both numbers are recorded."""
    entries = shared.explain(saves)
    saved = tuple(entry for entry in entries if id(entry[0]) in saves)
    recomputed = tuple(entry for entry in entries if id(entry[0]) not in saves)
    before = (planned_bytes(graph), len(graph.groups))
    if not saves:
        return Graph(graph.outputs, graph.name, graph.groups, Remat((), recomputed, before))
    refused = fuse(
        Graph(graph.outputs, graph.name),
        tuple((node, _reason(save, again), shared.anchor(node)) for node, save, again, _ in saved),
    )
    after = (planned_bytes(refused), len(refused.groups))
    if after[0] < before[0] and after[1] <= before[1]:
        decision = Remat(saved, recomputed, before, after, kept=True)
        return Graph(graph.outputs, graph.name, refused.groups, decision)
    # fused, the cut's saves move more bytes or add kernels: keep the plan that recomputes
    decision = Remat(saved, shared.explain({}), before, after, kept=False)
    return Graph(graph.outputs, graph.name, graph.groups, decision)


def _reason(save: int, again: int) -> str:
    return (
        f"saved for later kernels (min-cut: {format_bytes(save)} written+read instead of "
        f"{format_bytes(again)} to recompute)"
    )


class Shared:
    """The values of a fused plan that more than one kernel computes, and what each kernel
    reads from memory."""

    def __init__(self, graph: Graph):
        self.graph = graph
        groups = graph.groups
        written = {id(out) for group in groups for out in group.outputs}
        self.nodes = {id(node): node for node in graph.nodes}
        kernels: dict[int, list[int]] = {}
        for index, group in enumerate(groups):
            if group.kind == "library":
                continue
            for node in group.nodes:
                if id(node) not in written and not is_input(node):
                    kernels.setdefault(id(node), []).append(index)
        self.kernels = {key: found for key, found in kernels.items() if len(found) > 1}
        # which kernels read each in-memory value, and whether only to recompute shared ones
        self.reads: dict[tuple[int, int], bool] = {}  # (kernel, value) -> recompute only
        self.needed: dict[int, set[int]] = {}  # shared value -> later kernels using it
        for index, group in enumerate(groups):
            if group.kind == "library":
                continue
            members = {id(node) for node in group.nodes}
            for node in group.nodes:
                # a value this kernel computes anyway, or only for what a later kernel needs
                later = id(node) in self.kernels and self.kernels[id(node)][0] != index
                for child in node.inputs:
                    if id(child) not in members:
                        key = (index, id(child))
                        self.reads[key] = self.reads.get(key, True) and later
                        self.nodes.setdefault(id(child), child)
                    elif not later and self.kernels.get(id(child), [index])[0] != index:
                        self.needed.setdefault(id(child), set()).add(index)
        self.rereads: dict[int, int] = {}  # value -> kernels reading it only to recompute
        for (_, key), only in self.reads.items():
            self.rereads[key] = self.rereads.get(key, 0) + only

    def later(self, key: int) -> list[int]:
        return self.kernels[key][1:]

    def min_cut(self) -> dict[int, Node]:
        """The shared values to save: a minimum cut between the in-memory values and the
        shared values later kernels use."""
        from flame.ir.passes.maxflow import minimum_cut

        edges = []  # (u, v, capacity); None is infinite
        # bytes are scaled and every save costs one more unit: on a tie, recompute
        scale = len(self.kernels) + 1
        for key, kernels in self.kernels.items():
            node = self.nodes[key]
            if _savable(node):
                save = _size(node) * len(kernels) * scale + 1
                edges.append((("in", key), ("out", key), save))
            else:
                edges.append((("in", key), ("out", key), None))
            for child in node.inputs:
                if id(child) not in self.kernels:  # in memory: read to recompute
                    edges.append(("source", ("in", id(child)), None))
                    reread = _size(child) * self.rereads.get(id(child), 0) * scale
                    edges.append((("in", id(child)), ("out", id(child)), reread))
                edges.append((("out", id(child)), ("in", key), None))
        for key in self.needed:
            edges.append((("out", key), "sink", None))
        if not any(u == "source" for u, _, _ in edges):
            return {}
        _, reachable = minimum_cut(edges, "source", "sink")
        return {
            key: self.nodes[key]
            for key in self.kernels
            if ("in", key) in reachable and ("out", key) not in reachable
        }

    def refine(self, saves: dict[int, Node]) -> dict[int, Node]:
        """The cut prices an in-memory value once for all later kernels that read it to
        recompute; per kernel, saving one more value can still be cheaper than the reads
        only it needs. Save such values, the best first, while one is found."""
        saves = dict(saves)
        for _ in range(len(self.kernels)):
            gains = [
                (again - common - save, id(node))
                for node, save, again, common in self.explain(saves)
                if id(node) not in saves and _savable(node)
            ]
            gain, key = max(gains, default=(0, None))
            if gain <= 0:
                break
            saves[key] = self.nodes[key]
        return saves

    def explain(self, saves) -> tuple[tuple[Node, int, int, int], ...]:
        """``(value, save, recompute, shared)`` for each value later kernels use (a view as
        its source), or each saved value: ``save`` is one write and a read per later kernel;
        ``recompute`` what those kernels would read only to recompute it, from memory or
        from saved values, of which ``shared`` they read to recompute other values too."""
        values: dict[int, Node] = {}
        for key in list(self.needed) + list(saves):
            node = self.nodes[key]
            while node.op in MOVEMENT_OPS and id(node.inputs[0]) in self.kernels:
                node = node.inputs[0]
            if node.inputs and node.op not in MOVEMENT_OPS:
                values[id(node)] = node
        sources = {key: self._sources(node, saves) for key, node in values.items()}
        users: dict[tuple[int, int], int] = {}  # (kernel, source) -> values recomputed from it
        for key, found in sources.items():
            if key not in saves:
                for index in self.later(key):
                    for source in found:
                        users[(index, source)] = users.get((index, source), 0) + 1
        result = []
        for key, node in values.items():
            alone = common = 0
            for index in self.later(key):
                for source in sources[key]:
                    if source in saves or self.reads.get((index, source), False):
                        size = _size(self.nodes[source])
                        if users.get((index, source), 0) > 1:
                            common += size
                        else:
                            alone += size
            save = _size(node) * (1 + len(self.later(key)))
            result.append((node, save, alone + common, common))
        order = {id(node): index for index, node in enumerate(self.graph.nodes)}
        return tuple(sorted(result, key=lambda entry: order[id(entry[0])]))

    def _sources(self, node: Node, saves) -> set[int]:
        """What recomputing ``node`` reads: in-memory values and saved values below it."""
        found: set[int] = set()
        stack, seen = list(node.inputs), set()
        while stack:
            value = stack.pop()
            if id(value) in seen:
                continue
            seen.add(id(value))
            if id(value) in self.kernels and id(value) not in saves:
                stack.extend(value.inputs)
            else:
                found.add(id(value))
        return found

    def anchor(self, node: Node) -> Node | None:
        """A value written by the first kernel computing ``node`` that needs it: saved,
        ``node`` joins that kernel (one more write there, not one more kernel)."""
        group: Group = self.graph.groups[self.kernels[id(node)][0]]
        members = {id(member) for member in group.nodes}
        for root in group.outputs:
            stack, seen = [root], set()
            while stack:
                value = stack.pop()
                if value is node:
                    return root
                if id(value) not in seen and id(value) in members:
                    seen.add(id(value))
                    stack.extend(value.inputs)
        return None


def _savable(node: Node) -> bool:
    return node.op not in MOVEMENT_OPS and get_op(node.op).kind in ("elementwise", "reduce")


def _size(node: Node) -> int:
    return prod(node.shape) * node.dtype.itemsize


def planned_bytes(graph: Graph) -> int:
    """Bytes a fused plan moves if every kernel reads each value it reads once and writes
    each of its outputs once (as the dump's per-kernel bytes count them)."""
    total = 0
    for group in graph.groups:
        if group.kind == "library":
            node = group.nodes[0]
            for child in node.inputs:
                view = library_view(child)
                total += _size(view[0] if view else child)
            total += _size(node)
            continue
        members = {id(node) for node in group.nodes}
        reads = {
            id(child): child
            for node in group.nodes
            for child in node.inputs
            if id(child) not in members
        }  # fmt: skip
        total += sum(_size(child) for child in reads.values())
        total += sum(_size(out) for out in group.outputs)
    return total


def format_bytes(count: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"
