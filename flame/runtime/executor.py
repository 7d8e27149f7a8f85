"""The CUDA executor: graph -> plan (passes, codegen, compile) -> launches (launch.py).

A *plan* is keyed by the graph's structure with its inputs abstracted to their type and
layout, so a loop that builds the same expression each step plans once and then only hashes
and launches. A new size makes a new plan (cheap: passes and codegen) that finds its kernels
already compiled, because sizes are kernel arguments.

What a plan is (``Plan``, ``LibraryCall``) and the parts of planning that need no GPU (the
graph after the passes, the memory plan) are in plans.py.
"""

from __future__ import annotations

import functools
import threading
import time

from flame.codegen.lower import PlanLowering
from flame.codegen.render import render, spec_key
from flame.determinism import are_deterministic_algorithms_enabled
from flame.ir.graph import is_input
from flame.ir.node import Node
from flame.ir.passes.reuse import Decisions
from flame.runtime import events, plan_store, plans, warmup
from flame.runtime.compiler import KernelCache, default_kernel_cache
from flame.runtime.device import target_arch
from flame.runtime.empty_values import is_empty
from flame.runtime.fusion_store import FusionStore
from flame.runtime.launch import Launch

# the plan's records and GPU-free planning (flame/runtime/plans.py), every name importable
# from here as before; ``_plan`` reads them from this module (a probe may patch them here)
from flame.runtime.plans import (
    CollectiveJoin,
    LibraryCall,
    Plan,
    _layout_of,
    _plan_memory,
    overlap_collectives,
    planned_graph,
)
from flame.runtime.plans import _empty_array as _empty_array  # re-exported
from flame.runtime.plans import _over_stand_ins as _over_stand_ins  # re-exported
from flame.runtime.plans import _reads as _reads  # re-exported
from flame.runtime.siblings import SiblingCompiler
from flame.runtime.storage import Storage
from flame.runtime.walks import RecordedWalk, linearize, record_walk
from flame.runtime.writes import reads_elementwise, writable

PLAN_CACHE_SIZE = 512
WALK_SITES = 256  # lines of user code whose last graphs' walks are kept (lazy mode)
WALKS_PER_SITE = 4
# lazy results up to this size recycle a dropped result's buffer (one kept per plan, at most
# PLAN_CACHE_SIZE of them: 32 MiB); above it, the kernel's own time hides the allocation
RECYCLE_BYTES = 64 * 1024


# Library routines known to run inside a CUDA-graph capture: device work only, no host
# synchronization, results in memory they allocate (the capture keeps it). cuDNN's plans and
# FLAME's flash-attention kernels capture; the CuPy convolution fallback does not (its cuBLAS
# wrappers refuse), and a capture that fails runs the program step by step instead.
CAPTURABLE_LIBRARY_OPS = frozenset(
    {"matmul", "cat", "pad", "conv", "conv_data_grad", "conv_weight_grad", "attention",
     "attention_backward", "reshape", "slice", "permute"}
)  # fmt: skip


class Executor:
    """Plans and runs graphs on the current CUDA device. Thread-safe."""

    def __init__(self, kernels: KernelCache | None = None):
        self.kernels = kernels or default_kernel_cache()
        self.siblings = SiblingCompiler(self.kernels)  # other size classes, in the background
        self._plans: dict[tuple, Plan] = {}
        self._functions: dict[str, object] = {}
        self._lock = threading.Lock()
        self.plan_hits = 0
        self.plan_misses = 0
        self.plan_disk_hits = 0  # plans loaded from the disk's plan store (plan_store.py)
        self.plan_store = plan_store.PlanStore(self.kernels.disk)
        # the fusion pass's groupings by graph structure, reused at other sizes (a compiled
        # step at a new resolution or batch size: flame/ir/passes/reuse.py)
        self.decisions = Decisions()
        self.decisions.store = FusionStore(self.kernels.disk)
        self._warm_up_pending = True
        # lazy mode's recorded walks: (root op, user line, shape, dtype, deterministic mode)
        # -> up to WALKS_PER_SITE RecordedWalks, newest first
        self._walks: dict[tuple, tuple] = {}
        # in-place writes (``realize_into``): (id(plan), aliased input slots) -> (plan, safe)
        self._into: dict[tuple, tuple] = {}

    def realize(self, nodes: list[Node]) -> None:
        if len(nodes) == 1:  # the common case, kept short: lazy mode pays this every call
            node = nodes[0]
            if node.buffer is not None or node.op == "buffer":
                return
            if not events.active():  # a dump listening sees every plan lookup
                # One lazy result. A graph built at the same line as an earlier one is
                # checked against that one's recorded walk and runs its plan; otherwise it
                # is walked, planned, and its walk recorded.
                mode = are_deterministic_algorithms_enabled()
                site = (node.op, node.site, node.shape, node.dtype, mode)
                self._run_recorded(site, [node])
                return
            pending = [node]
        else:
            unique = {
                id(node): node for node in nodes if node.buffer is None and node.op != "buffer"
            }
            pending = list(unique.values())
            if not pending:
                return
            if not events.active():
                self._realize_many(pending)
                return
        _, inputs, key = linearize(pending)
        plan = self.plan_for(pending, inputs, key)
        slots = self.run(plan, _arrays_of(inputs))
        for node, slot in zip(pending, plan.output_slots):
            node.buffer = Storage("cuda", node.dtype, array=slots[slot])

    def _realize_many(self, pending: list[Node]) -> None:
        """Several results in one schedule (``fl.realize(out, *grads)``), as one result is
        (``realize``), with the walk recorded from all the results' nodes."""
        site = (
            tuple([(node.op, node.site, node.shape, node.dtype) for node in pending]),
            are_deterministic_algorithms_enabled(),
        )
        self._run_recorded(site, pending)

    def _run_recorded(self, site: tuple, pending: list[Node]) -> None:
        walks = self._walks.get(site, ())
        plan = None
        for walk in walks:
            inputs = walk.match(pending)
            if inputs is not None:
                plan = walk.plan
                self.plan_hits += 1
                runner = plan.runner
                if runner is False:
                    runner = _lazy_runner(plan)
                if runner is not None and len(pending) == 1:
                    runner(inputs, pending[0])
                    return
                break
        if plan is None:
            plan, inputs = self._plan_and_record(site, walks, pending)
        arrays = _arrays_of(inputs)
        arrays += [None] * (plan.slot_count - len(arrays))
        slots = self._run_steps(plan, arrays)  # no dump listening: realize checked
        for node, slot in zip(pending, plan.output_slots):
            node.buffer = Storage("cuda", node.dtype, slots[slot])

    def _plan_and_record(self, site: tuple, walks: tuple, pending: list[Node]):
        """Walk, plan, and keep the walk for the next graph built at ``site``."""
        order, inputs, key = linearize(pending)
        plan = self.plan_for(pending, inputs, key)
        entries = record_walk(order, key)
        if entries is not None:
            positions = tuple(len(order) - 1 - index for index in key[-1])
            with self._lock:
                if site not in self._walks and len(self._walks) >= WALK_SITES:
                    self._walks.pop(next(iter(self._walks)))
                recorded = RecordedWalk(entries, plan, positions)
                self._walks[site] = (recorded, *walks[: WALKS_PER_SITE - 1])
        return plan, inputs

    def realize_into(self, node: Node, array) -> bool:
        """Compute ``node`` with its result written straight into ``array`` (a contiguous
        CuPy array of its shape and dtype: an in-place write, flame/inplace.py), by the
        kernel that computes it. Only where that is safe (``reads_elementwise``,
        ``writable``). Returns False (nothing run) otherwise; the caller then computes the
        value apart and copies it.

        As lazy results do (``_run_recorded``), a write built at the line of an earlier one
        is checked against that one's recorded walk, and the safety found for its plan and
        aliased inputs is kept: a loop of writes (an EMA over a model's weights) plans and
        checks once per line and shape."""
        if is_input(node) or node.op in ("expand", "reshape", "permute", "slice"):
            return False
        mode = are_deterministic_algorithms_enabled()
        site = ("into", node.op, node.site, node.shape, node.dtype, mode)
        plan = inputs = None
        walks = self._walks.get(site, ())
        for walk in walks:
            inputs = walk.match([node])
            if inputs is not None:
                plan = walk.plan
                self.plan_hits += 1
                break
        if plan is None:
            plan, inputs = self._plan_and_record(site, walks, [node])
        address = array.data.ptr
        aliased = tuple(i for i, child in enumerate(inputs) if _address_of(child) == address)
        known = self._into.get((id(plan), aliased))
        if known is not None and known[0] is plan:
            safe = known[1]
        else:
            order = linearize([node])[0]  # once per plan and aliasing: then kept
            out_slot = plan.output_slots[0]
            safe = reads_elementwise(order, [inputs[i] for i in aliased], node.shape) and (
                writable(plan, out_slot, aliased)
            )
            with self._lock:
                if len(self._into) >= PLAN_CACHE_SIZE:
                    self._into.pop(next(iter(self._into)))
                self._into[(id(plan), aliased)] = (plan, safe)
        if safe:
            self.run_into(plan, _arrays_of(inputs), {plan.output_slots[0]: array})
        return safe

    def run_into(self, plan: Plan, input_arrays: list, targets: dict) -> list:
        """``run``, with the output slots in ``targets`` (slot -> array) written into the
        given arrays instead of new ones (each checked by ``writable``)."""
        import cupy

        slots = list(input_arrays) + [None] * (plan.slot_count - len(input_arrays))
        for step, releases in zip(plan.launches, plan.releases):
            if isinstance(step, Launch) and any(slot in targets for slot, _ in step.writes):
                for slot, shape, dtype in step._allocations:
                    target = targets.get(slot)
                    slots[slot] = target if target is not None else cupy.ndarray(shape, dtype)
                step.launch_into(slots)
            else:
                step.execute(slots)
            for slot in releases:
                slots[slot] = None
        return slots

    def plan_for(self, pending: list[Node], inputs: list[Node], key: tuple) -> Plan:
        """The plan for a graph (``linearize``'s inputs and key): cached, or built now."""
        if are_deterministic_algorithms_enabled():  # plans differ: kept apart
            key = ("deterministic", key)
        if not plans.OVERLAP_COLLECTIVES:  # collectives on FLAME's stream: kept apart too
            key = ("one stream", key)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._stored_plan(pending, inputs, key)
            with self._lock:
                if len(self._plans) >= PLAN_CACHE_SIZE:
                    self._plans.pop(next(iter(self._plans)))
                self._plans[key] = plan
                self.plan_misses += 1
        else:
            self.plan_hits += 1
            if events.active():
                events.emit("plan", plan=plan, passes=[], seconds=0.0, cached=True)
        return plan

    def _stored_plan(self, pending: list[Node], inputs: list[Node], key: tuple) -> Plan:
        """The plan an earlier process stored on disk (flame/runtime/plan_store.py; off with
        ``FLAME_PLAN_CACHE=0``), else built now and stored."""
        store, arch = self.plan_store, self.kernels.arch or target_arch()
        digest = store.digest(key, arch) if plan_store.enabled() else None
        plan = store.load(digest, inputs, self._load) if digest is not None else None
        if plan is None:
            plan = self._plan(pending, inputs)
            if digest is not None:
                store.save(digest, plan, inputs)
                object.__setattr__(plan, "digest", digest)  # a cache field (not compared)
            return plan
        object.__setattr__(plan, "digest", digest)
        with self._lock:
            self.plan_disk_hits += 1
        if events.active():
            events.emit("plan", plan=plan, passes=[], seconds=plan.plan_seconds, cached=True)
        return plan

    def run(self, plan: Plan, input_arrays: list) -> list:
        slots = list(input_arrays) + [None] * (plan.slot_count - len(input_arrays))
        if events.active():
            return self._run_observed(plan, slots)
        return self._run_steps(plan, slots)

    def _run_steps(self, plan: Plan, slots: list) -> list:
        for step, releases in zip(plan.launches, plan.releases):
            step.execute(slots)
            for slot in releases:
                slots[slot] = None
        if self._warm_up_pending:
            self._start_warm_up()
        return slots

    def _start_warm_up(self) -> None:
        # After the first launches are queued, not when the executor starts: the thread's
        # imports and library loads hold the GIL and the loader lock for ~20 ms, which a
        # process's first result (module import, NVRTC version, kernel load) would wait on.
        self._warm_up_pending = False
        warmup.start()

    def _run_observed(self, plan: Plan, slots: list) -> list:
        """``_run_steps`` keeping every slot (``flame check`` reads them after), telling the dump;
        profiling, the GPU time of each group's step (a collective on the communication
        stream: FLAME's stream's time in it and in its join, which waits for it)."""
        times = [None] * len(plan.launches)
        if not events.profiling():
            for step in plan.launches:
                step.execute(slots)
        else:
            import cupy

            for index, step in enumerate(plan.launches):
                start, stop = cupy.cuda.Event(), cupy.cuda.Event()
                start.record()
                step.execute(slots)
                stop.record()
                stop.synchronize()
                times[index] = cupy.cuda.get_elapsed_time(start, stop)
        events.emit("run", plan=plan, times=_group_times(plan, times), slots=slots)
        return slots

    def _plan(self, pending: list[Node], inputs: list[Node]) -> Plan:
        start = time.perf_counter()
        self.siblings.busy()  # background lowering waits until planning is done
        observed = bool(events.active())
        graph, passes, inputs = planned_graph(
            pending, inputs, record=observed, decisions=self.decisions
        )  # fmt: skip
        slot_of = {id(node): index for index, node in enumerate(inputs)}
        slot_count = len(inputs)
        lowered_groups, rows = [], []
        lowering = PlanLowering(_layout_of)
        for group in graph.groups:
            for output in group.outputs:
                slot_of[id(output)] = slot_count
                slot_count += 1
            if group.kind != "library":
                lowered_groups.append(lowering.lower(group))
            if group.kind == "reduce":
                rows.append((group, lowered_groups[-1]))
        sources = [
            (functools.partial(render, low.spec), low.spec.name, spec_key(low.spec), low.spec)
            for low in lowered_groups
        ]
        functions = iter(self._load(sources))
        self.siblings.submit(rows)
        kernels = iter(lowered_groups)
        launches = tuple(
            LibraryCall.empty(group.nodes[0], slot_of) if is_empty(group)
            else LibraryCall.plan(group.nodes[0], slot_of) if group.kind == "library"
            else Launch.plan(next(kernels), next(functions), slot_of)
            for group in graph.groups
        )  # fmt: skip
        # collectives on the communication stream, overlapping the steps that do not wait
        # for them (the groups put in the new order too)
        launches, graph, slot_count = overlap_collectives(launches, graph, slot_count)
        output_slots = tuple(slot_of[id(node)] for node in graph.outputs)
        releases, peak = _plan_memory(launches, len(inputs), output_slots, graph, slot_of)
        plan = Plan(
            launches, slot_count, output_slots, graph, time.perf_counter() - start, releases,
            peak, tuple(inputs),
        )  # fmt: skip
        if observed:
            events.emit("plan", plan=plan, passes=passes, seconds=plan.plan_seconds, cached=False)
        return plan

    def _load(self, sources) -> list:
        import cupy

        results = self.kernels.cubins(sources)
        functions = []
        for (key, cubin), (_, name, *_) in zip(results, sources):
            with self._lock:
                function = self._functions.get(key)
                if function is None:
                    module = cupy.cuda.function.Module()
                    module.load(cubin)
                    function = (module, module.get_function(name))
                    self._functions[key] = function
            functions.append(function[1])
        return functions


def _lazy_runner(plan: Plan):
    """Makes and keeps ``plan.runner``: ``run(inputs, node)``, the plan run over the nodes
    ``inputs`` (a recorded walk's match), its result memoized on ``node``, as generated code
    (flame/runtime/direct.py; results up to ``RECYCLE_BYTES`` recycle their buffer); None
    where the plan is not one kernel writing one result. Two threads racing make two."""
    from flame.runtime.direct import one_kernel_runner

    count = len(plan.inputs)
    header = ["def run(inputs, node):"]
    if count:
        header.append(f"    {''.join(f'i{k}, ' for k in range(count))}= inputs")
    for k in range(count):
        header += [
            f"    s{k} = i{k}.buffer",
            f"    if s{k} is None:",
            f"        s{k} = i{k}.attr('storage')",
        ]  # fmt: skip
    finish = ["    node.buffer = Storage('cuda', node.dtype, out)"]
    storages = [f"s{k}" for k in range(count)]
    runner = one_kernel_runner(plan, header, storages, finish, {"Storage": Storage}, RECYCLE_BYTES)
    object.__setattr__(plan, "runner", runner)
    return runner


def _group_times(plan: Plan, times: list) -> list:
    """Per group of ``plan.graph`` (the steps but the joins), its step's time; a join's is
    added to its collective's."""
    if not any(isinstance(step, CollectiveJoin) for step in plan.launches):
        return times
    found, collective_at = [], {}
    for step, elapsed in zip(plan.launches, times):
        if not isinstance(step, CollectiveJoin):
            if isinstance(step, LibraryCall) and step.pending >= 0:
                collective_at[step.pending] = len(found)
            found.append(elapsed)
            continue
        at = collective_at.get(step.pending)
        if at is not None and elapsed is not None and found[at] is not None:
            found[at] += elapsed
    return found


def _arrays_of(inputs: list[Node]) -> list:
    """The device arrays of a graph's inputs (host data copied over on first use)."""
    arrays = []
    for node in inputs:
        storage = node.buffer if node.buffer is not None else node.attr("storage")
        array = storage.array
        arrays.append(array if array is not None else storage.device_array())
    return arrays


def _address_of(node: Node) -> int | None:
    storage = node.buffer if node.buffer is not None else node.attr("storage")
    array = storage.array
    return array.data.ptr if array is not None else None


_executor: Executor | None = None
_executor_lock = threading.Lock()


def default_executor() -> Executor:
    global _executor
    executor = _executor
    if executor is not None:  # set once, never replaced: no lock needed to read it
        return executor
    with _executor_lock:
        if _executor is None:
            _executor = Executor()  # cuBLAS warms up after its first run (_start_warm_up)
        return _executor
