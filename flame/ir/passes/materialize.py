"""Which values the fusion pass writes to memory before grouping (fuse.py): graph outputs,
library calls and what they read, broadcasts of costly computations, reshapes that are not
strided views, and values whose recomputation would read many tensors of their size. Every
other value is recomputed by each kernel that needs it (remat.py then decides the rest)."""

from __future__ import annotations

from flame.ir.graph import Graph, is_input
from flame.ir.node import Node
from flame.ir.ops import get_op
from flame.ir.passes.cost import RECOMPUTE_LIMIT, computed_size
from flame.ir.passes.library_views import library_view, own_view
from flame.ir.views import MOVEMENT_OPS, resolve


def materialized_values(graph: Graph, views) -> tuple[dict[int, Node], dict[int, str]]:
    """``views``: ``handed_out(graph)``."""
    chosen = {id(node): node for node in graph.outputs if not is_input(node)}
    reasons: dict[int, str] = {id(node): "graph output" for node in chosen.values()}
    for node, base in views.values():
        reasons[id(node)] = f"graph output: a view of {base.op}'s result (no copy)"
        if get_op(base.op).kind != "library" and id(base) not in chosen:
            chosen[id(base)] = base  # written by its row kernel, handed out reshaped
            reasons[id(base)] = "handed out reshaped as a graph output (no copy)"

    def choose(node: Node, reason: str) -> None:
        if not is_input(node) and id(node) not in chosen:
            chosen[id(node)] = node
            reasons[id(node)] = reason

    users: dict[int, int] = {}  # per value, the ops reading it (through views)
    for node in graph.nodes:
        if node.op in MOVEMENT_OPS:
            continue
        for child in node.inputs:
            while child.op in MOVEMENT_OPS and child.inputs:
                child = child.inputs[0]
            users[id(child)] = users.get(id(child), 0) + 1
    # a graph of elementwise ops only (an optimizer's update rule) is one kernel
    threshold = FUSED_WIDE_SOURCES
    if any(get_op(n.op).kind not in ("elementwise", "movement", "leaf") for n in graph.nodes):
        threshold = WIDE_SOURCES
    for node in graph.nodes:  # inputs first, so inner decisions come before outer ones
        kind = get_op(node.op).kind
        if kind == "elementwise" and users.get(id(node), 0) > 1:
            wide = _wide_reads(node, chosen)
            if wide > threshold:
                choose(node, f"recomputing it would read {wide} values of its size")
        if kind == "library":
            choose(node, f"{node.op} runs as a library call")
            for child in node.inputs:
                _choose_library_read(node, child, chosen, choose)
        elif node.op == "expand" and not is_input(node.inputs[0]):
            source = node.inputs[0]
            cost = computed_size(source, set(chosen), reductions=BROADCAST_COST_OF_REDUCTIONS)
            if cost > RECOMPUTE_LIMIT:
                ratio = node.numel // max(source.numel, 1)
                choose(source, f"broadcast of {cost} ops would be recomputed {ratio}x")
        elif node.op == "reshape":
            follow = lambda m, top=node: m is top or id(m) not in chosen  # noqa: E731
            if resolve(node, own_view, follow) is None:
                choose(node.inputs[0], "reshape of a layout that is not a strided view")
    calls = [node for node in graph.nodes if get_op(node.op).kind == "library"]
    for _ in range(len(graph.nodes) + 1):
        # a value chosen after a library call was looked at (a later call's operand, an
        # expand's source) may sit in its operand's chain: the call reads that value through
        # the rest of the chain, or writes its operand where that is no view (each round
        # adds a value, so this ends)
        count = len(chosen)
        for node in calls:
            for child in node.inputs:
                _choose_library_read(node, child, chosen, choose)
        if len(chosen) == count:
            break
    return chosen, reasons


def _choose_library_read(node: Node, child: Node, chosen, choose) -> None:
    """What the library call ``node`` reads ``child`` from is written: the value its view
    chain stops at (``library_view``: a value already written, else the chain's base), or
    ``child`` itself when the chain is no view of that. (The reshape rule has written what
    makes each reshape under a call a view by then: the permute under the attention
    backward's ``reshape(permute(cat))``.)"""
    view = library_view(child, written=chosen)
    if not view:
        choose(child, f"input of {node.op}, which reads memory")
    elif not is_input(view[0]):
        choose(view[0], f"read by {node.op} through a view (no copy)")


# Whether the ops under a reduction count toward the cost of recomputing a broadcast value
# computed from it (a norm's mean and 1/std broadcast over the rows). No kernel recomputes a
# reduction per element: its row kernel computes it once a row, other kernels read it. When
# they counted, a norm whose input is itself computed (a conv result plus a bias and a time
# embedding) had its statistics written out, and its normalised output left the row kernel
# for an elementwise kernel that read the input a second time.
BROADCAST_COST_OF_REDUCTIONS = False

# A value read by several ops whose recomputation reads more than this many in-memory values
# of its own size is written once: each kernel recomputing it would read them all, and along
# a chain (a transformer's residual stream, x + a1 + a2 + ...) every later kernel would
# re-read every earlier contribution (block k's kernels k of them: quadratic in the depth).
# 1 (was 4, session 19, H100, same machine and run): UNet b64 step 22.09 -> 20.32 ms, DiT-S/2
# 20.55 -> 18.17 ms, DDIM sampling 296.2 -> 290.8 ms of device time, first steps 21 -> 17 s
# and 39 -> 16 s; a ResBlock alone 430.5 -> 435.6 us (notes/dit-kernel-floors.md found it)
WIDE_SOURCES = 1
# In a graph of elementwise ops only (an optimizer's update rule, which fuses into one kernel) a
# value is recomputed unless that would read more than this many: writing it would only add
# bytes (and a foreach rule must stay one kernel with exactly its results as outputs)
FUSED_WIDE_SOURCES = 4


def _wide_reads(node: Node, chosen) -> int:
    """How many values of ``node``'s size in memory (inputs, values written) recomputing it
    reads; counting stops past the larger threshold."""
    size, count = node.numel, 0
    stack, seen = list(node.inputs), set()
    limit = max(WIDE_SOURCES, FUSED_WIDE_SOURCES)
    while stack and count <= limit and len(seen) < 256:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if is_input(value) or id(value) in chosen:
            count += value.numel >= size
        elif BROADCAST_COST_OF_REDUCTIONS or get_op(value.op).kind != "reduce":
            stack.extend(value.inputs)
        # (a reduction's input is not read again by a kernel recomputing ``node``: the
        # reduction is computed once a row by its own kernel, or read from memory)
    return count
