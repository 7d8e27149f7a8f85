"""A graph: the nodes reachable from some outputs, with the realized ones as its inputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from flame.ir.node import Node, toposort


def is_input(node: Node) -> bool:
    """Data the graph reads rather than computes: a buffer leaf or an already realized node."""
    return node.buffer is not None or node.op == "buffer"


@dataclass(frozen=True)
class Group:
    """Nodes computed by one kernel. ``outputs`` are the values written to memory."""

    kind: str
    nodes: tuple[Node, ...]
    outputs: tuple[Node, ...]
    reasons: tuple[str, ...] = ()  # why this group ends where it does (for the dump)


@dataclass(frozen=True)
class Remat:
    """What the save-or-recompute pass (passes/remat.py) decided for the values that more
    than one kernel computes. Byte counts are the pass's cost model. ``saved`` and
    ``recomputed`` hold ``(node, save, recompute, shared)``: ``save`` is what writing the
    value once and reading it in each later kernel moves; ``recompute`` what those kernels
    would read only to recompute it, of which ``shared`` they read to recompute other
    values too."""

    saved: tuple[tuple[Node, int, int, int], ...] = ()
    recomputed: tuple[tuple[Node, int, int, int], ...] = ()
    # (planned bytes, kernels) of the plan without the cut's saves, and with them (None:
    # nothing to save); the plan with them is kept when it moves fewer bytes in no more
    # kernels
    without: tuple[int, int] | None = None
    with_saves: tuple[int, int] | None = None
    kept: bool = False


@dataclass(frozen=True)
class Graph:
    outputs: tuple[Node, ...]
    name: str = "f"
    groups: tuple[Group, ...] | None = None
    remat: Remat | None = None  # the save-or-recompute decision, once fused
    _nodes: list = field(default=None, compare=False, repr=False)

    @property
    def nodes(self) -> list[Node]:
        if self._nodes is None:
            object.__setattr__(self, "_nodes", toposort(self.outputs, stop=is_input))
        return self._nodes

    @property
    def inputs(self) -> list[Node]:
        return [node for node in self.nodes if is_input(node)]

    def with_outputs(self, outputs) -> Graph:
        return Graph(tuple(outputs), self.name)

    def __str__(self) -> str:
        from flame.ir.printer import format_graph

        return format_graph(self)
