"""What a plan is and the parts of planning that need no GPU.

A ``Plan`` is a graph planned for the GPU: its steps (``Launch``, flame/runtime/launch.py,
or ``LibraryCall``, a library routine, or ``CollectiveJoin``) over numbered slots, and what
to free when. The executor (executor.py) builds one in ``Executor._plan``: the graph over
stand-ins of its inputs after the pass pipeline (``planned_graph``), each group lowered
(with ``_layout_of`` for its operands' layouts), compiled and loaded, the collectives
scheduled to overlap the rest (``overlap_collectives``), then the slots' releases and the
planned peak (``_plan_memory``). flame/runtime/plan_payload.py stores and rebuilds plans.
"""

from __future__ import annotations

from flame.ir.graph import Graph, is_input
from flame.ir.node import Node, toposort
from flame.ir.ops import get_op
from flame.ir.ops.collective import COLLECTIVE_OPS
from flame.ir.passes import run_pipeline
from flame.ir.passes.library_views import library_view
from flame.ir.shapes import contiguous_strides
from flame.records import Record, field
from flame.runtime.empty_values import empty_steps, without_empty_reads
from flame.runtime.launch import Launch, _cupy_dtype
from flame.runtime.storage import PlannedInput


class LibraryCall(Record, frozen=True):
    """A node computed by a library routine (cuBLAS, CuPy): see flame/runtime/library.py."""

    node: Node
    inputs: tuple[int, ...]
    output: int
    views: tuple = ()  # per input: None, or the strided View to read the slot through
    # a collective run on the communication stream (``overlap_collectives``): the slot that
    # holds what its ``CollectiveJoin`` waits for; -1: it runs on FLAME's stream
    pending: int = -1

    @classmethod
    def plan(cls, node: Node, slot_of) -> LibraryCall:
        if get_op(node.op).kind == "movement":  # an output handed out as a view (no copy)
            base, view = library_view(node)
            return cls(node, (slot_of[id(base)],), slot_of[id(node)], (view,))
        inputs, views = [], []
        for child in node.inputs:
            if id(child) in slot_of:
                inputs.append(slot_of[id(child)])
                views.append(None)
                continue
            # the fusion pass let it through as a view, of the value its chain stops at: the
            # nearest one the plan writes (materialize.py and fusion's ordering read the same)
            base, view = library_view(child, written=slot_of)
            inputs.append(slot_of[id(base)])
            views.append(view)
        return cls(node, tuple(inputs), slot_of[id(node)], tuple(views))

    @classmethod
    def empty(cls, node: Node, slot_of) -> LibraryCall:
        """The step of a value without elements: an empty array, no kernel (``execute``)."""
        return cls(node, (), slot_of[id(node)])

    def execute(self, slots: list) -> None:
        from flame.runtime.library import run_library, strided_array

        if self.node.numel == 0:  # nothing to compute: no kernel, no library call
            slots[self.output] = _empty_array(self.node)
            return
        arrays = [
            slots[slot] if view is None
            else strided_array(slots[slot], view.shape, view.strides, view.offset)
            for slot, view in zip(self.inputs, self.views)
        ]  # fmt: skip
        if self.pending >= 0:
            from flame.runtime.library_nccl import start_collective

            slots[self.output], slots[self.pending] = start_collective(self.node, arrays)
            return
        slots[self.output] = run_library(self.node, arrays)


class CollectiveJoin(Record, frozen=True):
    """Where FLAME's stream waits for a collective started on the communication stream
    (``LibraryCall.pending``): placed before the first step that reads its result, or at the
    end of the plan (``overlap_collectives``). It counts as a reader of the collective's
    inputs (``_reads``), so their memory is released only after it: the main stream cannot
    reuse it while NCCL reads it."""

    node: Node  # the collective's node (for the dump and the plan store)
    pending: int  # the slot its collective left (done event, arrays read) in
    inputs: tuple[int, ...]  # the collective's input slots

    def execute(self, slots: list) -> None:
        pending = slots[self.pending]
        if pending is None:  # an empty value: nothing was started
            return
        slots[self.pending] = None
        from flame.runtime.library_nccl import join_collective

        join_collective(pending)


class Plan(Record, frozen=True):
    """A graph planned for the GPU: its launches over numbered slots, and what to free when."""

    launches: tuple[Launch, ...]
    slot_count: int
    output_slots: tuple[int, ...]  # where each requested output ends up
    graph: Graph  # after the passes, for the dump
    plan_seconds: float
    # per launch: the slots no later launch reads (released right after it, so the memory
    # pool reuses them for later outputs); and the bytes live at the worst point of the plan
    releases: tuple[tuple[int, ...], ...] = ()
    planned_peak_bytes: int = 0
    inputs: tuple[Node, ...] = ()  # the graph's input stand-ins, in slot order
    # lazy mode's straight-line runner of a one-kernel plan (``_lazy_runner``): False until
    # the plan's first recorded-walk match makes it; None for plans it does not fit
    runner: object = field(default=False, compare=False, repr=False)
    # flame/runtime/writes.py: per slot, its first writing kernel and last reading step
    slot_steps: object = field(default=None, compare=False, repr=False)
    # the plan store's key for this plan ("" when not stored), and the buffer placement of
    # its captured step (flame/runtime/arena.py: found at the first capture, kept here and
    # on disk under that key)
    digest: str = field(default="", compare=False, repr=False)
    arena: object = field(default=None, compare=False, repr=False)


def planned_graph(pending: list[Node], inputs: list[Node], record: bool = False, decisions=None):
    """``(graph, passes, inputs)``: the graph a plan runs, over stand-ins of its inputs
    (``_over_stand_ins``), after the pass pipeline (its records when ``record``; the fusion
    decisions of ``decisions`` reused, flame/ir/passes/reuse.py), with every group that
    writes no element split into steps of one empty value each (``is_empty``: no kernel,
    no library call). Needs no GPU."""
    pending, inputs = _over_stand_ins(pending, inputs)
    graph = run_pipeline(Graph(tuple(pending)), record=record, decisions=decisions)
    passes = None
    if record:
        graph, passes = graph
    return empty_steps(graph), passes, inputs


def _empty_array(node: Node):
    import cupy

    return cupy.ndarray(node.shape, _cupy_dtype(node.dtype))


def _over_stand_ins(pending: list[Node], inputs: list[Node]) -> tuple[list[Node], list[Node]]:
    """The graph rebuilt over stand-ins of its inputs (``PlannedInput``: type and layout, no
    memory), for a plan to keep: neither its graph nor its library calls hold the caller's
    nodes, their arrays, or the nodes behind a realized value alive."""
    mapped: dict[int, Node] = {}
    stand_ins = []
    for node in inputs:
        storage = node.buffer if node.buffer is not None else node.attr("storage")
        planned = PlannedInput(storage.backend, node.dtype, storage.layout())
        stand_in = Node("buffer", (), (("storage", planned),), node.dtype, node.shape, node.site)
        mapped[id(node)] = stand_in
        stand_ins.append(stand_in)
    for node in toposort(pending, stop=is_input):
        if id(node) not in mapped:  # rebuilt, even over the same inputs: the caller's nodes
            # get their results memoized in ``buffer`` once this plan ran
            inputs = tuple(mapped[id(child)] for child in node.inputs)
            rebuilt = Node(node.op, inputs, node.attrs, node.dtype, node.shape, node.site)
            mapped[id(node)] = without_empty_reads(rebuilt)
    return [mapped[id(node)] for node in pending], stand_ins


# Collectives run on a communication stream of their own (``overlap_collectives``), so data-
# parallel gradient all-reduces overlap the rest of the backward; False: every step runs on
# FLAME's one stream, in the fusion pass's order (the plans of before).
OVERLAP_COLLECTIVES = True


def overlap_collectives(launches: tuple, graph: Graph, slot_count: int):
    """``(launches, graph, slot_count)`` with the collectives scheduled to overlap the rest
    of the plan (the buckets' all-reduces of a data-parallel step overlap its backward):

    1. the steps that wait for a collective's result, directly or through other steps (the
       optimizer's updates of averaged gradients), go after every step that does not (the
       rest of the backward); a collective that waits for an earlier one takes the later
       collectives with it, so collectives keep their relative order: NCCL matches them by
       order, which depends on the graph alone, the same on every rank;
    2. each collective moves up to right after the last step that writes a slot it reads
       (or the collective before it): it starts once its bucket is computed;
    3. it runs on the communication stream (``LibraryCall.pending``: a slot of its own
       holds what its join waits for), and a ``CollectiveJoin`` makes FLAME's stream wait
       for it right before the first step that reads its result, or at the end of the plan:
       every plan ends with its collectives joined, so a synchronize, a host read or the
       end of a CUDA-graph capture covers them.

    ``graph``'s groups are put in the new order (a step each, the joins aside). A plan is
    returned as it was where a second stream gains nothing (no step but collectives would
    run between a collective and its join: a lone ``dist.all_reduce``), where a slot has
    two writers (the moves assume one), and when ``OVERLAP_COLLECTIVES`` is False."""
    is_collective = [_is_collective(step) for step in launches]
    if not OVERLAP_COLLECTIVES or not any(is_collective):
        return launches, graph, slot_count
    writers: dict[int, list[int]] = {}
    for index, step in enumerate(launches):
        for slot in _writes(step):
            writers.setdefault(slot, []).append(index)
    if any(len(found) > 1 for found in writers.values()):
        return launches, graph, slot_count
    late = _waiting_steps(launches, is_collective, writers)
    order = [index for index in range(len(launches)) if index not in late] + sorted(late)
    order = _hoisted(launches, order, is_collective, writers)
    steps = [launches[index] for index in order]
    joins = _join_positions(steps)
    if not any(
        any(not _is_collective(step) for step in steps[start + 1 : end])
        for start, end in joins.items()
    ):
        return launches, graph, slot_count
    scheduled, slot_count = _with_joins(steps, joins, slot_count)
    groups = tuple(graph.groups[index] for index in order)
    return scheduled, Graph(graph.outputs, graph.name, groups, graph.remat), slot_count


def _is_collective(step) -> bool:
    """A collective that calls NCCL (an empty value's step calls nothing)."""
    return isinstance(step, LibraryCall) and step.node.op in COLLECTIVE_OPS and step.node.numel > 0


def _waiting_steps(launches, is_collective, writers) -> set[int]:
    """The steps that read a collective's result or a value made from one, and the
    collectives after the first collective that does."""
    late: set[int] = set()
    late_collective = False
    for index, step in enumerate(launches):
        sources = {writer for slot in _reads(step) for writer in writers.get(slot, ())}
        waits = any(is_collective[source] or source in late for source in sources)
        if waits or (is_collective[index] and late_collective):
            late.add(index)
            late_collective = late_collective or is_collective[index]
    return late


def _hoisted(launches, order: list[int], is_collective, writers) -> list[int]:
    """``order`` with each collective moved up to right after the last step that writes a
    slot it reads, or the collective before it."""
    placed: list[int] = []
    for index in order:
        placed.append(index)
        if not is_collective[index]:
            continue
        needed = {writer for slot in _reads(launches[index]) for writer in writers.get(slot, ())}
        at = len(placed) - 1
        while at > 0 and placed[at - 1] not in needed and not is_collective[placed[at - 1]]:
            at -= 1
        placed.insert(at, placed.pop())
    return placed


def _join_positions(steps: list) -> dict[int, int]:
    """Per collective (its position in ``steps``): the position of the first step that
    reads its result, ``len(steps)`` where none does (the plan's end)."""
    joins: dict[int, int] = {}
    waiting: dict[int, int] = {}  # result slot -> position of the collective writing it
    for position, step in enumerate(steps):
        for slot in _reads(step):
            start = waiting.pop(slot, None)
            if start is not None:
                joins[start] = position
        if _is_collective(step):
            waiting[step.output] = position
            joins[position] = len(steps)
    return joins


def _with_joins(steps: list, joins: dict[int, int], slot_count: int) -> tuple[tuple, int]:
    """``steps`` with each collective given a pending slot (numbered from ``slot_count``, in
    plan order) and its join placed at its position in ``joins``; and the new slot count."""
    calls, before, pending = {}, {}, slot_count
    for start, end in sorted(joins.items()):
        old = steps[start]
        call = LibraryCall(old.node, old.inputs, old.output, old.views, pending)
        calls[start] = call
        before.setdefault(end, []).append(CollectiveJoin(call.node, pending, call.inputs))
        pending += 1
    scheduled = []
    for position, step in enumerate(steps):
        scheduled += before.get(position, ())
        scheduled.append(calls.get(position, step))
    scheduled += before.get(len(steps), ())
    return tuple(scheduled), pending


def _reads(step) -> list[int]:
    if isinstance(step, (LibraryCall, CollectiveJoin)):
        return list(step.inputs)
    return [value for kind, value in step.args if kind == "in"]


def _writes(step) -> list[int]:
    if isinstance(step, Launch):
        return [slot for slot, _ in step.writes]
    if isinstance(step, CollectiveJoin):
        return []
    return [step.output]


def group_steps(plan) -> list:
    """The steps of ``plan`` that compute its groups, in the order of ``plan.graph.groups``
    (the joins left out)."""
    return [step for step in plan.launches if not isinstance(step, CollectiveJoin)]


def overlapped_collectives(plan) -> dict[int, int | None]:
    """Per group of ``plan`` whose collective runs on the communication stream (by index in
    ``plan.graph.groups``): the index of the group its join comes right before, None where
    the join ends the plan (for the dump)."""
    started: dict[int, int] = {}  # pending slot -> group index
    joined: dict[int, int | None] = {}
    waiting: list[int] = []
    count = 0
    for step in plan.launches:
        if isinstance(step, CollectiveJoin):
            waiting.append(started[step.pending])
            continue
        for group in waiting:
            joined[group] = count
        waiting = []
        if isinstance(step, LibraryCall) and step.pending >= 0:
            started[step.pending] = count
        count += 1
    joined.update({group: None for group in waiting})
    return joined


def _plan_memory(launches, input_count: int, output_slots, graph, slot_of):
    """Which intermediate slots each launch is the last reader of, and the planned peak: the
    most bytes of this plan's own buffers alive at once (inputs belong to the caller)."""
    last_read: dict[int, int] = {}
    for index, step in enumerate(launches):
        for slot in _reads(step):
            last_read[slot] = index
    kept = set(output_slots)
    releases = [[] for _ in launches]
    for slot, index in last_read.items():
        if slot >= input_count and slot not in kept:
            releases[index].append(slot)
    size_of = {}
    for group in graph.groups:
        for node in group.outputs:
            size_of[slot_of[id(node)]] = node.numel * node.dtype.itemsize
    live = peak = 0
    for index, step in enumerate(launches):
        live += sum(size_of.get(slot, 0) for slot in _writes(step))
        peak = max(peak, live)
        live -= sum(size_of.get(slot, 0) for slot in releases[index])
    return tuple(tuple(sorted(slots)) for slots in releases), peak


def _layout_of(node: Node):
    if is_input(node):
        storage = node.buffer if node.buffer is not None else node.attr("storage")
        return storage.strides(), storage.aligned()
    return contiguous_strides(node.shape), True  # written by an earlier kernel of this plan
