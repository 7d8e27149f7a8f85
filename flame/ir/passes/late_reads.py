"""Values a library call reads again much later are computed again there, not kept.

A library call (a matmul, a convolution) reads its operands from memory, so fusion writes
them (materialize.py). When the same value is read once in the forward pass and again in the
backward -- a DiT block's GELU output feeds its second linear layer, and that layer's weight
gradient reads it again -- it stays in memory all the time between: twelve DiT-S/2 blocks at
batch 64 kept 12 x 48 MiB of GELU outputs beside the matmul outputs they are computed from,
which the GELU's own gradient keeps anyway.

This pass gives the late reads a copy of the value's computation: a chain of at most
``RECOMPUTE_LIMIT`` elementwise ops over *sources* (inputs, library results, reductions) that
are alive at the late read anyway, or nearly. The copy is written where the late reader
needs it (fused into the kernel that already reads those sources there: the GELU's gradient),
and the original is freed after its last early read. It trades one write of the value for
the memory it held across the gap. H100, DiT-S/2 b64 step: captured-graph memory 3,360 ->
3,108 MB (torch.compile 3,165), step 14.55-14.68 -> 14.94-14.95 ms; the UNet's step plans
1,267 -> 1,251 MiB.

A copy is made when the value is at least ``MIN_BYTES`` and the memory it frees (bytes times
the gap, in node positions) is at least ``GAIN_OVER_COST`` times what keeping its sources
longer would cost. Positions are those of the topological order, a proxy for time. Run after
``cse`` (which would merge the copy back) and before ``fuse``.
"""

from __future__ import annotations

from flame.ir.graph import Graph, is_input
from flame.ir.infer import make_node
from flame.ir.node import Node, Token
from flame.ir.ops import get_op
from flame.ir.passes.cost import RECOMPUTE_LIMIT
from flame.ir.passes.rewrite import with_inputs
from flame.ir.views import MOVEMENT_OPS

ENABLED = True
MIN_BYTES = 1 << 20  # smaller values are not worth a second kernel output
GAIN_OVER_COST = 2  # freed bytes x positions over the extra bytes x positions sources live
MIN_GAP = 64  # positions between the last early read and the first late one


def late_reads(graph: Graph) -> Graph:
    if not ENABLED:
        return graph
    nodes = graph.nodes
    position = {id(node): index for index, node in enumerate(nodes)}
    end = len(nodes)
    uses: dict[int, list[tuple[int, Node, int, tuple[Node, ...]]]] = {}
    for node in nodes:
        if node.op in MOVEMENT_OPS:
            continue
        for index, child in enumerate(node.inputs):
            path = []
            while child.op in MOVEMENT_OPS and child.inputs and not is_input(child):
                path.append(child)
                child = child.inputs[0]
            uses.setdefault(id(child), []).append(
                (position[id(node)], node, index, tuple(reversed(path)))
            )  # fmt: skip
    for output in graph.outputs:
        base = output
        while base.op in MOVEMENT_OPS and base.inputs and not is_input(base):
            base = base.inputs[0]
        uses.setdefault(id(base), []).append((end, None, -1, ()))
    last_use = {key: max(use[0] for use in found) for key, found in uses.items()}
    keeper: dict[int, Node] = {}  # per value, the op of its size that keeps it longest
    for node in reversed(nodes):  # a value an elementwise op of its size reads lives as
        # long as that op's result: fusion recomputes the op in the kernels that read it
        kind = "input" if is_input(node) else get_op(node.op).kind
        if kind not in ("elementwise", "movement") or id(node) not in last_use:
            continue
        if any(use[1] is not None and get_op(use[1].op).kind == "library"
               for use in uses.get(id(node), ())):  # fmt: skip
            continue  # a library call's operand is written: it keeps nothing alive
        for child in node.inputs:
            if child.numel == node.numel and id(child) in last_use:
                if last_use[id(node)] > last_use[id(child)]:
                    last_use[id(child)] = last_use[id(node)]
                    keeper[id(child)] = node
    redirects: dict[int, list[tuple[int, Node, tuple[Node, ...]]]] = {}
    chains: dict[int, tuple[list[Node], list[Node]]] = {}  # per copied value: _chain's answer
    after: dict[int, Node | None] = {}  # per copied value: what its copy waits for
    for value in nodes:
        found = _late_copy(value, uses.get(id(value), ()), last_use, position)
        if found is None:
            continue
        late, chains[id(value)] = found
        waits = _latest_reader_operand(chains[id(value)][1], keeper, position)
        after[id(value)] = waits if waits is not None else _after(late[0][1], late[0][2])
        for _, consumer, index, path in late:
            redirects.setdefault(id(consumer), []).append((index, value, path))
    if not redirects:
        return graph
    rebuilt = _rebuild(graph, redirects, chains, after)
    return graph if rebuilt is None else rebuilt


def _rebuild(graph: Graph, redirects, chains, after) -> Graph | None:
    """The graph with each redirected read taking the copy (built once per value, over its
    sources and the node it waits for); None if that order has a cycle (a copy waiting for a
    value that needs the copy)."""
    mapped: dict[int, Node] = {}
    copies: dict[int, Node] = {}

    def needs(node: Node) -> list[Node]:
        extra = []
        for _, value, path in redirects.get(id(node), ()):
            extra += chains[id(value)][1] + [c for view in path for c in view.inputs[1:]]
            if after[id(value)] is not None:
                extra.append(after[id(value)])
        return list(node.inputs) + extra

    visiting: set[int] = set()
    for root in graph.outputs:
        stack = [(root, False)]
        while stack:
            node, ready = stack.pop()
            if id(node) in mapped:
                continue
            if is_input(node):
                mapped[id(node)] = node
                continue
            if not ready:
                if id(node) in visiting:
                    return None  # reached again before it was built: a cycle
                visiting.add(id(node))
                stack.append((node, True))
                stack.extend((child, False) for child in needs(node) if id(child) not in mapped)
                continue
            inputs = [mapped[id(child)] for child in node.inputs]
            for index, value, path in redirects.get(id(node), ()):
                copy = copies.get(id(value))
                if copy is None:
                    waits = after[id(value)]
                    waits = None if waits is None else mapped[id(waits)]
                    copy = copies[id(value)] = _copy(value, chains[id(value)], mapped, waits)
                for view in path:  # the reader's views, over the copy
                    copy = Node(view.op, (copy, *(mapped[id(c)] for c in view.inputs[1:])),
                                view.attrs, view.dtype, view.shape, view.site)  # fmt: skip
                inputs[index] = copy
            mapped[id(node)] = with_inputs(node, tuple(inputs))
            visiting.discard(id(node))
    return Graph(tuple(mapped[id(node)] for node in graph.outputs), graph.name)


def _chain(value: Node) -> tuple[list[Node], list[Node]] | None:
    """The elementwise ops computing ``value`` back to its sources (inputs, library results,
    reductions, constants), inputs first, and the sources; None past ``RECOMPUTE_LIMIT``."""
    chain: list[Node] = []
    sources: dict[int, Node] = {}
    seen: set[int] = set()

    def visit(node: Node) -> bool:
        if id(node) in seen:
            return True
        seen.add(id(node))
        kind = "input" if is_input(node) else get_op(node.op).kind
        if kind in ("elementwise", "movement") and node.inputs:
            for child in node.inputs:
                if not visit(child):
                    return False
            chain.append(node)
            return len(chain) <= RECOMPUTE_LIMIT
        sources[id(node)] = node
        return True

    if not visit(value):
        return None
    return chain, list(sources.values())


def _late_copy(value: Node, found, last_use, position):
    """The late uses of ``value`` that should read a copy of it and the copy's chain
    (``_chain``), or None."""
    if is_input(value) or get_op(value.op).kind != "elementwise" or len(found) < 2:
        return None
    size = value.numel * value.dtype.itemsize
    if size < MIN_BYTES or any(use[1] is None for use in found):
        return None
    if not any(get_op(use[1].op).kind == "library" for use in found):
        return None  # a value only kernels read is remat.py's to keep or recompute
    ordered = sorted(found, key=lambda use: use[0])
    gaps = [(ordered[k + 1][0] - ordered[k][0], k) for k in range(len(ordered) - 1)]
    gap, split = max(gaps)
    if gap < MIN_GAP:
        return None
    chain = _chain(value)
    if chain is None:
        return None
    first_late = ordered[split + 1][0]
    cost = 0
    for source in chain[1]:
        if is_input(source) or get_op(source.op).kind == "leaf":
            continue
        extra = first_late - last_use.get(id(source), position[id(source)])
        cost += max(0, extra) * source.numel * source.dtype.itemsize
    if size * gap < GAIN_OVER_COST * cost:
        return None
    return ordered[split + 1 :], chain


def _latest_reader_operand(sources, keeper, position) -> Node | None:
    """A library result that the op keeping a copy's ``sources`` longest also reads (a GELU's
    gradient reads the gradient of its output, a matmul's): a copy waiting for it is
    computed in that op's kernel, which reads the sources there anyway."""
    best = None
    for source in sources:
        if is_input(source):
            continue  # inputs live throughout: nothing to wait for
        node = keeper.get(id(source))
        while node is not None and id(node) in keeper:
            node = keeper[id(node)]
        if node is None:
            continue
        stack, seen = list(node.inputs), set()
        while stack and len(seen) < 4 * RECOMPUTE_LIMIT:
            child = stack.pop()
            if id(child) in seen or is_input(child) or child is source:
                continue
            seen.add(id(child))
            kind = get_op(child.op).kind
            if kind == "library" and position[id(child)] > position[id(source)]:
                if best is None or position[id(child)] > position[id(best)]:
                    best = child
            elif kind in ("elementwise", "movement"):
                stack.extend(child.inputs)
    return best


def _after(consumer: Node, index: int) -> Node | None:
    """Another operand of the late reader (computed, not an input): the copy waits for it."""
    for other, child in enumerate(consumer.inputs):
        if other != index and not is_input(child) and child.numel:
            return child
    return None


def _copy(value: Node, chain_and_sources, mapped: dict[int, Node], after: Node | None) -> Node:
    """A new node (and new nodes for its elementwise chain) computing ``value`` again from
    its sources' rewritten nodes. Each computed source is read through a ``barrier`` that
    also reads one element of ``after`` (as a checkpoint's recomputation does,
    flame/recompute.py): the copy cannot be scheduled before the late reader's other
    operand exists, so fusion computes it in the backward, not beside the original."""
    chain, sources = chain_and_sources
    made: dict[int, Node] = {}
    for source in sources:
        if after is None or is_input(source) or get_op(source.op).kind == "leaf":
            continue
        flat = make_node("reshape", (after,), {"shape": (after.numel,)})
        first = make_node("slice", (flat,), {"starts": (0,), "stops": (1,), "steps": (1,)})
        if first.dtype is not source.dtype:
            first = make_node("cast", (first,), {"dtype": source.dtype})
        ones = (1,) * len(source.shape)
        first = make_node("reshape", (first,), {"shape": ones})
        if ones != source.shape:
            first = make_node("expand", (first,), {"shape": source.shape})
        new = mapped[id(source)]
        made[id(source)] = make_node("barrier", (new, first), {"token": Token()}, source.site)
    for node in chain:
        inputs = tuple(made.get(id(c)) or mapped[id(c)] for c in node.inputs)
        made[id(node)] = Node(node.op, inputs, node.attrs, node.dtype, node.shape, node.site)
    return made[id(value)]
