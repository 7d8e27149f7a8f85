"""The executor's planned peak of a processed graph, without a GPU: every group is planned as
the executor plans it (kernels lowered, nothing loaded), then ``_plan_memory`` counts the
bytes live at once. An elementwise kernel's grid asks ``launch.device_info``: tests with such
kernels stand in a device for it."""

from __future__ import annotations

from flame.codegen.lower import lower_group
from flame.runtime.executor import LibraryCall, _layout_of, _plan_memory
from flame.runtime.launch import Launch


def planned_peak(graph) -> int:
    inputs = graph.inputs
    slot_of = {id(node): index for index, node in enumerate(inputs)}
    for group in graph.groups:
        for output in group.outputs:
            slot_of[id(output)] = len(slot_of)
    launches = [
        LibraryCall.plan(group.nodes[0], slot_of)
        if group.kind == "library"
        else Launch.plan(lower_group(group, _layout_of), None, slot_of)
        for group in graph.groups
    ]  # fmt: skip
    outputs = tuple(slot_of[id(node)] for node in graph.outputs)
    return _plan_memory(launches, len(inputs), outputs, graph, slot_of)[1]
