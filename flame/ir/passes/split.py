"""Splitting big reductions into two stages.

A reduction with few outputs and many inputs per output (``x.sum()`` over 64 Mi elements,
``loss = (y * dy).sum()``) would run one block per output: one block for the whole tensor.
Afterwards: every reduction over trailing axes with fewer than ``FEW_OUTPUTS`` outputs and at
least ``MANY_INPUTS`` elements per output reduces ``PARTS`` chunks of each row first, then
the partial results: two kernels, the first one with ``PARTS`` times more parallelism.
Sums, products, maxima and minima are associative, so only float rounding changes.
"""

from __future__ import annotations

from flame.ir.graph import Graph
from flame.ir.infer import make_node
from flame.ir.node import Node
from flame.ir.ops import get_op
from flame.ir.passes.rewrite import rewrite
from flame.ir.shapes import prod

FEW_OUTPUTS = 256
MANY_INPUTS = 1 << 16
PARTS = 1024


def _parts(count: int) -> int:
    parts = PARTS
    while parts > 1 and (count % parts or count // parts < 256):
        parts //= 2
    return parts


def _split(node: Node) -> Node | None:
    if get_op(node.op).kind != "reduce":
        return None
    source = node.inputs[0]
    axes = node.attr("axes")
    rank = len(source.shape)
    if not axes or axes != tuple(range(rank - len(axes), rank)):
        return None  # only trailing axes: a row of contiguous work to cut in pieces
    kept = source.shape[: rank - len(axes)]
    row = prod(source.shape[rank - len(axes) :])
    if prod(kept) >= FEW_OUTPUTS or row < MANY_INPUTS:
        return None
    parts = _parts(row)
    if parts == 1:
        return None
    pieces = make_node("reshape", (source,), {"shape": kept + (parts, row // parts)}, node.site)
    partial = make_node(node.op, (pieces,), {"axes": (len(kept) + 1,)}, node.site)
    total = make_node(node.op, (partial,), {"axes": (len(kept),)}, node.site)
    return make_node("reshape", (total,), {"shape": node.shape}, node.site)


def split_reductions(graph: Graph) -> Graph:
    def visit(node: Node) -> Node:
        return _split(node) or node

    return rewrite(graph, visit)
