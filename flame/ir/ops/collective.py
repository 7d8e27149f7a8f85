"""Collectives as library ops: ``all_reduce``, ``broadcast``, ``all_gather``, ``reduce_scatter``.

Each is one node over one tensor, computed on the GPU by NCCL (flame/runtime/library_nccl.py)
on FLAME's stream, so it sits in plans and compiled programs like a cuBLAS call (CUDA-graph
capture: see flame/runtime/library_nccl.py).
The attributes say which communicator runs it and what the result looks like:

* ``group``: the name of the NCCL communicator (``flame.distributed`` makes one per process
  group; the name is the same on every rank, so every rank builds the same graph);
* ``world``: the number of ranks in that group (the shapes of ``all_gather`` and
  ``reduce_scatter`` depend on it);
* ``op`` (``all_reduce``, ``reduce_scatter``): ``sum avg product max min``, as
  ``flame.distributed.ReduceOp``; ``src`` (``broadcast``): the rank whose value everyone gets.

Shapes: ``all_reduce(x)`` and ``broadcast(x)`` keep x's; ``all_gather(x)`` is
``[world, *x.shape]`` (row r: rank r's x); ``reduce_scatter(x)`` takes ``[world, *rest]``
(row r: what this rank contributes to rank r) and gives ``rest``.

The NumPy references run one process, so they are the collectives of a world of one (a copy,
a new leading axis, its removal); over a larger world they raise, naming the op and the world:
the reference interpreter cannot see the other ranks' values (the ``gloo`` backend runs CPU
tensors instead). Collectives are not differentiable (as ``torch.distributed``'s are not).
"""

from __future__ import annotations

import numpy as np

from flame.ir.ops.registry import def_op
from flame.ir.shapes import ShapeError

REDUCE_OPS = ("sum", "avg", "product", "max", "min")
# the dtypes NCCL has (bool travels as uint8); int16 has no NCCL type
NCCL_DTYPES = ("bool", "uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32",
               "float64")  # fmt: skip
COLLECTIVE_OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")


def _shown(node) -> str:
    return f"{node.dtype.name}{list(node.shape)}"


def _check_common(name: str, node, attrs) -> int:
    """The checks every collective shares; returns the world size."""
    if node.dtype.name not in NCCL_DTYPES:
        raise TypeError(
            f"{name}: NCCL has no {node.dtype.name} type (got {_shown(node)}); supported: "
            f"{', '.join(NCCL_DTYPES)}; cast first, e.g. x.to(flame.int32)"
        )
    world = attrs.get("world", 1)
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"{name}: world must be a positive int, got {world!r}")
    group = attrs.get("group", "")
    if not isinstance(group, str):
        raise TypeError(f"{name}: group must be a communicator name (str), got {group!r}")
    return world


def _check_reduce_op(name: str, node, attrs) -> None:
    op = attrs.get("op", "sum")
    if op not in REDUCE_OPS:
        raise ValueError(f"{name}: op must be one of {', '.join(REDUCE_OPS)}, got {op!r}")
    if node.dtype.name == "bool" and op == "avg":
        raise TypeError(f"{name}: op avg is not defined for bool tensors (got {_shown(node)})")


def _all_reduce_rule(inputs, attrs):
    (node,) = inputs
    _check_common("all_reduce", node, attrs)
    _check_reduce_op("all_reduce", node, attrs)
    return node.dtype, tuple(node.shape)


def _broadcast_rule(inputs, attrs):
    (node,) = inputs
    world = _check_common("broadcast", node, attrs)
    src = attrs.get("src", 0)
    if not isinstance(src, int) or isinstance(src, bool) or not 0 <= src < world:
        raise ValueError(f"broadcast: src {src!r} is outside the world of {world} ranks")
    return node.dtype, tuple(node.shape)


def _all_gather_rule(inputs, attrs):
    (node,) = inputs
    world = _check_common("all_gather", node, attrs)
    return node.dtype, (world, *node.shape)


def _reduce_scatter_rule(inputs, attrs):
    (node,) = inputs
    world = _check_common("reduce_scatter", node, attrs)
    _check_reduce_op("reduce_scatter", node, attrs)
    if not node.shape or node.shape[0] != world:
        raise ShapeError(
            f"reduce_scatter: the input must be [world, ...] with world = {world} (one row per "
            f"rank), got {_shown(node)}"
        )
    return node.dtype, tuple(node.shape[1:])


def _one_process(name: str, world: int) -> None:
    if world != 1:
        raise RuntimeError(
            f"{name} over a world of {world} ranks has no reference on one process: the "
            "reference interpreter cannot see the other ranks' values (run it on the GPU "
            "through NCCL, or use the gloo backend for CPU tensors)"
        )


def _all_reduce_ref(x, op="sum", world=1, group=""):
    _one_process("all_reduce", world)
    return np.array(x, copy=True)  # sum, avg, product, max and min of one value: the value


def _broadcast_ref(x, src=0, world=1, group=""):
    _one_process("broadcast", world)
    return np.array(x, copy=True)


def _all_gather_ref(x, world=1, group=""):
    _one_process("all_gather", world)
    return np.array(x, copy=True)[None]


def _reduce_scatter_ref(x, op="sum", world=1, group=""):
    _one_process("reduce_scatter", world)
    return np.array(x[0], copy=True)


_COMMON = {"kind": "library", "arity": 1, "differentiable": False}

def_op(
    "all_reduce", ref=_all_reduce_ref, shape_rule=_all_reduce_rule,
    attrs={"op": "sum", "world": 1, "group": ""}, **_COMMON,
    doc="every rank's tensor combined with op (NCCL allReduce); the result on every rank",
)  # fmt: skip
def_op(
    "broadcast", ref=_broadcast_ref, shape_rule=_broadcast_rule,
    attrs={"src": 0, "world": 1, "group": ""}, **_COMMON,
    doc="rank src's tensor on every rank (NCCL broadcast)",
)  # fmt: skip
def_op(
    "all_gather", ref=_all_gather_ref, shape_rule=_all_gather_rule,
    attrs={"world": 1, "group": ""}, **_COMMON,
    doc="[world, *shape]: row r is rank r's tensor (NCCL allGather)",
)  # fmt: skip
def_op(
    "reduce_scatter", ref=_reduce_scatter_ref, shape_rule=_reduce_scatter_rule,
    attrs={"op": "sum", "world": 1, "group": ""}, **_COMMON,
    doc="[world, *rest] -> rest: row r combined over every rank with op, on rank r "
    "(NCCL reduceScatter)",
)  # fmt: skip
