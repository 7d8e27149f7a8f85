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

from flame import records
from flame.codegen.elementwise import Lowered, lower_elementwise
from flame.codegen.spec import KernelSpec
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
