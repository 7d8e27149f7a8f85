"""Channels-last layouts downstream of channels-last convolutions (issue 20: "layout is
FLAME's choice").

A 16-bit convolution computes channels-last (flame/nn/convolution.py): its [N, *S, C] result
reaches NCHW model code as ``permute(conv, (0, r-1, 1, ..., r-2))``. Every elementwise op on
that view would otherwise write its result in the logical NCHW order, so the bias add, the
time-embedding add, a GroupNorm's normalisation and the residual add each turned the
activations back to NCHW, and the next convolution (or a GroupNorm's channel statistics)
transposed them again.

This pass, after ``simplify``, sinks those permutes downstream instead, as PyTorch keeps the
memory format of an elementwise op's inputs:

* an elementwise op reading such a view (and no more full-size NCHW operands than
  channels-last ones) computes in the channels-last order over the views' own values, and its
  result is seen through the same permute;
* a reduction of such a view reduces the channels-last value over the mapped axes (a
  GroupNorm's per-channel sums become column sums that read memory in order);
* a permute of such a view composes with it (a conv operand's ``permute(x).clone()`` reads
  the channels-last value itself, and the clone of a value this pass made is that value);
* a ``cat`` of such views is the view of the ``cat`` of the values.

Broadcast operands (a bias, a per-sample scale) are read through the permuted broadcast, and
an NCHW operand of full size through a transposed view. Values only change order in memory:
results are bit-identical. Weight gradients (``conv_weight_grad``, filter layout) and
non-convolution code are left alone.
"""

from __future__ import annotations

from flame.ir.graph import Graph, is_input
from flame.ir.infer import make_node
from flame.ir.node import Node
from flame.ir.ops import get_op
from flame.ir.passes.rewrite import with_inputs
from flame.ir.passes.simplify import _cat_of_permutes, _movement
from flame.ir.passes.split import split_reductions

# Off: measured on the H100 (notes/performance.md, session 19) it made the UNet step slower
# (20.32 -> 22.29 ms) while its GroupNorm statistics still write float32 copies of the
# activations; kept, with its tests, as the way to the end of the NCHW <-> NHWC transposes.
# ``split.SPLIT_COLUMNS`` goes with it (the per-channel sums it makes are cut into strips).
ENABLED = False
SOURCES = ("conv", "conv_data_grad")  # library ops whose channels-last results start a region


def to_nchw(rank: int) -> tuple[int, ...]:
    return (0, rank - 1, *range(1, rank - 1))


def to_channels_last(rank: int) -> tuple[int, ...]:
    return (0, *range(2, rank), 1)


def layouts(graph: Graph) -> Graph:
    if not ENABLED or not any(node.op in SOURCES for node in graph.nodes):
        return graph
    keep = {id(node) for node in graph.outputs}
    readers: dict[int, int] = {}
    for node in graph.nodes:
        for child in node.inputs:
            readers[id(child)] = readers.get(id(child), 0) + 1
            if get_op(node.op).kind == "library":
                keep.add(id(child))
    # values a reshape reads (a group-major GroupNorm's [N, G, C/G, S] rows, an attention
    # block's tokens): seen through a permute they would be no view, so they keep NCHW
    reshaped = {id(node.inputs[0]) for node in graph.nodes if node.op == "reshape"}
    made: set[int] = set()  # channels-last values this pass computes
    mapped: dict[int, Node] = {}

    def channels_last(node: Node) -> Node | None:
        """The channels-last value ``node`` is an NCHW view of, if it is one we track."""
        if node.op != "permute" or len(node.shape) < 3:
            return None
        if node.attr("dims") != to_nchw(len(node.shape)):
            return None
        base = node.inputs[0]
        if id(base) in made:
            return base
        if base.op in SOURCES and dict(base.attrs).get("channels_last"):
            return base
        return None

    def seen_as_nchw(value: Node, site) -> Node:
        made.add(id(value))
        return make_node("permute", (value,), {"dims": to_nchw(len(value.shape))}, site)

    def elementwise(node: Node) -> Node | None:
        rank = len(node.shape)
        if rank < 3:
            return None
        bases = [channels_last(child) for child in node.inputs]
        if not any(base is not None for base in bases):
            return None
        full = [
            child for child, base in zip(node.inputs, bases)
            if base is None and child.shape == node.shape and child.op not in ("expand", "const")
        ]  # fmt: skip
        if len(full) > sum(base is not None for base in bases):
            return None
        memo = {"shared": {id(c) for c in node.inputs if readers.get(id(c), 0) > 1}}
        dims = {"dims": to_channels_last(rank)}
        inputs = tuple(
            base if base is not None
            else child if child.op == "const" and child.shape == ()
            else _movement("permute", dims, child, node.site, keep, memo)
            for child, base in zip(node.inputs, bases)
        )  # fmt: skip
        computed = make_node(node.op, inputs, dict(node.attrs), node.site)
        return seen_as_nchw(computed, node.site)

    def reduction(node: Node) -> Node | None:
        base = channels_last(node.inputs[0])
        if base is None or set(dict(node.attrs)) != {"axes"}:
            return None
        order = to_nchw(len(node.shape))
        axes = tuple(sorted(order[axis] for axis in node.attr("axes")))
        reduced = make_node(node.op, (base,), {"axes": axes}, node.site)
        return seen_as_nchw(reduced, node.site)

    def movement(node: Node) -> Node | None:
        if node.op != "permute":
            return None
        child = node.inputs[0]
        if child.op != "permute" or id(child.inputs[0]) not in made:
            return None
        inner = child.attr("dims")
        dims = tuple(inner[d] for d in node.attr("dims"))
        base = child.inputs[0]
        if dims == tuple(range(len(dims))):
            return base
        return make_node("permute", (base,), {"dims": dims}, node.site)

    def visit(node: Node, kept: bool, reshape_read: bool) -> Node:
        """``kept``: an output or a library operand keeps its order (unless it is a clone
        of a value this pass made: the value itself is read); so does a full-size value a
        reshape reads (a reduction's small result stays a view when reshaped)."""
        kind = get_op(node.op).kind
        replaced = None
        if kind == "elementwise":
            if node.op == "copy" and id(node.inputs[0]) in made:
                replaced = node.inputs[0]  # a clone of memory this pass gave the value
            elif not (kept or reshape_read):
                replaced = elementwise(node)
        elif kind == "reduce" and not kept:
            replaced = reduction(node)
        elif kind == "movement":
            replaced = movement(node)
        elif node.op == "cat" and not kept and not reshape_read:
            if not all(map(channels_last, node.inputs)):
                return node
            replaced = _cat_of_permutes(node)
            if replaced is not None:
                made.add(id(replaced.inputs[0]))
        return replaced if replaced is not None else node

    for node in graph.nodes:
        if is_input(node):
            mapped[id(node)] = node
            continue
        rebuilt = with_inputs(node, tuple(mapped[id(child)] for child in node.inputs))
        result = visit(rebuilt, id(node) in keep, id(node) in reshaped)
        mapped[id(node)] = result
        if id(node) in keep:
            keep.add(id(result))
        if readers.get(id(node), 0) > 1:
            readers[id(result)] = readers[id(node)]
    if not made:
        return graph
    # the reductions it rewrote are split again where they have few outputs (a bias
    # gradient's per-channel sums over N*H*W rows)
    return split_reductions(Graph(tuple(mapped[id(node)] for node in graph.outputs), graph.name))
