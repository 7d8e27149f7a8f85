"""Values without elements (issue 21, "Bad input"): PyTorch's results, and no kernel.

Two rewrites of a graph about to be planned (flame/runtime/executor.py):

* ``without_empty_reads``: a node without elements is an empty constant (what it would
  have read is not computed); a node that has elements but reads an empty value is what it
  equals without it: a constant (a sum over an empty axis is 0, a product 1, ``any`` False,
  ``all`` True; a matmul or convolution with an inner size of 0 is 0; a constant pad of an
  empty tensor its value), a copy (a scatter with an empty index), or a ``cat`` of fewer
  pieces. No reduction or library kernel runs over nothing, and a constant folds into
  what follows (a mean's NaN);
* ``empty_steps``: a group that writes no element becomes one step per output that makes an
  empty array (``LibraryCall.empty``): nothing is lowered, compiled or launched for it.

What a value without elements computes never reaches a kernel; what is left to write is a
constant (the identity), which the plan writes as any constant is written.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from flame.ir.graph import Graph, Group
from flame.ir.infer import make_const, make_node
from flame.ir.node import Node
from flame.ir.ops import get_op


def is_empty(group: Group) -> bool:
    """A group every output of which has no element: nothing to compute."""
    return all(output.numel == 0 for output in group.outputs)


def empty_steps(graph: Graph) -> Graph:
    """Groups that write no element become one library-kind group per output, which the
    plan runs as ``LibraryCall.empty`` (an empty array): a zero-size value launches no
    kernel and compiles none."""
    if not any(is_empty(group) for group in graph.groups):
        return graph
    groups = []
    for group in graph.groups:
        if not is_empty(group) or (group.kind == "library" and len(group.outputs) == 1):
            groups.append(group)
            continue
        for output in group.outputs:
            groups.append(Group("library", (output,), (output,), ("no elements: no kernel",)))
    return dataclasses.replace(graph, groups=tuple(groups))


# ops whose every element is a sum of products over their operands' elements: with an empty
# operand (an inner size of 0) each is an empty sum
_CONTRACTIONS = frozenset({"matmul", "conv", "conv_data_grad", "conv_weight_grad"})
# ops that change their first input where their index says: with no index, a copy of it
_SCATTERS = frozenset({"scatter_add", "scatter_extreme"})


def without_empty_reads(node: Node) -> Node:
    """``node``, or what it equals when it has elements but reads an empty value: the
    identity of a reduction over an empty axis (PyTorch's: sum 0, prod 1, any False, all
    True), the zero of a product with an inner size of 0, the value of a constant pad of an
    empty tensor, a copy of a scatter's input when its index is empty, a ``cat`` of its
    non-empty pieces. A kernel reading nothing would only write a constant or copy; the
    constant folds into what follows (the NaN of a mean over nothing)."""
    if node.numel == 0:  # whatever it computes, nothing: what it reads is not needed
        return node if node.op == "expand" and node.inputs[0].op == "const" else _filled(node, 0)
    if not any(child.numel == 0 for child in node.inputs):
        return node
    if node.op == "cat":
        pieces = tuple(child for child in node.inputs if child.numel)
        if len(pieces) > 1:
            return make_node("cat", pieces, dict(node.attrs), node.site)
        return make_node("copy", pieces, {}, node.site)  # a result of its own memory
    if node.op in _SCATTERS:
        if node.inputs[1].numel:
            return node
        return make_node("copy", node.inputs[:1], {}, node.site)
    if node.op in _CONTRACTIONS:
        value = 0
    elif node.op == "pad":
        value = node.attr("value")
    elif get_op(node.op).kind == "reduce":
        value = _identity(node.op, node.dtype)
        if value is None:
            return node
    else:
        return node
    return _filled(node, value)


def _filled(node: Node, value) -> Node:
    """A constant of ``node``'s type and shape (a broadcast scalar: no memory is read)."""
    constant = make_const(value, node.dtype, node.site, round_to_dtype=True)
    if node.shape == ():
        return constant
    return make_node("expand", (constant,), {"shape": node.shape}, node.site)


def _identity(op: str, dtype):
    if op == "reduce_sum":
        return 0
    if op == "reduce_prod":
        return 1
    if op not in ("reduce_max", "reduce_min"):
        return None
    largest = op == "reduce_min"  # the identity of a min is the largest value
    if dtype.is_bool:
        return largest
    if dtype.is_float:
        return math.inf if largest else -math.inf
    limits = np.iinfo(dtype.numpy)
    return int(limits.max if largest else limits.min)
