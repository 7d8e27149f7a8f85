"""Splitting big reductions into two stages.

A reduction with few outputs and many inputs per output (``x.sum()`` over 64 Mi elements,
``loss = (y * dy).sum()``) would run one block per output: one block for the whole tensor.
Afterwards: every reduction over trailing axes with fewer than ``FEW_OUTPUTS`` outputs and at
least ``MANY_INPUTS`` elements per output reduces ``PARTS`` chunks of each row first, then
the partial results: two kernels, the first one with ``PARTS`` times more parallelism. The
same holds for reductions over leading axes (column sums) with few outputs.
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
    if axes and axes == tuple(range(len(axes))) and len(axes) < rank:
        return _split_leading(node, source, axes)
    if not axes or axes != tuple(range(rank - len(axes), rank)):
        return None  # trailing or leading axes only: contiguous work to cut in pieces
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


COLUMN_OUTPUTS = 1 << 15  # a column reduction with fewer outputs than this is split


def _split_leading(node: Node, source: Node, axes) -> Node | None:
    """Sums over leading axes (``dw = (dy * x_hat).sum(0)``): each thread of the column kernel
    owns an output, so few outputs mean few threads. Cut the reduced rows into ``parts``
    blocks of rows, reduce each, then reduce the partial results."""
    lead = prod(source.shape[: len(axes)])
    rest = source.shape[len(axes) :]
    outputs = prod(rest)
    if outputs >= COLUMN_OUTPUTS or lead < 4096:
        return None
    parts = 1
    while (
        outputs * parts < 4 * COLUMN_OUTPUTS
        and lead % (parts * 2) == 0
        and lead // (parts * 2) >= 64
    ):
        parts *= 2
    if parts == 1:
        return None
    pieces = make_node("reshape", (source,), {"shape": (parts, lead // parts) + rest}, node.site)
    partial = make_node(node.op, (pieces,), {"axes": (1,)}, node.site)
    total = make_node(node.op, (partial,), {"axes": (0,)}, node.site)
    return make_node("reshape", (total,), {"shape": node.shape}, node.site)
