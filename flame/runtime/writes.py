"""When a plan may write a result straight into memory its inputs read (in-place writes:
``Executor.realize_into`` in lazy mode, ``flame.effects.direct_writes`` in compiled
programs)."""

from __future__ import annotations

from flame.ir.node import Node
from flame.runtime.launch import Launch


def reads_elementwise(order, aliased: list[Node], shape) -> bool:
    """Whether every node of ``order`` that reads one of ``aliased`` (inputs whose memory a
    result will be written into) is elementwise over ``shape``: each element is then read
    before, or by the thread that, writes it (a view or a reduction could read it after)."""
    from flame.ir.ops import get_op

    readers = {id(node) for node in aliased}
    if not readers:
        return True
    for member in order:
        if any(id(child) in readers for child in member.inputs):
            if get_op(member.op).kind != "elementwise" or member.shape != shape:
                return False
    return True


def writable(plan, out_slot: int, aliased_slots) -> bool:
    """Whether ``plan`` can write output ``out_slot`` into memory that its input slots
    ``aliased_slots`` read: a FLAME kernel writes it (not a library call), without zeroing
    it first (atomic sums), and no later step reads those inputs."""
    writer = next(
        (index for index, step in enumerate(plan.launches)
         if isinstance(step, Launch) and any(slot == out_slot for slot, _ in step.writes)),
        None,
    )  # fmt: skip
    if writer is None or any(slot == out_slot for slot, _ in plan.launches[writer].zeroed):
        return False
    from flame.runtime.executor import _reads  # executor imports this module

    later = (slot for step in plan.launches[writer + 1 :] for slot in _reads(step))
    return not any(slot in aliased_slots for slot in later)
