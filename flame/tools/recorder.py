"""What `flame dump` records: one ``GraphRecord`` per distinct graph realized, with its pass
history, fusion groups (and why each boundary exists), kernels (source, launch shape, NVRTC
resource usage, bytes moved, cache origin and the reason for it) and, when profiling, the GPU
time of every launch.

The recorder listens to ``flame.runtime.events``. On the CUDA backend it reads the executor's
plans; on the reference backend (no GPU) it runs the pass pipeline itself, lowers and renders
every group and compiles it with NVRTC, so the generated code can be read and checked on a
laptop. Records are plain data (strings and numbers): they never keep tensors alive.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field

from flame.ir.graph import Graph, is_input
from flame.ir.node import format_site
from flame.ir.printer import format_graph, format_type, format_value
from flame.tools.analysis import (
    GraphPicture,
    boundary_reasons,
    compile_with_resources,
    group_label,
    kernel_bytes,
    launch_shape,
    library_bytes,
    miss_reason,
    plan_signature,
    remat_lines,
    spec_difference,
)

H100_COPY_BANDWIDTH = 2.97e12  # bytes/s a device copy moves on the H100 (ARCHITECTURE.md)


@dataclass
class KernelRecord:
    """One kernel (or library call) of a graph: ``k<index>`` in the dump."""

    index: int
    name: str
    kind: str  # "elementwise" | "reduce" | "library"
    label: str  # what it computes over: "f32[64,128]", "rows of f32[64,128] over axes [1]"
    writes: list[str]  # graph value names it writes
    reasons: list[str]  # why its boundary is where it is
    sites: list[str]  # user lines of its nodes, in order
    ir: str  # the group, as the kernel's header prints it
    source: str | None = None  # CUDA C (None for library calls)
    grid: int | None = None
    block: int | None = None
    launch_note: str = ""
    bytes_moved: int = 0
    resources: dict | None = None  # registers, spill_stores, spill_loads, stack, shared
    resources_note: str = ""
    cache: str = ""  # memory | disk | compiled | not cached | library
    cache_reason: str = ""
    compile_seconds: float | None = None
    times_ms: list[float] = field(default_factory=list)
    spec: object = field(default=None, repr=False, compare=False)  # for miss reasons


@dataclass
class GraphRecord:
    index: int
    backend: str
    passes: list[tuple[str, float, str]]  # (pass name, seconds, graph text after it)
    final: str  # graph text after every pass, with kernel annotations
    kernels: list[KernelRecord]
    picture: GraphPicture
    plan_seconds: float
    plan_reason: str
    signature: tuple = ()
    remat: list[str] = field(default_factory=list)  # what is saved, what recomputed, why
    hits: int = 0  # later realizations that found this plan cached
    runs: int = 0

    @property
    def title(self) -> str:
        return f"graph {self.index}"


class DumpRecorder:
    """An events recorder (``with events.recording(DumpRecorder()):``) building records."""

    def __init__(self, profile: bool = False, bandwidth: float = H100_COPY_BANDWIDTH):
        self.profile = profile
        self.bandwidth = bandwidth
        self.graphs: list[GraphRecord] = []
        self.traces: list[dict] = []
        self.notes: list[str] = []  # things the summary must say (cache write errors, ...)
        self._lock = threading.Lock()
        self._kernel_events: dict[str, dict] = {}  # name -> latest "kernel" event
        self._plans: dict[int, tuple] = {}  # id(plan) -> (weakref, GraphRecord)
        self._reference_keys: dict[tuple, GraphRecord] = {}
        self._resources: dict[str, tuple] = {}  # kernel name -> (resources, note, seconds)
        self._specs: list[tuple] = []  # (kernel name, spec, graph index) seen, in order

    # -- events -------------------------------------------------------------------------------

    def __call__(self, kind: str, data: dict) -> None:
        handler = getattr(self, f"_on_{kind}", None)
        if handler is not None:
            handler(**data)

    def _on_kernel(self, name, origin, seconds, key, source, reason="") -> None:
        with self._lock:
            self._kernel_events[name] = {
                "origin": origin, "seconds": seconds, "key": key, "reason": reason,
            }  # fmt: skip

    def _on_trace(self, function, reason, seconds) -> None:
        with self._lock:
            self.traces.append({"function": function, "reason": reason, "seconds": seconds})

    def _on_plan(self, plan, passes, seconds, cached) -> None:
        with self._lock:
            if cached:
                known = self._plans.get(id(plan))
                if known is not None and known[0]() is plan:
                    known[1].hits += 1
                    return
            record = self._record_plan(plan, passes, seconds)
            self._plans[id(plan)] = (weakref.ref(plan), record)

    def _on_run(self, plan, times, slots=None) -> None:
        with self._lock:
            known = self._plans.get(id(plan))
            if known is None or known[0]() is not plan:
                return
            record = known[1]
            record.runs += 1
            for kernel, elapsed in zip(record.kernels, times):
                if elapsed is not None:
                    kernel.times_ms.append(float(elapsed))

    def _on_reference(self, outputs) -> None:
        from flame.runtime.walks import linearize

        computed = [node for node in outputs if node.buffer is None and node.op != "buffer"]
        pending = list({id(node): node for node in computed}.values())
        if not pending:
            return
        with self._lock:
            _, _, key = linearize(pending)
            known = self._reference_keys.get(key)
            if known is not None:
                known.hits += 1
                known.runs += 1
                return
            record = self._record_reference(pending)
            record.runs += 1
            self._reference_keys[key] = record

    def other_kernels(self) -> list[tuple[str, str]]:
        """(name, cache origin) of kernels compiled or loaded outside any recorded graph:
        multi-tensor (foreach) and indexing kernels the executor does not plan."""
        with self._lock:
            planned = {kernel.name for record in self.graphs for kernel in record.kernels}
            return sorted(
                (name, event["origin"])
                for name, event in self._kernel_events.items()
                if name not in planned
            )

    # -- building records ---------------------------------------------------------------------

    def _record_plan(self, plan, passes, seconds) -> GraphRecord:
        from flame.codegen.lower import lower_group
        from flame.runtime.executor import LibraryCall, _layout_of
        from flame.runtime.plans import group_steps, overlapped_collectives

        graph = plan.graph
        record = self._new_record("cuda", graph, passes, seconds)
        joins = overlapped_collectives(plan)
        for kernel, group, launch in zip(record.kernels, graph.groups, group_steps(plan)):
            if isinstance(launch, LibraryCall):
                if kernel.index in joins:
                    joined = joins[kernel.index]
                    where = "the end of the plan" if joined is None else f"k{joined}"
                    kernel.launch_note += (
                        f"; on the communication stream (overlaps the kernels after it), "
                        f"joined before {where}"
                    )
                continue
            lowered = lower_group(group, _layout_of)
            kernel.grid, kernel.block = launch.grid, launch.block
            kernel.launch_note = "as launched"
            self._fill_kernel(kernel, lowered, launch.spec)
            self._fill_cache(kernel, record.index)
            self._fill_loaded_attributes(kernel, launch.function)
        return record

    def _record_reference(self, pending) -> GraphRecord:
        from flame.codegen.lower import lower_group
        from flame.ir.passes import run_pipeline
        from flame.runtime.executor import _layout_of

        start = time.perf_counter()
        graph, passes = run_pipeline(Graph(tuple(pending)), record=True)
        record = self._new_record("reference", graph, passes, time.perf_counter() - start)
        for kernel, group in zip(record.kernels, graph.groups):
            if group.kind == "library":
                continue
            lowered = lower_group(group, _layout_of)
            kernel.grid, kernel.block, kernel.launch_note = launch_shape(lowered)
            self._fill_kernel(kernel, lowered, lowered.spec)
            kernel.cache = "not cached"
            kernel.cache_reason = "reference backend: compiled with NVRTC to be read, not run"
            kernel.compile_seconds = self._resources[kernel.name][2]
        return record

    def _new_record(self, backend: str, graph: Graph, passes, seconds) -> GraphRecord:
        from flame.ir.printer import node_names

        names = node_names(graph)
        signature = plan_signature(graph)
        record = GraphRecord(
            index=len(self.graphs) + 1,
            backend=backend,
            passes=[(p.name, p.seconds, format_graph(p.graph)) for p in passes],
            final=format_graph(graph),
            kernels=[],
            picture=GraphPicture.of(graph, names),
            plan_seconds=seconds,
            plan_reason=miss_reason(signature, [(g.index, g.signature) for g in self.graphs]),
            signature=signature,
            remat=remat_lines(graph),
        )
        reasons = boundary_reasons(graph)
        for index, group in enumerate(graph.groups or ()):
            sites = [format_site(n.site) for n in group.nodes if n.site is not None]
            kernel = KernelRecord(
                index=index,
                name=group.nodes[0].op if group.kind == "library" else "",
                kind=group.kind,
                label=group_label(group),
                writes=[names[id(node)] for node in group.outputs],
                reasons=reasons[index],
                sites=list(dict.fromkeys(sites)),
                ir=_group_text(group, names),
            )
            if group.kind == "library":
                node = group.nodes[0]
                kernel.bytes_moved = library_bytes(node)
                kernel.cache, kernel.cache_reason = "library", "runs a library routine"
                kernel.launch_note = "library call: " + ", ".join(
                    format_type(child) for child in node.inputs
                )
            record.kernels.append(kernel)
        self.graphs.append(record)
        return record

    def _fill_kernel(self, kernel: KernelRecord, lowered, spec) -> None:
        from flame.codegen.render import render
        from flame.runtime.device import target_arch

        kernel.name = spec.name
        kernel.spec = spec
        kernel.source = render(spec)
        kernel.bytes_moved = kernel_bytes(lowered)
        if kernel.name not in self._resources:
            self._resources[kernel.name] = compile_with_resources(
                kernel.source, kernel.name, target_arch()
            )
        kernel.resources, kernel.resources_note, _ = self._resources[kernel.name]

    def _fill_cache(self, kernel: KernelRecord, graph_index: int) -> None:
        event = self._kernel_events.get(kernel.name)
        earlier = list(self._specs)
        self._specs.append((kernel.name, kernel.spec, graph_index))
        if event is None:
            kernel.cache, kernel.cache_reason = "unknown", "no cache event was recorded"
            return
        kernel.cache = event["origin"]
        kernel.compile_seconds = event["seconds"] if event["origin"] != "memory" else None
        if event["origin"] == "memory":
            kernel.cache_reason = "hit: compiled or loaded earlier in this process"
        elif event["origin"] == "disk":
            kernel.cache_reason = (
                "hit on disk: a cubin for this code, arch, NVRTC version, options and "
                "FLAME version was stored by an earlier run"
            )
        else:
            kernel.cache_reason = "miss: " + spec_difference(kernel.spec, earlier)
        if event.get("reason") and event["origin"] != "memory":  # the cache's own comparison
            kernel.cache_reason += f"; against this process's kernels: {event['reason']}"

    def _fill_loaded_attributes(self, kernel: KernelRecord, function) -> None:
        """On a GPU the loaded function's own attributes are the truth; ptxas's log adds
        the spill counts the driver does not report."""
        try:
            from cupy_backends.cuda.api import driver

            def attribute(name: str) -> int:
                return int(driver.funcGetAttribute(getattr(driver, name), function.ptr))

            loaded = {
                "registers": attribute("CU_FUNC_ATTRIBUTE_NUM_REGS"),
                "local_bytes": attribute("CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES"),
                "shared": attribute("CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES"),
                "max_threads_per_block": attribute("CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK"),
            }
        except Exception as error:  # an old CuPy or driver: keep what ptxas said
            kernel.resources_note += f"; loaded-function attributes unavailable ({error})"
            return
        kernel.resources = {**(kernel.resources or {}), **loaded}
        kernel.resources_note = "loaded function attributes + ptxas -v"


def _group_text(group, names) -> str:
    lines = []
    for node in group.nodes:
        if node.op == "const" and node.shape == ():
            continue  # inline in its readers, as the graph printer shows it
        arguments = [names.get(id(child), "?") for child in node.inputs]
        arguments += [f"{key}={format_value(value)}" for key, value in node.attrs]
        name = names.get(id(node), "?")
        text = f"{name}: {format_type(node)} = {node.op}({', '.join(arguments)})"
        if node.site is not None:
            text = text.ljust(48) + f"  # {format_site(node.site)}"
        lines.append(text)
    lines.append("writes " + ", ".join(names[id(node)] for node in group.outputs))
    return "\n".join(lines)


def kernel_floor_ms(kernel: KernelRecord, bandwidth: float) -> float:
    """The time to move the kernel's bytes once at ``bandwidth`` (bytes/s)."""
    return kernel.bytes_moved / bandwidth * 1e3


def inputs_of(graph: Graph) -> list[str]:
    return [format_type(node) for node in graph.nodes if is_input(node)]
