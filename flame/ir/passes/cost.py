"""How much work recomputing a value costs: shared by the simplifier (which pushes
broadcasts through cheap computations) and the fusion pass (which writes expensive
broadcast computations to memory once)."""

from __future__ import annotations

from flame.ir.graph import is_input
from flame.ir.node import Node
from flame.ir.ops import get_op

# Up to this many ops under a broadcast are recomputed per element of the larger tensor:
# cheaper than a kernel launch and a round trip through memory.
RECOMPUTE_LIMIT = 8


def computed_size(root: Node, stops=frozenset(), reductions: bool = True) -> int:
    """Number of non-movement ops under ``root`` that a kernel would recompute; without
    ``reductions``, a reduction counts as one op and what it reads is not walked (no kernel
    recomputes a reduction per element of another shape: its own row kernel computes it
    once a row, any other kernel reads it from memory)."""
    count = 0
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen or is_input(node) or (node is not root and id(node) in stops):
            continue
        seen.add(id(node))
        if node.inputs and node.op not in ("expand", "reshape", "permute", "slice"):
            count += 1
        if reductions or get_op(node.op).kind != "reduce":
            stack.extend(node.inputs)
    return count
