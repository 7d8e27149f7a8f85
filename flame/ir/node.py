"""The IR's one node type.

A ``Node`` is immutable and hashed by structure: op name, attributes, result type and inputs.
Two nodes built the same way from the same leaves compare equal, which is what
common-subexpression elimination and the kernel caches rely on. Leaves that hold data
(``buffer``) carry their ``Storage``, which is hashed by identity: two different arrays are
two different leaves.

There is no graph object to register nodes in and no global counter: a graph is whatever is
reachable from the nodes a tensor holds.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from flame.ir.dtypes import DType

FLAME_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


Site = tuple  # (filename, line): where a node was built, the first frame outside FLAME


class Token:
    """A unique attribute value: two nodes that differ only by their token are different
    values (a recomputation must not be merged with the forward it repeats)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "token"


def format_site(site) -> str:
    return f"{os.path.basename(site[0])}:{site[1]}"


def user_site() -> Site | None:
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(FLAME_DIR):
        frame = frame.f_back
    if frame is None:
        return None
    return (frame.f_code.co_filename, frame.f_lineno)


class Node:
    """One single-assignment value of the IR.

    ``buffer`` is a memo, not structure: once a node has been computed its result is kept
    there, so later graphs that reach this node read it instead of computing it again.
    ``grad_info`` is not structure either: it says which user tensor wants this value's
    gradient and which hooks rewrite it (flame/autograd.py).
    """

    __slots__ = ("op", "inputs", "attrs", "dtype", "shape", "site", "buffer", "grad_info", "_hash")

    def __init__(
        self,
        op: str,
        inputs: tuple[Node, ...],
        attrs: tuple[tuple[str, Any], ...],
        dtype: DType,
        shape: tuple[int, ...],
        site: Site | None = None,
    ):
        self.op = op
        self.inputs = inputs
        self.attrs = attrs
        self.dtype = dtype
        self.shape = shape
        self.site = site
        self.buffer = None
        self.grad_info = None  # autograd: the leaf tensor that asked for a gradient, hooks
        self._hash = None  # computed on first use: building a graph should not pay for it

    def __hash__(self) -> int:
        if self._hash is None:
            for node in toposort((self,), stop=lambda n: n._hash is not None):
                if node._hash is None:
                    children = [child._hash for child in node.inputs]
                    node._hash = hash((node.op, node.attrs, node.dtype.name, node.shape, *children))
        return self._hash

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if not isinstance(other, Node) or hash(self) != hash(other):
            return False
        # Iterative, so that two long identical chains do not exhaust the recursion limit.
        stack = [(self, other)]
        while stack:
            left, right = stack.pop()
            if left is right:
                continue
            if not left._same_local(right):
                return False
            stack.extend(zip(left.inputs, right.inputs))
        return True

    def _same_local(self, other: Node) -> bool:
        return (
            hash(self) == hash(other)
            and self.op == other.op
            and self.dtype is other.dtype
            and self.shape == other.shape
            and self.attrs == other.attrs
            and len(self.inputs) == len(other.inputs)
        )

    def attr(self, name: str, default=None):
        for key, value in self.attrs:
            if key == name:
                return value
        return default

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    def __repr__(self) -> str:
        shape = ",".join(str(size) for size in self.shape)
        return f"Node({self.op}: {self.dtype.short}[{shape}])"


def toposort(outputs, stop=None, children=None) -> list[Node]:
    """Nodes reachable from ``outputs``, inputs before users, in a deterministic order.

    ``stop(node)`` true means: treat the node as a leaf (do not visit its inputs);
    ``children(node)`` replaces ``node.inputs`` as the edges to follow (autograd adds a
    checkpoint's arguments).
    """
    order: list[Node] = []
    seen: set[int] = set()
    for root in outputs:
        if id(root) in seen:
            continue
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.append((node, True))
            if stop is not None and stop(node):
                continue
            for child in reversed(node.inputs if children is None else children(node)):
                if id(child) not in seen:
                    stack.append((child, False))
    return order
