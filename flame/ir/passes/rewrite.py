"""Shared machinery for passes: rebuild a graph bottom-up, node by node."""

from __future__ import annotations

from collections.abc import Callable

from flame.ir.graph import Graph, is_input
from flame.ir.node import Node


def with_inputs(node: Node, inputs: tuple[Node, ...]) -> Node:
    """``node`` over new inputs; the same object when nothing changed (keeps memo and site)."""
    if all(new is old for new, old in zip(inputs, node.inputs)):
        return node
    return Node(node.op, inputs, node.attrs, node.dtype, node.shape, node.site)


def rewrite(graph: Graph, visit: Callable[[Node], Node]) -> Graph:
    """Apply ``visit`` to every computed node, inputs first, after its inputs were rewritten."""
    mapped: dict[int, Node] = {}
    for node in graph.nodes:
        if is_input(node):
            mapped[id(node)] = node
            continue
        rebuilt = with_inputs(node, tuple(mapped[id(child)] for child in node.inputs))
        mapped[id(node)] = visit(rebuilt)
    return Graph(tuple(mapped[id(node)] for node in graph.outputs), graph.name)
