"""The verifier: every node agrees with its op's declaration, and (once the graph is grouped
into kernels) every kernel reads only what is in memory when it runs. ``FLAME_VERIFY=1`` runs
it after every pass."""

from __future__ import annotations

from flame.ir.graph import Graph, is_input
from flame.ir.infer import infer
from flame.ir.ops import OPS


class VerifyError(AssertionError):
    pass


def verify(graph: Graph, after: str = "") -> Graph:
    where = f" after {after}" if after else ""
    position = {id(node): index for index, node in enumerate(graph.nodes)}
    for node in graph.nodes:
        if node.op not in OPS:
            raise VerifyError(f"unknown op {node.op!r}{where}")
        if is_input(node) or OPS[node.op].kind == "leaf":
            if node.inputs:
                raise VerifyError(f"leaf {node!r} has inputs{where}")
            continue
        for child in node.inputs:
            if position.get(id(child), len(position)) >= position[id(node)]:
                raise VerifyError(f"{node!r} uses a value defined after it{where}")
        dtype, shape = infer(node.op, node.inputs, dict(node.attrs))
        if dtype is not node.dtype or shape != node.shape:
            raise VerifyError(
                f"{node!r} declares {node.dtype.name}{list(node.shape)} but its rule gives "
                f"{dtype.name}{list(shape)}{where}"
            )
    if graph.groups:
        verify_groups(graph, after)
    return graph


def verify_groups(graph: Graph, after: str = "") -> Graph:
    """Every value a kernel reads from outside itself (through views: movement ops it does
    not compute) is an input, a constant, or written by an earlier kernel: a value computed
    by no kernel, or only inside a later one, cannot be read."""
    from flame.ir.ops import get_op
    from flame.ir.views import MOVEMENT_OPS

    where = f" after {after}" if after else ""
    written: set[int] = set()
    for index, group in enumerate(graph.groups):
        members = {id(node) for node in group.nodes}
        for node in group.nodes:
            for child in node.inputs:
                base = child
                while (
                    id(base) not in members and id(base) not in written
                    and base.op in MOVEMENT_OPS and base.inputs
                ):  # fmt: skip
                    base = base.inputs[0]
                if id(base) in members or id(base) in written or is_input(base):
                    continue
                if get_op(base.op).kind == "leaf":
                    continue
                raise VerifyError(
                    f"kernel {index} ({group.kind}: {', '.join(n.op for n in group.nodes[:6])}"
                    f"...) reads {base!r}, which no earlier kernel writes{where}"
                )
        written.update(id(out) for out in group.outputs)
    return graph
