"""Sums of zero-padded pieces become one ``cat``.

The backward of a slice pads the slice's cotangent with zeros back to the full shape
(flame/grad_functions.py, ``unslice_axis``). When a tensor is split into pieces (``chunk``,
``split``, ``qkv[..., :D]``, a DiT's adaLN ``chunk(6)``), autograd sums the pieces' padded
cotangents: ``add(add(pad(g1), pad(g2)), pad(g3))``. Each ``pad`` is a library call that
writes the whole tensor (fill + copy), and the adds read them all again.

Afterwards: in a tree of ``add`` nodes (any association; an inner add is part of the tree
when the tree's next add is its only reader), two or more leaves that are ``pad`` nodes with
the value +0, each padding one and the same axis, with pairwise disjoint non-zero ranges,
are one ``cat`` of their pieces in axis order: with no pad at all when the pieces cover the
axis, with one final ``pad`` of the ``cat`` when they cover one contiguous run, with
zero-filled tensors in the gaps otherwise. The tree's other leaves are added to it as before.

Exactness: at every element at most one of the joined pads is non-zero, and adding +0 is
exact, so the values are the same -- except for the sign of zero: ``-0.0 + 0.0`` is
``+0.0``, so the sum turned a piece's ``-0.0`` into ``+0.0`` where the ``cat`` keeps
``-0.0`` (as PyTorch does: its backward of ``split`` is a ``cat``). When other leaves are
added too, the rewrite fires only where the order of their additions stays the same: they
form one subtree of the original tree beside the joined pads (see ``_others_subtree``).
"""

from __future__ import annotations

import math
from collections import defaultdict

from flame.ir.graph import Graph, is_input
from flame.ir.infer import make_const, make_node
from flame.ir.node import Node
from flame.ir.passes.rewrite import with_inputs


def join_padded_sums(graph: Graph) -> Graph:
    inner = _inner_adds(graph)
    mapped: dict[int, Node] = {}
    for node in graph.nodes:
        if is_input(node):
            mapped[id(node)] = node
            continue
        rebuilt = with_inputs(node, tuple(mapped[id(child)] for child in node.inputs))
        joined = None
        if node.op == "add" and id(node) not in inner:  # the root of an add tree
            joined = _joined(node, inner, mapped)
        mapped[id(node)] = rebuilt if joined is None else joined
    return Graph(tuple(mapped[id(node)] for node in graph.outputs), graph.name)


def _inner_adds(graph: Graph) -> set[int]:
    """The adds that belong to the add tree of their one reader: read once, by an add, and
    not an output of the graph (a value read elsewhere is computed anyway)."""
    readers: dict[int, list[Node]] = defaultdict(list)
    for node in graph.nodes:
        if not is_input(node):
            for child in node.inputs:
                readers[id(child)].append(node)
    outputs = {id(node) for node in graph.outputs}
    return {
        id(node)
        for node in graph.nodes
        if node.op == "add"
        and not is_input(node)
        and id(node) not in outputs
        and len(readers[id(node)]) == 1
        and readers[id(node)][0].op == "add"
    }


def _tree(root: Node, inner: set[int]) -> tuple[list[Node], list[Node]]:
    """The add tree at ``root`` (original nodes): its operands left to right, and its adds,
    each after the adds below it. Iterative: a long chain of accumulations is one tree."""
    leaves, adds = [], []
    stack = [(root, "visit")]
    while stack:
        node, state = stack.pop()
        if state == "leaf":
            leaves.append(node)
        elif state == "done":
            adds.append(node)
        else:
            stack.append((node, "done"))
            for child in reversed(node.inputs):
                stack.append((child, "visit" if _is_inner(child, inner) else "leaf"))
    return leaves, adds


def _is_inner(node: Node, inner: set[int]) -> bool:
    return node.op == "add" and id(node) in inner


def padded_range(node: Node) -> tuple[int, int, int] | None:
    """``(axis, start, end)`` when ``node`` pads its input with +0 along one axis only: the
    input sits at ``[start, end)`` of that axis. None otherwise."""
    if node.op != "pad" or is_input(node):
        return None
    value = node.attr("value")
    if value != 0 or (isinstance(value, float) and math.copysign(1.0, value) < 0):
        return None  # a -0.0 fill: the sum of such pads keeps -0.0 in the gaps
    axes = [axis for axis, pair in enumerate(node.attr("widths")) if tuple(pair) != (0, 0)]
    if len(axes) != 1:
        return None
    (axis,) = axes
    start = node.attr("widths")[axis][0]
    return axis, start, start + node.inputs[0].shape[axis]


def _chosen_pads(leaves: list[Node]) -> list[Node]:
    """The pads to join: of the axis with the most, a greedy set of disjoint ranges, in
    axis order (ties: the lowest axis). Fewer than two: nothing to join."""
    by_axis: dict[int, list[Node]] = defaultdict(list)
    for leaf in leaves:
        placed = padded_range(leaf)
        if placed is not None:
            by_axis[placed[0]].append(leaf)
    best: list[Node] = []
    for axis in sorted(by_axis):
        chosen, end = [], 0
        for pad in sorted(by_axis[axis], key=lambda leaf: padded_range(leaf)[1:]):
            start, stop = padded_range(pad)[1:]
            if start >= end:
                chosen.append(pad)
                end = stop
        if len(chosen) > len(best):
            best = chosen
    return best if len(best) >= 2 else []


def _others_subtree(root: Node, inner: set[int], adds, chosen: set[int]) -> Node | None | bool:
    """The one node of the original tree whose operands are exactly the leaves not joined,
    found by walking down from ``root`` past subtrees made only of joined pads. The sum
    then keeps its value: every element holds ``others + piece`` before and after. None when
    every leaf is joined; False when the other leaves are spread over the tree (joining would
    change the order of their additions, hence the rounding)."""
    counts: dict[int, tuple[int, int]] = {}  # per add of the tree: (joined, other) leaves

    def count(node: Node) -> tuple[int, int]:
        if _is_inner(node, inner):
            return counts[id(node)]
        return (1, 0) if id(node) in chosen else (0, 1)

    for add in adds:
        below = [count(child) for child in add.inputs]
        counts[id(add)] = (sum(pair[0] for pair in below), sum(pair[1] for pair in below))
    node = root
    while True:
        mixed = [child for child in node.inputs if count(child)[1]]
        if not mixed:
            return None
        if len(mixed) > 1:
            return False
        (child,) = mixed
        if count(child)[0] == 0:
            return child  # a leaf not joined, or a subtree of such leaves only
        node = child


def _joined(root: Node, inner: set[int], mapped: dict[int, Node]) -> Node | None:
    """The add tree at ``root`` with its joinable pads as one cat, or None."""
    leaves, adds = _tree(root, inner)
    pads = _chosen_pads(leaves)
    if not pads:
        return None
    others = _others_subtree(root, inner, adds, {id(pad) for pad in pads})
    if others is False:
        return None
    joined = _cat_of(pads, mapped, root)
    if others is None:
        return joined
    return make_node("add", (mapped[id(others)], joined), {}, root.site)


def _cat_of(pads: list[Node], mapped: dict[int, Node], root: Node) -> Node:
    """The pads' pieces in axis order, joined once: a cat, zeros in the gaps between them,
    and a final pad where only the ends are missing."""
    axis = padded_range(pads[0])[0]
    size = root.shape[axis]
    spans = [padded_range(pad)[1:] for pad in pads]
    pieces = [mapped[id(pad)].inputs[0] for pad in pads]
    inner_gaps = any(stop != start for (_, stop), (start, _) in zip(spans, spans[1:]))
    if not inner_gaps:
        joined = make_node("cat", tuple(pieces), {"dim": axis}, root.site)
        low, high = spans[0][0], size - spans[-1][1]
        if (low, high) == (0, 0):
            return joined
        widths = tuple((low, high) if dim == axis else (0, 0) for dim in range(len(root.shape)))
        attrs = {"widths": widths, "value": pads[0].attr("value")}
        return make_node("pad", (joined,), attrs, root.site)
    parts, end = [], 0
    for (start, stop), piece in zip(spans, pieces):
        if start > end:
            parts.append(_zeros(root, axis, start - end))
        parts.append(piece)
        end = stop
    if end < size:
        parts.append(_zeros(root, axis, size - end))
    return make_node("cat", tuple(parts), {"dim": axis}, root.site)


def _zeros(root: Node, axis: int, count: int) -> Node:
    shape = tuple(count if dim == axis else size for dim, size in enumerate(root.shape))
    zero = make_const(0, root.dtype, root.site, round_to_dtype=True)
    return make_node("expand", (zero,), {"shape": shape}, root.site)
