"""The verifier: every node agrees with its op's declaration. ``FLAME_VERIFY=1`` runs it
after every pass."""

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
    return graph
