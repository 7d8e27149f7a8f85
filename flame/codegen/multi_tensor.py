"""Lowering of one elementwise rule applied to many tensors in one launch ("multi-tensor").

An optimizer step applies the same elementwise rule (``p, g, m, v -> p', m', v'``) to every
parameter. One launch per parameter costs a launch each and leaves small tensors unable to
fill the GPU; one launch over a table of pointers does not. The rule is lowered exactly like
an elementwise kernel over one flat contiguous tensor; this module then turns the buffers
that vary per tensor into entries of a table the kernel reads:

- ``table``: one row per tensor: the address of each per-tensor operand, then its length;
- ``chunks``: one row per block: (tensor index, first element); every chunk is
  ``chunk_size`` elements long except each tensor's last;
- operands shared by every tensor (the optimizer's hyperparameters, read as scalars from a
  small device buffer so that a new learning rate is data, not code) stay kernel parameters.
"""

from __future__ import annotations

import math

from flame import records
from flame.codegen.elementwise import Lowered, lower_elementwise
from flame.codegen.spec import Arg, KernelSpec
from flame.ir.graph import Group
from flame.ir.node import Node
from flame.records import Record

CHUNK = 16384  # elements per block: 4+ blocks per SM for a few large tensors (AdamW of an MLP)


class MultiTensorLowered(Record, frozen=True):
    spec: KernelSpec
    per_tensor: tuple[tuple[str, int], ...]  # table columns: ("in" | "out", operand position)
    shared: tuple[Node, ...]  # buffers every tensor's launch reads, by ``in`` operand order
    lowered: Lowered


def lower_multi_tensor(group: Group, varying: set[int], aligned: bool, wide: bool):
    """``varying``: ids of the placeholder nodes that stand for one tensor of each list;
    ``aligned``: every per-tensor address is 16-byte aligned (vector loads); ``wide``: some
    tensor has 2**31 elements or more (64-bit indices)."""

    def layout_of(node: Node):
        if id(node) in varying:
            return (1,), aligned
        return (1,) * len(node.shape), True  # shared operands: read as scalars

    lowered = lower_elementwise(group, layout_of)
    spec = lowered.spec
    columns, params, shared = [], [], []
    renames = {}
    for arg in spec.params:
        if arg.kind == "out":
            columns.append(("out", arg.operand))
            renames[arg.name] = (arg, len(columns) - 1)
        elif arg.kind == "in" and id(lowered.reads[arg.operand]) in varying:
            columns.append(("in", arg.operand))
            renames[arg.name] = (arg, len(columns) - 1)
        elif arg.kind == "in":
            shared.append(lowered.reads[arg.operand])
            params.append(records.replace(arg, operand=len(shared) - 1))
        elif arg.name != "n":
            params.append(arg)
    index = "long long" if wide else "int"
    locals_ = tuple(
        (arg.ctype.replace(" __restrict__", ""), arg.name, column)
        for arg, column in renames.values()
    )  # fmt: skip
    multi = records.replace(
        spec,
        name=spec.name.replace("flame_ew_", "flame_mt_", 1),
        template="multi_tensor.cu.j2",
        index_type=index,
        params=tuple(params),
        extras={"columns": locals_, "width": len(columns) + 1, "chunk": CHUNK},
    )
    return MultiTensorLowered(multi, tuple(columns), tuple(shared), lowered)


# --- the global norm of many tensors (flame/ir/ops/multi_tensor.py) ----------------------------

NORM_BLOCK = 256  # threads per chunk of CHUNK elements: 64 each
NORM_FINISH_BLOCK = 512  # the one block that combines every chunk's partial result
NORM_WIDTH = 4  # table columns per tensor: address, length, dtype code, 16-byte aligned
NORM_DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2, "float64": 3}


def norm_kind(p: float) -> str:
    """The code a norm of order ``p`` needs: ``l1``, ``l2``, ``linf``, or ``lp`` (any other
    order, read from a kernel argument: p = 3 and p = 4 share one kernel)."""
    if math.isinf(p):
        return "linf"
    return {1.0: "l1", 2.0: "l2"}.get(p, "lp")


def lower_global_norm(kind: str, stage: str) -> KernelSpec:
    """The two kernels of a global norm of kind ``kind`` (``norm_kind``): ``partials`` (one
    block per chunk of one tensor; the table columns are ``NORM_WIDTH``) and ``finish`` (one
    block: the chunks' results combined in a fixed order, then the root)."""
    if kind not in ("l1", "l2", "linf", "lp"):
        raise ValueError(f"global_norm: unknown norm kind {kind!r}")
    if stage == "partials":
        params = (
            Arg("in", "const long long* __restrict__", "table"),
            Arg("in", "const long long* __restrict__", "chunks"),
            Arg("out", "float* __restrict__", "partials"),
            Arg("value", "float", "p"),
        )
        block = NORM_BLOCK
    elif stage == "finish":
        params = (
            Arg("in", "const float* __restrict__", "partials"),
            Arg("size", "int", "count"),
            Arg("value", "float", "inverse_p"),
            Arg("out", "float* __restrict__", "out"),
        )
        block = NORM_FINISH_BLOCK
    else:
        raise ValueError(f"global_norm: unknown kernel stage {stage!r}")
    return KernelSpec(
        name=f"flame_mt_norm_{kind}_{stage}",
        template="multi_tensor.cu.j2",
        index_type="long long",
        vec=1,
        block=block,
        params=params,
        header=(f"global_norm ({kind}), {stage}",),
        helpers=(),
        setup=(),
        prologue=(),
        body=(),
        epilogue=(),
        extras={"norm": kind, "stage": stage, "chunk": CHUNK, "width": NORM_WIDTH},
        size_class=f"chunks of {CHUNK}",
    )
