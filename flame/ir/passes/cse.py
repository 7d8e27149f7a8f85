"""Common-subexpression elimination.

Afterwards: no two computed nodes have the same op, attributes, type and inputs; equal
constants and equal generated leaves (same seed and shape) are one node. Data inputs are
never merged (two arrays with equal contents are still two arrays).
"""

from __future__ import annotations

from flame.ir.graph import Graph, is_input
from flame.ir.node import attrs_key
from flame.ir.passes.rewrite import with_inputs


def cse(graph: Graph) -> Graph:
    canonical: dict[tuple, object] = {}
    mapped: dict[int, object] = {}
    for node in graph.nodes:
        if is_input(node):
            mapped[id(node)] = node
            continue
        rebuilt = with_inputs(node, tuple(mapped[id(child)] for child in node.inputs))
        key = (
            rebuilt.op,
            attrs_key(rebuilt.attrs),  # x * -0.0 is not x * 0.0
            rebuilt.dtype.name,
            rebuilt.shape,
            tuple(id(child) for child in rebuilt.inputs),
        )
        mapped[id(node)] = canonical.setdefault(key, rebuilt)
    outputs = tuple(mapped[id(node)] for node in graph.outputs)
    return Graph(outputs, graph.name)
