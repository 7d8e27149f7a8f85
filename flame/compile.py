"""``flame.compile(fn)``: trace once per signature, then replay the prepared plan.

Lazy mode pays graph building, the plan key and the plan lookup on every call. A compiled
function pays them once and then binds the new arguments' memory to the traced plan and
launches its kernels directly.

Signatures. A call's *signature* is what changes the code: per tensor argument its backend,
dtype, rank, which axes have size 1 (the broadcast pattern) and whether it is contiguous and
aligned; per other argument its value. Sizes are not part of it: a new batch size or image
resolution with a known signature *re-plans* (traces again and plans; the kernels, whose sizes
are arguments, come from the cache) and counts as a re-plan, not a miss. ``cache_info()``
reports traces, hits, misses and re-plans, with the reason for each.

What a program reads. Tensor arguments are bound at every call. Tensors the function closes
over (weights, an optimizer's state) are read through their memory at every call, never
baked into a kernel: updating them in place (an optimizer step, ``copy_``, ``load_state_dict``)
needs no retrace. Rebinding a Python name to another tensor is not seen, as in JAX: pass such
tensors as arguments.

Training steps. ``loss.backward()`` inside a compiled function is traced with the forward,
as one graph; the gradients it accumulates into ``.grad`` become outputs of the program and
are assigned after each replay (a ``.grad`` that held a value at trace time is an input read
at every call).

The trace itself (the context the rest of FLAME consults while tracing, ``TraceError``, and
the run of the function over stand-ins of its arguments) is in compile_trace.py; here are
the cache of programs by signature, planning a trace into a program, and its replay.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
import weakref

from flame.amp.autocast_mode import key as autocast_key

# the trace (flame/compile_trace.py), every name importable from here as before
from flame.compile_trace import TraceError as TraceError  # re-exported (flame.TraceError)
from flame.compile_trace import _give_memory_to_closed_over, _tracing, trace_call
from flame.compile_trace import check_not_tracing as check_not_tracing  # re-exported
from flame.compile_trace import current_trace as current_trace  # re-exported
from flame.compile_trace import note_grad_assignment as note_grad_assignment  # re-exported
from flame.compile_trace import note_grad_cleared as note_grad_cleared  # re-exported
from flame.determinism import are_deterministic_algorithms_enabled

# ``_prepare`` reads direct_writes from this module (notes/probes/first_step_cpu.py patches it)
from flame.effects import direct_writes, drawing, write_back
from flame.program import CacheInfo, OutputSpec, _Program
from flame.replay import (
    MISS,
    GraphCache,
    capturable,
    dispatcher,
    fast_replay,
    unflatten,
    wrap,
)
from flame.runtime import events, step_graphs
from flame.runtime.compiler import kernel_loads
from flame.runtime.plan_store import paused_collector
from flame.runtime.storage import Storage, storage_of
from flame.signatures import exact_entry, generic_entry, miss_reason, shown
from flame.tensor import Tensor, realize


def _storage(tensor: Tensor):
    return storage_of(tensor.node)


class CompiledFunction:
    def __init__(self, fn, static_argnames=(), cuda_graph=None):
        self.fn = fn
        self.static_argnames = tuple(static_argnames)
        self.cuda_graph = cuda_graph
        self._signature = inspect.signature(fn)
        self._programs: dict[tuple, _Program] = {}  # exact description -> program (fast path)
        self._signatures: dict[tuple, dict] = {}  # generic signature -> {shapes: program}
        # One-kernel programs called with tensors only: the last one called, whose ``entry``
        # is tried first, and ``dispatcher``'s map of all of them (flat keys -> entries)
        self._entry = None
        self._direct: dict[tuple, object] = {}
        self._dispatch = None  # set when the first such program is prepared
        self._lock = threading.Lock()
        self._info = CacheInfo()
        functools.update_wrapper(self, fn)

    def cache_info(self) -> CacheInfo:
        return self._info

    def programs(self) -> list[dict]:
        """One entry per prepared program: its signature, sizes, launches and the planned
        peak of its own buffers (intermediates released after their last reader)."""
        entries = []
        for generic, by_sizes in self._signatures.items():
            for sizes, program in by_sizes.items():
                plan = program.plan
                entries.append({
                    "signature": [shown(entry) for entry in generic[1:]],
                    "sizes": [list(size) for size in sizes],
                    "launches": len(plan.launches) if plan is not None else 0,
                    "planned_peak_bytes": plan.planned_peak_bytes if plan is not None else None,
                    "sets_grads": len(program.grads),
                })  # fmt: skip
        return entries

    def __call__(self, *args, **kwargs):
        """A call the front function (``_front``) did not finish: another one-kernel
        program's key, keyword arguments, a trace in progress, or any other program."""
        tracing = _tracing.get()
        if self._dispatch is not None and not kwargs and tracing is None:
            entry = self._dispatch(self._direct, args)
            if entry is not None:
                result = entry(args)
                if result is not MISS:
                    self._entry = entry  # tried first from now on
                    self._info.hits += 1
                    return result
        names = None
        if kwargs:
            args, names = self._bind(args, kwargs)
        if tracing is not None:
            # Called inside another compiled function's trace: traced through, its ops part
            # of that program (a replay here would bake this call's result in as a constant)
            return self._call(args, names)
        # plans differ (flame/determinism.py); so do the graphs autocast builds (flame/amp)
        mode = (are_deterministic_algorithms_enabled(), autocast_key())
        exact = [(names, mode)]
        pending = None
        for a in args:
            if type(a) is Tensor:
                node = a.node
                storage = node.buffer
                if storage is None:
                    if node.op != "buffer":
                        pending = (pending or []) + [a]
                        exact.append(None)
                        continue
                    storage = node.attr("storage")
                exact.append((a.backend, node.dtype, node.shape, storage.layout()))
            else:
                exact.append(exact_entry(a))
        if pending:
            realize(*pending)
            exact = ((names, mode), *[exact_entry(a) for a in args])
        else:
            exact = tuple(exact)
        program = self._programs.get(exact)
        if program is not None and (not program.grads or program.guards_hold()):
            self._info.hits += 1
        else:
            program = self._trace(args, exact, names)
        if program.generators:
            for generator, count in program.generators:
                generator._advance_for_call(program.backend, count)
        if program.fast is not None:
            return program.fast(args)
        return self._run(program, args)

    def _bind(self, args, kwargs) -> tuple[tuple, tuple]:
        """Keyword arguments: every argument by position in the signature's order."""
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as error:
            raise TypeError(f"flame.compile({self.fn.__qualname__}): {error}") from None
        bound.apply_defaults()
        return tuple(bound.arguments.values()), tuple(bound.arguments)

    def _call(self, args, names):
        if names is None:
            return self.fn(*args)
        bound = inspect.BoundArguments(self._signature, dict(zip(names, args)))
        return self.fn(*bound.args, **bound.kwargs)

    def _classify(self, args, names) -> tuple[tuple, tuple]:
        """The generic signature and the sizes of the tensor arguments."""
        names = list(names or self._signature.parameters)
        generic = []
        for position, value in enumerate(args):
            name = names[position] if position < len(names) else f"#{position}"
            if isinstance(value, Tensor) and name in self.static_argnames:
                raise TypeError(
                    f"flame.compile({self.fn.__qualname__}): static argument {name!r} is a tensor"
                )
            generic.append(generic_entry(value))
        modes = (are_deterministic_algorithms_enabled(), autocast_key())
        generic = ((tuple(names), *modes), *generic)
        sizes = tuple(a.shape for a in args if isinstance(a, Tensor))
        return generic, sizes

    def _trace(self, args, exact, names) -> _Program:
        generic, sizes = self._classify(args, names)
        known = self._signatures.get(generic)
        if known is None:
            reason, kind = miss_reason(self._signatures, generic), "miss"
        elif sizes not in known:
            old = next(reversed(known))
            reason, kind = (
                f"new sizes {list(map(list, sizes))} (was {list(map(list, old))})",
                "replan",
            )
        else:
            reason, kind = "a .grad the trace read or wrote changed (None vs set)", "miss"
        start = time.perf_counter()
        _give_memory_to_closed_over(self.fn)
        # the trace builds tens of thousands of nodes that all stay alive: collections
        # during it find nothing (plan_store.paused_collector says what they cost)
        with kernel_loads() as loads, paused_collector():
            program = self._build(args, names)
        with self._lock:
            self._programs[exact] = program
            if program.entry is not None and names is None:
                self._direct[program.key] = program.entry
                if self._dispatch is None:
                    self._dispatch = dispatcher(len(args))
                self._entry = program.entry
            self._signatures.setdefault(generic, {})[sizes] = program
            self._info.traces += 1
            if kind == "replan":
                self._info.replans += 1
            else:
                self._info.misses += 1
            self._info.reasons.append(f"{kind}: {reason}")
            self._info.kernels.extend({"trace": self._info.traces, **load} for load in loads)
        if events.active():
            events.emit(
                "trace", function=self.__qualname__, reason=f"{kind}: {reason}",
                seconds=time.perf_counter() - start,
            )  # fmt: skip
        return program

    def _build(self, args, names) -> _Program:
        """Trace the call (compile_trace.py ``trace_call``) and plan it into a program."""
        return self._prepare(*trace_call(self._call, args, names))

    def _prepare(self, leaves, placeholders, treedef, trace, grads, call_key=None) -> _Program:
        """``call_key``: the traced call's ``direct_key`` when every argument is a tensor."""
        position_of = {id(node): i for i, node in enumerate(placeholders) if node is not None}
        previous_grad = {
            id(previous.node): index
            for index, (_, previous) in enumerate(trace.grads.values())
            if previous is not None
        }  # fmt: skip
        flat, computed, seen = [], [], {}
        for leaf in leaves:
            node = leaf.node
            if id(node) in position_of:
                flat.append(("arg", position_of[id(node)]))
            elif node.buffer is not None or node.op == "buffer":
                flat.append(("fixed", leaf))  # a realized tensor the function returned as is
            else:
                if id(node) not in seen:
                    seen[id(node)] = len(computed)
                    computed.append(node)
                flat.append(("out", seen[id(node)]))
        grad_entries = tuple((weakref.ref(owner), had, index) for owner, had, index in grads)
        backend = leaves[0].backend
        common = dict(
            treedef=treedef, flat=tuple(flat), grads=grad_entries,
            generators=tuple(trace.draws.items()), backend=backend, writes=trace.written,
        )  # fmt: skip
        if not computed:
            return _Program((), (), None, **common)
        from flame.runtime.walks import linearize

        order, inputs, key = linearize(computed)
        sources = tuple(
            ("arg", position_of[id(node)]) if id(node) in position_of
            else ("grad", previous_grad[id(node)]) if id(node) in previous_grad
            else ("storage", storage_of(node))
            for node in inputs
        )  # fmt: skip
        if backend != "cuda":
            if events.active():  # the dump renders and compiles the program's kernels
                events.emit("reference", outputs=list(computed))
            pairs = tuple(zip(inputs, sources))
            return _Program(tuple(computed), sources, None, reference_inputs=pairs, **common)
        from flame.runtime.executor import default_executor
        from flame.runtime.writes import Readers

        plan = default_executor().plan_for(computed, inputs, key)
        # the plan's outputs come back in the order it was asked for them
        outputs = tuple(OutputSpec(node.dtype, node.shape, node.site) for node in computed)
        program = _Program(outputs, sources, plan, **common)
        # one index of who reads what for all the writes' checks (a walk each was quadratic)
        program.direct = direct_writes(program, Readers(order, inputs), inputs, trace)
        if not grads and not trace.written and all(kind != "grad" for kind, _ in sources):
            graphs = None
            if self.cuda_graph is not False and capturable(plan, forced=bool(self.cuda_graph)):
                graphs = GraphCache(plan, self._info)
            program.fast, program.entry = fast_replay(
                plan, sources, program.out_nodes, program.flat, program.treedef, graphs,
                arity=len(placeholders), key=call_key,
            )  # fmt: skip
            if program.generators and program.entry is not None:
                program.entry = drawing(program.entry, program.generators, backend)
            program.key = call_key
        elif step_graphs.wanted(plan, self.cuda_graph):
            program.graphs = True  # made at the first replay, which knows the arguments
        return program

    def _run(self, program: _Program, args):
        values = self._replay(program, args) if program.out_nodes else []
        flat = [
            values[item] if kind == "out" else args[item] if kind == "arg" else item
            for kind, item in program.flat
        ]
        for owner_ref, _, index in program.grads:
            owner = owner_ref()
            if owner is not None:
                owner.grad = flat[index] if index is not None else None
        direct = program.direct or (None,) * len(program.writes)
        for ((kind, target), index), slot in zip(program.writes, direct):
            if slot is None:  # computed apart: copied into the memory
                storage = _storage(args[target]) if kind == "arg" else target
                write_back(storage, flat[index])
        return unflatten(program.treedef, iter(flat))

    def _source_storage(self, program, kind, value, args):
        if kind == "arg":
            return _storage(args[value])
        if kind == "grad":
            owner = program.grads[value][0]()
            grad = owner.grad
            if not grad.is_realized:
                grad.realize()
            return _storage(grad)
        return value

    def _replay(self, program: _Program, args) -> list:
        if program.plan is None:
            return self._replay_reference(program, args)
        from flame.runtime.executor import default_executor

        arrays = [
            _storage(args[value]).device_array() if kind == "arg"
            else self._source_storage(program, kind, value, args).device_array()
            for kind, value in program.sources
        ]  # fmt: skip
        targets = {
            slot: (_storage(args[target]) if kind == "arg" else target).device_array()
            for ((kind, target), _), slot in zip(program.writes, program.direct)
            if slot is not None
        }  # fmt: skip
        if program.graphs is not None:
            results = step_graphs.replay(program, arrays, targets, self._info)
            if results is not None:
                return results
        if targets:
            slots = default_executor().run_into(program.plan, arrays, targets)
        else:
            slots = default_executor().run(program.plan, arrays)
        return [
            wrap(Storage("cuda", node.dtype, array=slots[slot]), node.dtype, node.shape, node.site)
            for node, slot in zip(program.out_nodes, program.plan.output_slots)
        ]

    def _replay_reference(self, program: _Program, args) -> list:
        from flame.runtime.reference import evaluate

        bound = {
            id(node): self._source_storage(program, kind, value, args).numpy()
            for node, (kind, value) in program.reference_inputs
        }  # fmt: skip
        values = evaluate(list(program.out_nodes), inputs=bound, realized=False)
        return [
            wrap(
                Storage("reference", node.dtype, array=value.astype(node.dtype.numpy)),
                node.dtype,
                node.shape,
                node.site,
            )
            for node, value in zip(program.out_nodes, values)
        ]


def _front(state: CompiledFunction):
    """The function ``flame.compile`` returns. A call first tries the entry of the last
    one-kernel program called (flame/replay.py ``one_kernel_replay``: the whole replay in one
    generated function, which returns ``MISS`` for another key); everything else goes to
    ``state``. A plain function, not the ``CompiledFunction`` itself: calling an instance
    costs Python more than calling a function (measured ~0.1 us per call).

    Its attributes: ``cache_info()``, ``programs()``, and ``_state``."""
    tracing = _tracing.get
    info = state._info

    def compiled(*args, **kwargs):
        entry = state._entry
        if entry is not None and not kwargs and tracing() is None:
            result = entry(args)
            if result is not MISS:
                info.hits += 1
                return result
        return state(*args, **kwargs)

    functools.update_wrapper(compiled, state.fn)
    compiled.cache_info = state.cache_info
    compiled.programs = state.programs
    compiled._state = state
    return compiled


def compile(fn=None, *, static_argnames=(), cuda_graph=None):  # noqa: A001 (as torch.compile)
    """Trace ``fn`` once per signature and replay the prepared kernels on later calls.

    ``static_argnames``: parameters whose values select code (their values are part of the
    signature; passing a tensor there is an error). ``cuda_graph``: None (default) captures
    programs of several kernels and no library calls as CUDA graphs, replayed with one
    launch; True also captures single-kernel programs and programs with cuBLAS products or
    joins (flame/replay.py ``capturable`` says why that is not the default); False never
    captures."""
    if fn is None:
        return functools.partial(compile, static_argnames=static_argnames, cuda_graph=cuda_graph)
    from flame.nn.modules.module import Module

    if isinstance(fn, Module):  # model = fl.compile(model): still the model to its user
        return CompiledModule(fn, _front(CompiledFunction(fn.__call__, static_argnames,
                                                          cuda_graph)))  # fmt: skip
    return _front(CompiledFunction(fn, static_argnames, cuda_graph))


class CompiledModule:
    """What ``flame.compile(module)`` returns: calls go to the compiled ``module.__call__``;
    every other attribute is the module's (``parameters()``, ``train()``, ``state_dict()``
    with the module's own keys -- PyTorch's ``OptimizedModule`` prefixes them with
    ``_orig_mod.``), and ``_orig_mod`` is the module, as in PyTorch."""

    def __init__(self, module, compiled):
        object.__setattr__(self, "_orig_mod", module)
        object.__setattr__(self, "_compiled", compiled)
        object.__setattr__(self, "cache_info", compiled.cache_info)
        object.__setattr__(self, "programs", compiled.programs)

    def __call__(self, *args, **kwargs):
        return self._compiled(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._orig_mod, name)

    def __setattr__(self, name, value) -> None:
        setattr(self._orig_mod, name, value)

    def __repr__(self) -> str:
        return f"CompiledModule({self._orig_mod!r})"
