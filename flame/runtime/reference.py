"""The reference interpreter: runs any graph with NumPy.

It is the oracle of the test suite (``precision=np.float64`` evaluates every float op in
float64), the backend of machines without a GPU (``FLAME_BACKEND=reference``), and the
explanation of a result. It runs the graph exactly as built: no passes, no fusion.
"""

from __future__ import annotations

import numpy as np

from flame.ir.evaluate import evaluate_elementwise, evaluate_leaf, evaluate_other
from flame.ir.graph import is_input
from flame.ir.node import Node, format_site, toposort
from flame.ir.ops import get_op


def _is_data(node: Node) -> bool:
    return node.op == "buffer"


def input_value(node: Node) -> np.ndarray:
    storage = node.attr("storage") if node.op == "buffer" else node.buffer
    return storage.numpy()


def evaluate(outputs, precision=None, inputs=None, realized=True) -> list[np.ndarray]:
    """Values of ``outputs``. ``inputs`` may map ``id(node)`` to an array to use instead of a
    node's value (the checker feeds one kernel's inputs this way). With ``realized=False``
    values already computed are ignored and the whole graph runs from its data leaves: the
    oracle tests use, independent of what the GPU computed before."""
    values: dict[int, np.ndarray] = {}
    is_leaf = is_input if realized else _is_data
    for node in toposort(outputs, stop=is_leaf):
        if inputs is not None and id(node) in inputs:
            values[id(node)] = np.asarray(inputs[id(node)])
        elif is_leaf(node):
            array = input_value(node)
            if precision is not None and node.dtype.is_float:
                array = array.astype(precision)
            values[id(node)] = array
        else:
            values[id(node)] = _evaluate_node(node, values, precision)
    return [values[id(node)] for node in outputs]


def _evaluate_node(node: Node, values, precision):
    kind = get_op(node.op).kind
    if kind == "leaf":
        return evaluate_leaf(node, precision)
    arguments = [values[id(child)] for child in node.inputs]
    if kind == "elementwise":
        return evaluate_elementwise(node, arguments, precision)
    try:
        return evaluate_other(node, arguments, precision)
    except IndexError as error:  # an index found out of range: name the op's line
        if node.site is not None and len(error.args) == 1 and "built at" not in str(error):
            error.args = (f"{error.args[0]} (the op was built at {format_site(node.site)})",)
        raise


def realize(nodes, storage_factory) -> None:
    """Compute ``nodes`` and memoize each result as a contiguous NumPy array."""
    pending = [node for node in nodes if node.buffer is None and node.op != "buffer"]
    for node, value in zip(pending, evaluate(pending)):
        array = np.asarray(value, dtype=node.dtype.numpy)
        # ascontiguousarray makes a 0-d value 1-d; a copy keeps the shape
        array = array if array.flags.c_contiguous else array.copy(order="C")
        node.buffer = storage_factory(node.dtype, array)
