"""What a plan is and the parts of planning that need no GPU.

A ``Plan`` is a graph planned for the GPU: its steps (``Launch``, flame/runtime/launch.py,
or ``LibraryCall``, a library routine) over numbered slots, and what to free when. The
executor (executor.py) builds one in ``Executor._plan``: the graph over stand-ins of its
inputs after the pass pipeline (``planned_graph``), each group lowered (with ``_layout_of``
for its operands' layouts), compiled and loaded, then the slots' releases and the planned
peak (``_plan_memory``). flame/runtime/plan_payload.py stores and rebuilds plans.
"""

from __future__ import annotations

from flame.ir.graph import Graph, is_input
from flame.ir.node import Node, toposort
from flame.ir.ops import get_op
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
        slots[self.output] = run_library(self.node, arrays)


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


def planned_graph(pending: list[Node], inputs: list[Node], record: bool = False):
    """``(graph, passes, inputs)``: the graph a plan runs, over stand-ins of its inputs
    (``_over_stand_ins``), after the pass pipeline (its records when ``record``), with every
    group that writes no element split into steps of one empty value each (``is_empty``:
    no kernel, no library call). Needs no GPU."""
    pending, inputs = _over_stand_ins(pending, inputs)
    graph = run_pipeline(Graph(tuple(pending)), record=record)
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


def _reads(step) -> list[int]:
    if isinstance(step, LibraryCall):
        return list(step.inputs)
    return [value for kind, value in step.args if kind == "in"]


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
        written = [slot for slot, _ in step.writes] if isinstance(step, Launch) else [step.output]
        live += sum(size_of.get(slot, 0) for slot in written)
        peak = max(peak, live)
        live -= sum(size_of.get(slot, 0) for slot in releases[index])
    return tuple(tuple(sorted(slots)) for slots in releases), peak


def _layout_of(node: Node):
    if is_input(node):
        storage = node.buffer if node.buffer is not None else node.attr("storage")
        return storage.strides(), storage.aligned()
    return contiguous_strides(node.shape), True  # written by an earlier kernel of this plan
