"""Elementwise work that follows a row kernel's result through a reshape, moved onto the rows.

A group norm computes on ``x`` viewed as [N, G, C/G, S] (its statistics reduce axes 2 and 3)
and returns ``reshape(y, [N, C, H, W])``; the model then applies SiLU, adds a time embedding,
casts: elementwise ops on [N, C, H, W]. There they would be a second kernel reading ``y``
back. This pass rewrites ``f(reshape(y), b)`` as ``reshape(f(y, reshape(b)))``, with ``f``
computed on the row space, whenever every other operand ``b`` reads there as a strided view
of data already in memory (a weight broadcast per channel, an input, a library result):
the row kernel then computes ``f`` too and writes only the final value. It is the fusion of
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
from flame.ir.passes.rewrite import with_inputs
from flame.ir.views import resolve


def lift_row_epilogues(graph: Graph) -> Graph:
    rows = {node.inputs[0].shape for node in graph.nodes if get_op(node.op).kind == "reduce"}
    if not rows:
        return graph
    mapped: dict[int, Node] = {}
    for node in graph.nodes:
        if is_input(node):
            mapped[id(node)] = node
            continue
        rebuilt = with_inputs(node, tuple(mapped[id(child)] for child in node.inputs))
        mapped[id(node)] = _lifted(rebuilt, rows) or rebuilt
    return Graph(tuple(mapped[id(node)] for node in graph.outputs), graph.name)


def _row_value(node: Node, rows) -> Node | None:
    """The row-space value ``node`` reshapes (a computed elementwise value), or None."""
    if node.op != "reshape" or node.buffer is not None:
        return None
    source = node.inputs[0]
    computed = not is_input(source) and get_op(source.op).kind == "elementwise"
    return source if computed and source.shape in rows and source.shape != node.shape else None


def _lifted(node: Node, rows) -> Node | None:
    if get_op(node.op).kind != "elementwise" or not node.inputs:
        return None
    sources = [_row_value(child, rows) for child in node.inputs]
    space = next((source.shape for source in sources if source is not None), None)
    if space is None:
        return None
    inputs = []
    for child, source in zip(node.inputs, sources):
        if source is not None and source.shape == space:
            inputs.append(source)
        elif child.op == "const" and child.shape == ():
            inputs.append(child)
        else:
            viewed = _viewed(child, space)
            if viewed is None:
                return None
            inputs.append(viewed)
    on_rows = Node(node.op, tuple(inputs), node.attrs, node.dtype, space, node.site)
    return make_node("reshape", (on_rows,), {"shape": node.shape}, node.site)


def _viewed(child: Node, space) -> Node | None:
    """``child`` reshaped onto the row space, if that is a strided view of a value that is in
    memory anyway (an input, a library call's result, a reduction): else None."""
    tentative = make_node("reshape", (child,), {"shape": space}, child.site)
    resolved = resolve(tentative, own_view, lambda movement: True)
    if resolved is None:
        return None
    base = resolved[0]
    if not is_input(base) and get_op(base.op).kind == "elementwise":
        return None
    return tentative
