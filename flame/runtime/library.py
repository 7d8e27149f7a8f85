"""Ops computed by library routines instead of generated kernels.

An op declared with ``kind="library"`` names its implementation here, by op name. Each
implementation takes the node (for its attrs and result type) and the CuPy arrays of its
inputs, and returns a new C-contiguous CuPy array of the node's shape (bfloat16 as uint16
bits, as everywhere on the CUDA backend).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from flame.ir.node import Node

IMPLEMENTATIONS: dict[str, Callable] = {}
# Modules whose ``@implements`` functions register themselves; imported on the first call
# that needs one, so ``import flame`` does not pay for them.
IMPLEMENTATION_MODULES = (
    "flame.runtime.library_linalg",
    "flame.runtime.library_indexing",
    "flame.runtime.library_joining",
    "flame.runtime.library_scan",
    "flame.runtime.library_conv",
    "flame.runtime.library_attention",
)


def implements(op_name: str):
    def register(function):
        IMPLEMENTATIONS[op_name] = function
        return function

    return register


def _view(node: Node, arrays: list):
    """A graph output that is a view of a library result: the strided array the plan
    resolved (``LibraryCall.plan``), handed out as it is."""
    return arrays[0]


for _movement in ("reshape", "slice", "permute"):
    IMPLEMENTATIONS[_movement] = _view


def run_library(node: Node, arrays: list):
    implementation = IMPLEMENTATIONS.get(node.op)
    if implementation is None:
        for module in IMPLEMENTATION_MODULES:
            importlib.import_module(module)
        implementation = IMPLEMENTATIONS.get(node.op)
    if implementation is None:
        raise RuntimeError(f"{node.op} has no CUDA implementation registered")
    return implementation(node, arrays)


def strided_array(array, shape, strides, offset: int = 0):
    """A CuPy view of ``array``'s memory with the given shape, element ``strides`` and element
    ``offset`` (a movement chain over an input, resolved to a strided view). Handing library
    routines such views instead of materialized copies lets ``a @ b.T`` reach cuBLAS as a
    transpose flag; the implementations read any strides."""
    import cupy

    item = array.itemsize
    pointer = array.data + offset * item
    byte_strides = tuple(stride * item for stride in strides)
    return cupy.ndarray(tuple(shape), dtype=array.dtype, memptr=pointer, strides=byte_strides)
