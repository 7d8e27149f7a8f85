"""Constant folding and algebraic simplification.

Afterwards: no elementwise node has only constant inputs; no ``expand`` is an identity or
stacked on another ``expand``; ``x*1``, ``x/1``, ``x-0``, integer ``x+0``, ``--x``,
``x**1`` are gone; ``x**2`` is ``x*x``. Rules that would change a float result are not applied
(``x + 0.0`` turns ``-0.0`` into ``0.0``; ``x * 0`` is not ``0`` for NaN or infinity).
"""

from __future__ import annotations

import numpy as np

from flame.ir.evaluate import compute_dtype, evaluate_elementwise
from flame.ir.graph import Graph
from flame.ir.infer import make_const, make_node
from flame.ir.node import Node
from flame.ir.ops import get_op
from flame.ir.passes.rewrite import rewrite


def constant_value(node: Node):
    """The scalar a node always equals (a constant, maybe broadcast), else None."""
    while node.op == "expand":
        node = node.inputs[0]
    if node.op == "const":
        return node.attr("value")
    return None


def _fold(node: Node) -> Node | None:
    values = [constant_value(child) for child in node.inputs]
    if any(value is None for value in values):
        return None
    arrays = [
        np.asarray(value, dtype=compute_dtype(child.dtype)) for value, child in zip(values, node.inputs)
    ]
    result = evaluate_elementwise(node, arrays)  # a computed value: rounded to node.dtype
    const = make_const(result.item(), node.dtype, node.site, round_to_dtype=True)
    if node.shape == ():
        return const
    return make_node("expand", (const,), {"shape": node.shape}, node.site)


def _identity(node: Node) -> Node | None:
    op = node.op
    if op == "expand":
        source = node.inputs[0]
        if source.shape == node.shape:
            return source
        if source.op == "expand":
            return make_node("expand", (source.inputs[0],), {"shape": node.shape}, node.site)
        return None
    if op == "neg" and node.inputs[0].op == "neg":
        return node.inputs[0].inputs[0]
    if op == "cast" and node.inputs[0].dtype is node.dtype:
        return node.inputs[0]
    if len(node.inputs) != 2:
        return None
    left, right = node.inputs
    right_value = constant_value(right)
    if op in ("mul", "div", "pow") and right_value == 1 and not right.dtype.is_bool:
        return left
    if op == "mul" and constant_value(left) == 1 and not left.dtype.is_bool:
        return right
    if op == "sub" and right_value == 0:
        return left
    if op == "add" and not node.dtype.is_float and not node.dtype.is_bool:
        if right_value == 0:
            return left
        if constant_value(left) == 0:
            return right
    if op == "pow" and right_value == 2 and node.dtype.is_float:
        return make_node("mul", (left, left), {}, node.site)
    return None


def simplify(graph: Graph) -> Graph:
    def visit(node: Node) -> Node:
        while True:
            kind = get_op(node.op).kind
            replacement = None
            if kind == "elementwise":
                replacement = _fold(node)
            if replacement is None:
                replacement = _identity(node)
            if replacement is None:
                return node
            node = replacement

    return rewrite(graph, visit)
