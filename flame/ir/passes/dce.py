"""Dead-code elimination.

Afterwards: the graph holds exactly the nodes reachable from its outputs (a graph is defined
by reachability, so rebuilding it from the outputs drops whatever earlier passes orphaned).
"""

from __future__ import annotations

from flame.ir.graph import Graph


def dce(graph: Graph) -> Graph:
    return Graph(graph.outputs, graph.name)
