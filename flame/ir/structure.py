"""A graph's structure with its sizes erased: what stays the same when a compiled step is
called at another image size or batch size.

``structure_key(graph)`` is a tuple, one entry per node of ``graph.nodes`` (inputs before
users, the graph's own deterministic order) and one for the outputs. Two graphs with equal
keys have the same nodes at the same positions, reading the same positions, with the same
ops, dtypes and attributes other than sizes, and differ only in sizes. Kept per node:

* op, dtype, rank, and which dimensions are 1 (the broadcast pattern);
* attributes, verbatim, except those listed in ``SIZE_ATTRS`` (reshape and expand targets,
  slice bounds, pad widths, a transposed convolution's input size), which are replaced by
  what does not change with sizes: for a reshape, which dimensions of its input and output
  line up (the positions where their leading products agree: what makes a reshape a
  strided view); for a slice, per dimension, whether it starts at 0 and ends at the end;
  for a pad, which sides it pads; a barrier's token is "a token";
* a constant's value, unless it is a size: a float made from sizes (a ``sized`` constant:
  ``1/n`` of a mean) keeps its role, an integer keeps whether it is 0, 1 or another value
  (a random draw's counter offset is the count of numbers drawn before it);
* an input's layout as the order of its strides, which are 0, whether it is contiguous and
  whether it is aligned, never the strides themselves.

Computed leaves (constants, ``arange``) are no entries of their own: each reader spells them
inline (``is_inline``), since CSE merges two leaves whose values coincide at one size only.
Which shapes are equal is not in the key (sizes coincide at one size and not at another);
whoever reuses a decision that depends on equal shapes checks them (passes/reuse.py).

An attribute not listed is kept as it is: an unlisted size makes keys differ at two sizes
(no reuse, never a wrong one). ``first_difference`` names where two graphs' keys part, for
tests and notes.
"""

from __future__ import annotations

from flame.ir.graph import Graph, is_input
from flame.ir.node import Node, Token
from flame.ir.shapes import contiguous_strides

# (op, attribute) pairs whose values are sizes; see ``_erased``
SIZE_ATTRS = frozenset(
    {("reshape", "shape"), ("expand", "shape"), ("slice", "starts"), ("slice", "stops"),
     ("conv_data_grad", "input_size"), ("pad", "widths")}
)  # fmt: skip


def structure_key(graph: Graph) -> tuple:
    """The graph's structure without sizes: equal for two graphs that differ only in sizes
    (see the module docstring)."""
    return structure(graph)[0]


def structure(graph: Graph) -> tuple[tuple, list[Node]]:
    """``(structure_key(graph), order)``: ``order`` is ``graph.nodes`` without the leaves
    spelled inline (``is_inline``), the nodes the key's positions count."""
    order = [node for node in graph.nodes if not is_inline(node)]
    position = {id(node): index for index, node in enumerate(order)}
    parts = []
    for node in order:
        inputs = tuple([
            position[id(child)] if id(child) in position else _leaf(child)
            for child in node.inputs
        ])  # fmt: skip
        parts.append((node.op, node.dtype.name, _ones(node.shape), _attrs(node), inputs))
    outputs = tuple(
        position[id(node)] if id(node) in position else _leaf(node) for node in graph.outputs
    )  # fmt: skip
    parts.append(outputs)
    return tuple(parts), order


def is_inline(node: Node) -> bool:
    """A computed leaf (a constant, an ``arange``): spelled out where it is read, not
    counted as a node. Common-subexpression elimination merges two leaves whose values
    happen to be equal (a random draw's counter offset and a tensor's element count, at
    one size), which would otherwise change the graph's shape at that size only."""
    return not node.inputs and node.op != "buffer" and node.buffer is None


def _leaf(node: Node) -> tuple:
    return ("leaf", node.op, node.dtype.name, _ones(node.shape), _attrs(node))


def _ones(shape: tuple) -> tuple:
    return tuple([size == 1 for size in shape])


def _attrs(node: Node) -> tuple:
    if is_input(node):
        storage = node.buffer if node.buffer is not None else node.attr("storage")
        return ("input", storage.backend, _layout(node.shape, storage.layout()))
    if node.op == "const":
        sized = node.attr("sized") is not None  # a float made from sizes: its role is kept
        return tuple(
            (name, "size" if sized and name == "value" else _constant(value))
            for name, value in node.attrs
        )  # fmt: skip
    op = node.op
    return tuple(
        (name, _erased(node, name, value)) if (op, name) in SIZE_ATTRS
        else (name, "token") if type(value) is Token else (name, value)
        for name, value in node.attrs
    )  # fmt: skip


def _constant(value):
    if isinstance(value, int) and not isinstance(value, bool):
        return ("int", value if value in (0, 1) else "other")
    return value


def _erased(node: Node, name: str, value) -> tuple:
    if node.op == "reshape":
        return ("aligned", _aligned_prefixes(node.inputs[0].shape, node.shape))
    if node.op == "slice":
        if name == "starts":
            return ("at start", tuple(start == 0 for start in value))
        full = node.inputs[0].shape
        return ("to end", tuple(stop >= size for stop, size in zip(value, full)))
    if node.op == "pad":
        return ("padded", tuple((before > 0, after > 0) for before, after in value))
    return ("sizes", tuple(size == 1 for size in value))


def _aligned_prefixes(before: tuple, after: tuple) -> tuple:
    """The (i, j) where ``before[:i]`` and ``after[:j]`` hold the same number of elements:
    the dimensions a reshape keeps, splits or merges."""
    left, right = _prefix_products(before), _prefix_products(after)
    return tuple((i, j) for i, count in enumerate(left) for j, other in enumerate(right)
                 if count == other)  # fmt: skip


def _prefix_products(shape: tuple) -> list[int]:
    products = [1]
    for size in shape:
        products.append(products[-1] * size)
    return products


def _layout(shape: tuple, layout: tuple) -> tuple:
    strides, aligned = layout[0], layout[1]
    order = tuple(sorted(range(len(shape)), key=lambda axis: (-strides[axis], axis)))
    zeros = tuple(stride == 0 for stride in strides)
    return (order, zeros, tuple(strides) == contiguous_strides(shape), aligned, *layout[2:])


def first_difference(left: tuple, right: tuple) -> str | None:
    """Where two structure keys part: None when equal, else the first differing node's
    position and both entries."""
    if left == right:
        return None
    for index, (a, b) in enumerate(zip(left, right)):
        if a != b:
            return f"node {index}: {a!r} != {b!r}"
    return f"lengths {len(left)} != {len(right)}"
