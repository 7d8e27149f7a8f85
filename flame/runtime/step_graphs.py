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
* **Intermediates** live in memory of the graph's own, which nothing outside the graph can
  take between replays: one block, each buffer at an offset planned from a first capture
  that records every allocation and is never launched (flame/runtime/arena.py), so the
  graph holds about the plan's live peak, not a caching pool's high-water mark (the DDPM
  UNet's step on the H100: 1.36 GB in one block, 1.79 GB from a pool). The placement is
  kept on the plan and on disk beside it, so a later capture of the same plan (new
  addresses, a new process) does not record again. Where a capture does not repeat the
  recorded allocations, it is captured from a pool buffer by buffer (the plan's releases
  still return buffers for later steps to reuse); ``cache_info().graph_memory`` says which,
  and the bytes held.
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

import os
import time
import weakref

from flame.replay import GraphCache
from flame.runtime import warmup
from flame.runtime.library_cudnn import plans_for_capture

# arguments up to this size are copied into the graph's own buffers at each replay; larger
# ones (or ones written in place) key the graph by their address
STATIC_ARGUMENT_BYTES = 64 << 20
# programs of at least this many launches are captured by default (``cuda_graph=None``):
# their launches, not their kernels, bound the step
STEP_GRAPH_LAUNCHES = 64
# captured steps place their buffers in one block planned from a first, recorded capture
# (flame/runtime/arena.py); off (False, or FLAME_STEP_ARENA=0): one pool, buffer by buffer
ARENA = True
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

        pool = cupy.cuda.MemoryPool()  # the graph's own: reused inside it, by nobody else
        buffers = {}
        with cupy.cuda.using_allocator(pool.malloc):
            for index in self.static_positions:
                buffers[index] = cupy.empty_like(arrays[index])
                buffers[index][...] = arrays[index]
        stream = cupy.cuda.Stream(non_blocking=True)
        captured, memory = None, {"arena": False, "reason": "FLAME_STEP_ARENA=0"}
        with plans_for_capture(self.plan.digest):  # stored cuDNN plans read before capturing
            if ARENA and os.environ.get("FLAME_STEP_ARENA", "1") != "0":
                captured, memory = self._capture_in_arena(arrays, targets, buffers, stream, pool)
            if captured is None:
                started = time.perf_counter()
                captured = self._capture_with(pool.malloc, arrays, targets, buffers, stream)
                memory["capture_s"] = time.perf_counter() - started
        graph, slots = captured
        memory["bytes"] = pool.total_bytes()
        self.info.graph_memory.append(memory)
        graph.upload(cupy.cuda.get_current_stream())
        self.info.graph_captures += 1
        for index in range(len(arrays)):  # addresses are baked in: keep no caller memory
            if index not in self.plan.output_slots:
                slots[index] = None
        return [graph, slots, [None] * len(self.plan.output_slots), buffers, pool]

    def _capture_in_arena(self, arrays, targets, buffers, stream, pool):
        """The step captured into one block (flame/runtime/arena.py): ((graph, slots), memory
        note), or (None, note) where the arena declined (nothing of its captures is kept).
        The placement is the plan's (found at an earlier capture: in memory, or on disk
        under the plan store's key), else recorded and placed now; a known placement that
        the capture does not repeat is recorded again once."""
        from flame.runtime.arena import ArenaDeclined

        started = time.perf_counter()
        planned, origin = self.plan.arena, "memory"
        if planned is None:
            planned, origin = _stored_arena(self.plan.digest), "disk"
        for attempt in range(2):
            fresh = planned is None
            note = {"arena": True, "reason": "", "placement": "recorded" if fresh else origin}
            try:
                if fresh:
                    planned = self._record(arrays, targets, buffers, stream, pool, note)
                placed = time.perf_counter()
                captured = self._capture_placed(planned, arrays, targets, buffers, stream, pool)
            except ArenaDeclined as declined:
                pool.free_all_blocks()
                if not fresh and attempt == 0:
                    planned = None  # a stale placement: record it again
                    continue
                return None, {"arena": False, "reason": str(declined)}
            break
        note.update(live_peak=planned.peak, block=planned.total, allocations=len(planned.sizes),
                    prepare_s=placed - started, capture_s=time.perf_counter() - placed)  # fmt: skip
        if self.plan.arena is not planned:
            object.__setattr__(self.plan, "arena", planned)  # a cache field (not compared)
            if note["placement"] == "recorded":
                _store_arena(self.plan.digest, planned)
        return captured, note

    def _record(self, arrays, targets, buffers, stream, pool, note):
        """A capture never launched, its allocations recorded and placed (``ArenaPlan``)."""
        from flame.runtime.arena import Recorder

        # the recording's buffers first fit in a block of the plan's planned peak (+ room for
        # library workspaces); what does not fit comes from the pool
        capacity = self.plan.planned_peak_bytes + (64 << 20)
        recorder = Recorder(pool, stream.ptr, capacity)
        started = time.perf_counter()
        recording = self._capture_with(recorder, arrays, targets, buffers, stream)
        del recording  # never launched: its buffers go back
        recorder.release()
        pool.free_all_blocks()
        note["record_s"] = time.perf_counter() - started
        return recorder.plan()

    def _capture_placed(self, planned, arrays, targets, buffers, stream, pool):
        """The capture replayed, its buffers at ``planned``'s offsets of one block;
        ``ArenaDeclined`` when it does not repeat the recorded allocations."""
        from flame.runtime.arena import ArenaAllocator

        allocator = ArenaAllocator(planned, pool.malloc(planned.total), pool.malloc)
        captured = self._capture_with(allocator, arrays, targets, buffers, stream)
        allocator.check()  # raising, the capture is dropped with this frame
        return captured

    def _capture_with(self, allocator, arrays, targets, buffers, stream):
        """One capture of the plan on ``stream``, its buffers from ``allocator``: (graph,
        slots)."""
        import cupy

        from flame.runtime.launch import Launch

        plan = self.plan
        current = cupy.cuda.get_current_stream()
        slots = [buffers.get(index, array) for index, array in enumerate(arrays)]
        slots += [None] * (plan.slot_count - len(arrays))
        keep = set(plan.output_slots) | set(range(len(arrays)))
        stream.wait_event(current.record())  # inputs queued before the capture are ready
        warmup.finish()  # cuBLAS starting on its thread would spoil the capture
        with stream, cupy.cuda.using_allocator(allocator):
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
        return graph, slots


def _stored_arena(digest: str):
    """The placement stored under a plan's key, or None."""
    from flame.runtime.arena import ArenaPlan

    disk = _arena_disk(digest)
    data = disk.get(_arena_key(digest)) if disk is not None else None
    if data is None:
        return None
    try:
        return ArenaPlan.from_bytes(data)
    except ValueError:
        return None


def _store_arena(digest: str, planned) -> None:
    disk = _arena_disk(digest)
    if disk is not None:
        try:
            disk.put(_arena_key(digest), planned.to_bytes())
        except OSError:  # a read-only or full cache: placed again next time
            pass


def _arena_disk(digest: str):
    from flame.runtime import plan_store

    if not digest or not plan_store.enabled():
        return None
    from flame.runtime.compiler import default_kernel_cache

    return default_kernel_cache().disk


def _arena_key(digest: str) -> str:
    from flame.runtime.arena import ArenaPlan
    from flame.runtime.cache import DiskCache

    return DiskCache.key("step-arena", digest, str(ArenaPlan.FORMAT))


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
