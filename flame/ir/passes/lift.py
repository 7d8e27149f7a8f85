"""Elementwise work that follows a row kernel's result through a reshape, moved onto the rows.

A group norm computes on ``x`` viewed as [N, G, C/G, S] (its statistics reduce axes 2 and 3)
and returns ``reshape(y, [N, C, H, W])``; the model then applies SiLU, adds a time embedding,
casts: elementwise ops on [N, C, H, W]. There they would be a second kernel reading ``y``
back. This pass rewrites ``f(reshape(y), b)`` as ``reshape(f(y, reshape(b)))`` (and likewise
through permutes: a channels-last norm computes on [N, S, G, C/G] and hands back a permuted
view), with ``f`` computed on the row space, whenever every other operand ``b`` reads there
as a strided view of data already in memory (a weight broadcast per channel, an input, a
library result): the row kernel then computes ``f`` too and writes only the final value. It
is the fusion of
"row statistics + elementwise over the same rows with a broadcast inside the row" for any
op chain, not a group-norm rule. Operands computed by other elementwise ops are left alone
(lifting would force them into memory).
"""

from __future__ import annotations

from flame.ir.graph import Graph, is_input
from flame.ir.infer import make_node
from flame.ir.node import Node
from flame.ir.ops import get_op
from flame.ir.passes.library_views import own_view
from flame.ir.passes.rewrite import rewrite
from flame.ir.passes.row_keys import row_shapes
from flame.ir.views import resolve


def lift_row_epilogues(graph: Graph) -> Graph:
    rows = row_shapes(graph)
    if not rows:
        return graph
    return rewrite(graph, lambda node: _lifted(node, rows) or node)


def _row_value(node: Node, rows) -> tuple[Node, list[Node]] | None:
    """The row-space value ``node`` views through reshapes and permutes (a computed
    elementwise value), with the chain of those views from ``node`` down; or None."""
    chain = []
    while node.op in ("reshape", "permute") and node.buffer is None:
        chain.append(node)
        node = node.inputs[0]
    computed = not is_input(node) and get_op(node.op).kind == "elementwise"
    if chain and computed and node.shape in rows and node.shape != chain[0].shape:
        return node, chain
    return None


def _undo(child: Node, chain: list[Node]) -> Node:
    """``child`` (shaped like the top of ``chain``) taken back through the chain's views to
    the row space: each permute inverted, each reshape to the shape below it."""
    for view in chain:
        below = view.inputs[0].shape
        if view.op == "permute":
            dims = view.attr("dims")
            inverse = tuple(sorted(range(len(dims)), key=dims.__getitem__))
            child = make_node("permute", (child,), {"dims": inverse}, child.site)
        else:
            child = make_node("reshape", (child,), {"shape": below}, child.site)
    return child


def _redo(value: Node, chain: list[Node], site) -> Node:
    """``value`` (in the row space) through the chain's views again, bottom up."""
    for view in reversed(chain):
        value = make_node(view.op, (value,), dict(view.attrs), site)
    return value


def _lifted(node: Node, rows) -> Node | None:
    if get_op(node.op).kind != "elementwise" or not node.inputs:
        return None
    found = [_row_value(child, rows) for child in node.inputs]
    first = next((item for item in found if item is not None), None)
    if first is None:
        return None
    space, chain = first[0].shape, first[1]
    steps = [(view.op, view.attrs) for view in chain]
    inputs = []
    for child, item in zip(node.inputs, found):
        if (
            item is not None
            and item[0].shape == space
            and [(view.op, view.attrs) for view in item[1]] == steps
        ):
            inputs.append(item[0])
        elif child.op == "const" and child.shape == ():
            inputs.append(child)
        else:
            viewed = _viewed(child, chain)
            if viewed is None:
                return None
            inputs.append(viewed)
    on_rows = Node(node.op, tuple(inputs), node.attrs, node.dtype, space, node.site)
    return _redo(on_rows, chain, node.site)


def _viewed(child: Node, chain: list[Node]) -> Node | None:
    """``child`` taken onto the row space, if that is a strided view of a value that is in
    memory anyway (an input, a library call's result, a reduction): else None."""
    tentative = _undo(child, chain)
    resolved = resolve(tentative, own_view, lambda movement: True)
    if resolved is None:
        return None
    base = resolved[0]
    if not is_input(base) and get_op(base.op).kind == "elementwise":
        return None
    return tentative
