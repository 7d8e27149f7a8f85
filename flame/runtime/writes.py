"""When a plan may write a result straight into memory its inputs read (in-place writes:
``Executor.realize_into`` in lazy mode, ``flame.effects.direct_writes`` in compiled
programs)."""

from __future__ import annotations

from flame.ir.node import Node
from flame.runtime.launch import Launch


class Readers:
    """The nodes of an ``order`` that read each value, indexed once: a compiled program asks
    ``reads_elementwise`` once per in-place write (a training step: one per parameter and
    optimizer state, ~1200 for the diffusion UNet), and each walk of the whole order made the
    first step quadratic (44.6 s of the H100's first UNet step).

    ``among``: the only values asked about, when known (a program's inputs): the index then
    holds their readers alone (the UNet step's order has ~35 k nodes, its inputs ~2 k). A
    value outside them is answered by a walk of the order."""

    __slots__ = ("order", "_among", "_of")

    def __init__(self, order, among=None):
        self.order = order
        self._among = None if among is None else {id(node) for node in among}
        self._of: dict[int, list[Node]] | None = None

    def of(self, node: Node) -> list[Node]:
        """The members of the order that read ``node`` (a member reading it twice: twice)."""
        among = self._among
        if among is not None and id(node) not in among:
            return [member for member in self.order for child in member.inputs if child is node]
        if self._of is None:
            self._of = _index_readers(self.order, among)
        return self._of.get(id(node), ())


def _index_readers(order, among) -> dict[int, list[Node]]:
    """id(value) -> the members of ``order`` that read it, for the values of ``among`` (ids;
    None: every value)."""
    if among is None:
        index: dict[int, list[Node]] = {}
        for member in order:
            for child in member.inputs:
                index.setdefault(id(child), []).append(member)
        return index
    index = {key: [] for key in among}
    get = index.get
    for member in order:
        for child in member.inputs:
            readers = get(id(child))
            if readers is not None:
                readers.append(member)
    return index


def reads_elementwise(order, aliased: list[Node], shape) -> bool:
    """Whether every node of ``order`` that reads one of ``aliased`` (inputs whose memory a
    result will be written into) is elementwise over ``shape``: each element is then read
    before, or by the thread that, writes it (a view or a reduction could read it after).
    ``order``: the nodes, or their ``Readers`` (for many questions about one order)."""
    from flame.ir.ops import get_op

    if not aliased:
        return True
    readers = order if isinstance(order, Readers) else Readers(order)
    seen: set[int] = set()
    for node in aliased:
        if id(node) in seen:
            continue
        seen.add(id(node))
        for member in readers.of(node):
            if get_op(member.op).kind != "elementwise" or member.shape != shape:
                return False
    return True


def writable(plan, out_slot: int, aliased_slots) -> bool:
    """Whether ``plan`` can write output ``out_slot`` into memory that its input slots
    ``aliased_slots`` read: a FLAME kernel writes it (not a library call), without zeroing
    it first (atomic sums), and no later step reads those inputs."""
    first_writer, last_reader = _slot_steps(plan)
    writer = first_writer.get(out_slot)
    if writer is None or any(slot == out_slot for slot, _ in plan.launches[writer].zeroed):
        return False
    return not any(last_reader.get(slot, -1) > writer for slot in aliased_slots)


def _slot_steps(plan) -> tuple[dict[int, int], dict[int, int]]:
    """Per slot, the first FLAME kernel of ``plan`` that writes it and the last step that
    reads it: found once per plan and kept on it (``Plan.slot_steps``), since a compiled
    step asks once per in-place write (a walk of the launches each: 4.8 s of the UNet's
    first step on the CPU probe, under the profiler)."""
    known = getattr(plan, "slot_steps", None)
    if known is not None:
        return known
    from flame.runtime.executor import _reads  # executor imports this module

    first_writer: dict[int, int] = {}
    last_reader: dict[int, int] = {}
    for index, step in enumerate(plan.launches):
        if isinstance(step, Launch):
            for slot, _ in step.writes:
                first_writer.setdefault(slot, index)
        for slot in _reads(step):
            last_reader[slot] = index
    known = (first_writer, last_reader)
    try:
        object.__setattr__(plan, "slot_steps", known)
    except AttributeError:  # a plan-like object without the field: answered, not kept
        pass
    return known
