"""What a program is: dtypes, shapes, nodes, graphs, the op registry, printer and verifier.

Nothing here imports ``flame.codegen`` or ``flame.runtime``.
"""

from flame.ir import dtypes
from flame.ir.graph import Graph, Group, is_input
from flame.ir.node import Node, Site, format_site, toposort
from flame.ir.ops import OPS, get_op
from flame.ir.printer import format_graph

__all__ = [
    "OPS",
    "Graph",
    "Group",
    "Node",
    "Site",
    "dtypes",
    "format_graph",
    "format_site",
    "get_op",
    "is_input",
    "toposort",
]
