"""CUDA graphs of whole training steps: compiled programs that set ``.grad`` or write into
tensors in place (parameters, optimizer state, an EMA), captured once and replayed as one
launch.

A diffusion UNet's step is ~2,300 launches (FLAME kernels, cuDNN convolutions, cuBLAS
products, fused attention): replayed one by one it is bound by the host (about 25 us a
launch in Python and the driver), whatever the kernels cost. Captured, the host launches one
graph. What a capture bakes in, and how a replay keeps it true:

* **Addresses.** Memory a step reads in place (parameters, optimizer state, generator
  counters, ``.grad`` it accumulates into) keeps its address from call to call: those
  addresses key the graph. Small arguments (a batch of images and labels, new arrays every
  step) are copied into buffers the graph owns (``STATIC_ARGUMENT_BYTES``), so a new batch
  is a copy, not a new capture.
* **In-place writes** that the program's kernels make directly into the target's memory
  (``program.direct``) write there in the graph too (the target's address is in the key).
* **Intermediates** come from a memory pool of the graph's own: the plan's releases return
  buffers to it during the capture, so later steps of the graph reuse them as a run would
  (peak memory is the plan's, not the sum of its buffers), and nothing outside the graph can
  take them between replays.
* **Results** (the loss, the gradients handed out as ``.grad``) live in the graph's memory and
  are lent: a result still held when the next replay starts is first moved out (its tensor
  keeps its values). Gradients the step will set again are dropped before the replay, so a
  training loop pays no copy.

* **Collectives** that a plan runs on the communication stream (flame/runtime/plans.py
  ``overlap_collectives``) fork from the capture's stream by an event and join back by another
  before the capture ends: the graph holds both streams' work and their order, and a replay
  overlaps the all-reduces with the backward as a run step by step does.

Random numbers read their generator's counter from device memory (``flame/random.py``), so a
replay draws new numbers. A plan with a library call that cannot run under a capture, or a
capture that fails, runs step by step, as before; the reason is in ``cache_info()``.
"""

from __future__ import annotations

import weakref

from flame.replay import GraphCache

# arguments up to this size are copied into the graph's own buffers at each replay; larger
# ones (or ones written in place) key the graph by their address
STATIC_ARGUMENT_BYTES = 64 << 20
# programs of at least this many launches are captured by default (``cuda_graph=None``):
# their launches, not their kernels, bound the step
STEP_GRAPH_LAUNCHES = 64
_LIVE: weakref.WeakSet = weakref.WeakSet()  # every StepGraphs, for graph_pool_bytes()


def graph_pool_bytes() -> int:
    """Device memory the captured steps' own pools hold (their intermediates, kept between
    replays): not in CuPy's default pool, so a measure of FLAME's memory adds it."""
    return sum(
        entry[4].total_bytes() for graphs in list(_LIVE) for entry in graphs.entries.values()
    )


# library calls a capture can hold besides ``executor.CAPTURABLE_LIBRARY_OPS``: FLAME's
# indexing kernels (a class embedding and its backward, a loss's target check) and NCCL's
# collectives
STEP_LIBRARY_OPS = frozenset(
    {"gather", "index_select", "take_along_dim", "embedding", "index_tensor", "one_hot",
     "scatter_add", "check_index", "all_reduce", "broadcast", "all_gather", "reduce_scatter"}
)  # fmt: skip


def wanted(plan, requested) -> bool:
    """Capture this training program? ``requested``: ``flame.compile``'s ``cuda_graph``."""
    from flame.replay import capturable
    from flame.runtime.executor import CAPTURABLE_LIBRARY_OPS

    if requested is False:
        return False
    if not capturable(plan, True, CAPTURABLE_LIBRARY_OPS | STEP_LIBRARY_OPS):
        return False
    return bool(requested) or len(plan.launches) >= STEP_GRAPH_LAUNCHES


class StepGraphs(GraphCache):
    """The CUDA graphs of one program that sets gradients or writes in place, keyed by the
    addresses of what it reads and writes in place (``LIMIT`` kept); replayed, lent and
    failed as ``GraphCache``'s."""

    LIMIT = 2

    def __init__(self, plan, info, static_positions: frozenset):
        super().__init__(plan, info)
        self.static_positions = static_positions  # sources copied into graph-owned buffers
        _LIVE.add(self)

    def _key(self, arrays: list, targets: dict) -> tuple:
        static = self.static_positions
        return tuple(
            a.data.ptr if index not in static else (a.shape, a.dtype.str)
            for index, a in enumerate(arrays)
        ) + tuple(sorted((slot, t.data.ptr) for slot, t in targets.items()))

    def _prepare(self, entry: list, arrays: list) -> None:
        for index, buffer in entry[3].items():  # this call's batch, into the graph's memory
            buffer[...] = arrays[index]

    def _capture(self, arrays: list, targets: dict) -> list:
        import cupy

        from flame.runtime.launch import Launch

        plan = self.plan
        pool = cupy.cuda.MemoryPool()  # the graph's own: reused inside it, by nobody else
        current = cupy.cuda.get_current_stream()
        buffers = {}
        with cupy.cuda.using_allocator(pool.malloc):
            for index in self.static_positions:
                buffers[index] = cupy.empty_like(arrays[index])
                buffers[index][...] = arrays[index]
        slots = [buffers.get(index, array) for index, array in enumerate(arrays)]
        slots += [None] * (plan.slot_count - len(arrays))
        keep = set(plan.output_slots) | set(range(len(arrays)))
        stream = cupy.cuda.Stream(non_blocking=True)
        stream.wait_event(current.record())  # inputs queued before the capture are ready
        with stream, cupy.cuda.using_allocator(pool.malloc):
            stream.begin_capture()
            try:
                for step, releases in zip(plan.launches, plan.releases):
                    try:
                        if isinstance(step, Launch):
                            step.allocate(slots)
                            for slot, _, _ in step._allocations:
                                if slot in targets:
                                    slots[slot] = targets[slot]
                            step.launch_into(slots)
                        else:
                            step.execute(slots)
                    except Exception as error:
                        message = f"{_describe(step)}: {type(error).__name__}: {error}"
                        raise RuntimeError(message) from error
                    for slot in releases:
                        if slot not in keep:
                            slots[slot] = None  # its block serves later steps of the graph
            finally:
                graph = stream.end_capture()
        graph.upload(current)
        self.info.graph_captures += 1
        for index in range(len(arrays)):  # addresses are baked in: keep no caller memory
            if index not in plan.output_slots:
                slots[index] = None
        return [graph, slots, [None] * len(plan.output_slots), buffers, pool]


def _describe(step) -> str:
    from flame.runtime.plans import CollectiveJoin

    node = getattr(step, "node", None)
    if isinstance(step, CollectiveJoin):
        return f"the join of {node.op} (communication stream)"
    if node is not None:
        return f"{node.op} (library call)"
    spec = getattr(step, "spec", None)
    return getattr(spec, "name", type(step).__name__)


def static_positions(program, arrays) -> frozenset:
    """The argument sources small enough to copy into graph-owned buffers at each replay
    and not written in place by the program."""
    written = {target for (kind, target), _ in program.writes if kind == "arg"}
    return frozenset(
        index
        for index, ((kind, value), array) in enumerate(zip(program.sources, arrays))
        if kind == "arg" and value not in written and array.nbytes <= STATIC_ARGUMENT_BYTES
    )


def replay(program, arrays: list, targets: dict, info) -> list | None:
    """One CUDA-graph launch for a whole program (``flame.compile``'s replay of a program
    that sets gradients or writes in place); None: run it step by step."""
    if program.graphs is True:  # made at the first replay, which knows the arguments
        program.graphs = StepGraphs(program.plan, info, static_positions(program, arrays))
    if not any(kind == "grad" for kind, _ in program.sources):
        for owner_ref, _, _ in program.grads:  # set again by this call: nothing to keep
            owner = owner_ref()
            if owner is not None:
                owner.grad = None
    outputs = tuple(
        (slot, node.dtype, node.shape, node.site)
        for node, slot in zip(program.out_nodes, program.plan.output_slots)
    )
    results = program.graphs.run(arrays, outputs, targets)
    if results is None:
        program.graphs = None
    return results
