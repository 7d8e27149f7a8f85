"""``flame.compile(fn)``: trace once per signature, then replay the prepared plan.

Lazy mode pays graph building, the plan key and the plan lookup on every call. A compiled
function pays them once per *signature* (the dtypes, shapes and layouts of its tensor
arguments, and the values of its other arguments); later calls bind the new arguments' memory
to the traced plan and launch its kernels directly.

What is here: tracing, the signature cache with hit/miss counts and miss reasons, replay on
the CUDA backend, and the same semantics on the reference backend (the traced graph is
re-evaluated there). Not yet: size-generic signatures (a new shape traces again, although it
reuses the compiled kernels), CUDA-graph capture, whole training steps with optimizer state.
"""

from __future__ import annotations

import contextvars
import functools
import threading
import time
from dataclasses import dataclass, field

from flame.ir.node import Node, format_site, user_site
from flame.runtime import events
from flame.runtime.storage import Storage
from flame.tensor import Tensor, realize

_tracing: contextvars.ContextVar[bool] = contextvars.ContextVar("flame_tracing", default=False)


class TraceError(RuntimeError):
    """A compiled function asked for a tensor's value while being traced."""


def check_not_tracing(what: str) -> None:
    if _tracing.get():
        raise TraceError(
            f"{what} of a tensor inside a function being compiled [at {format_site(user_site())}]: "
            "the value is not known while tracing. Keep Python control flow on static "
            "arguments (static_argnames=) or use flame.where to select values."
        )


@dataclass
class CacheInfo:
    traces: int = 0
    hits: int = 0
    misses: int = 0
    reasons: list = field(default_factory=list)  # why each miss happened


@dataclass
class _Program:
    out_nodes: tuple
    sources: tuple  # per plan input: ("arg", position) or ("const", array)
    plan: object  # executor Plan (CUDA) or None (reference)
    placeholders: tuple  # the traced argument nodes, by position (None for non-tensors)
    structure: object  # how to rebuild fn's output (a Tensor, or a tuple/list of them)
    passthrough: dict  # output index -> argument position, for outputs that are arguments


def _describe(value):
    if isinstance(value, Tensor):
        storage = _storage(value)
        layout = storage.layout() if storage is not None else None
        return ("tensor", value.backend, value.dtype.name, value.shape, layout)
    if isinstance(value, (int, float, bool, str, type(None))):
        return ("static", type(value).__name__, value)
    raise TypeError(
        f"flame.compile: arguments must be tensors or Python numbers/strings, got "
        f"{type(value).__name__}"
    )


def _shown(description) -> tuple:
    """A signature entry without its memory layout (which is rarely what changed)."""
    return description[:-1] if description[0] == "tensor" else description


def _storage(tensor: Tensor):
    node = tensor.node
    return node.buffer if node.buffer is not None else node.attr("storage")


class CompiledFunction:
    def __init__(self, fn):
        self.fn = fn
        self._programs: dict[tuple, _Program] = {}
        self._lock = threading.Lock()
        self._info = CacheInfo()
        functools.update_wrapper(self, fn)

    def cache_info(self) -> CacheInfo:
        return self._info

    def __call__(self, *args):
        tensors = [a for a in args if isinstance(a, Tensor)]
        if any(not t.is_realized for t in tensors):
            realize(*[t for t in tensors if not t.is_realized])
        signature = tuple(_describe(a) for a in args)
        program = self._programs.get(signature)
        if program is None:
            program = self._trace(args, signature)
        else:
            self._info.hits += 1
        return self._run(program, args)

    def _miss_reason(self, signature) -> str:
        if not self._programs:
            return "first call"
        previous = next(reversed(self._programs))
        for position, (old, new) in enumerate(zip(previous, signature)):
            if old != new:
                return f"argument {position}: {_shown(old)} -> {_shown(new)}"
        return "different number of arguments"

    def _trace(self, args, signature) -> _Program:
        reason = self._miss_reason(signature)
        start = time.perf_counter()
        placeholders = [
            Node("buffer", (), (("storage", _storage(a)),), a.dtype, a.shape, a.node.site)
            if isinstance(a, Tensor) else None
            for a in args
        ]  # fmt: skip
        traced_args = [
            Tensor(node, a.backend) if node is not None else a
            for node, a in zip(placeholders, args)
        ]
        token = _tracing.set(True)
        try:
            result = self.fn(*traced_args)
        finally:
            _tracing.reset(token)
        outputs = [result] if isinstance(result, Tensor) else list(result)
        if not all(isinstance(out, Tensor) for out in outputs):
            raise TypeError(
                "flame.compile: the function must return a tensor or a tuple of tensors"
            )
        program = self._prepare(
            outputs, placeholders, type(result) if not isinstance(result, Tensor) else Tensor
        )
        with self._lock:
            self._programs[signature] = program
            self._info.traces += 1
            self._info.misses += 1
            self._info.reasons.append(reason)
        if events.active():
            events.emit(
                "trace",
                function=self.__qualname__,
                reason=reason,
                seconds=time.perf_counter() - start,
            )
        return program

    def _prepare(self, outputs, placeholders, structure) -> _Program:
        position_of = {id(node): i for i, node in enumerate(placeholders) if node is not None}
        passthrough = {
            index: position_of[id(out.node)] for index, out in enumerate(outputs)
            if id(out.node) in position_of
        }  # fmt: skip
        computed = [out.node for index, out in enumerate(outputs) if index not in passthrough]
        backend = outputs[0].backend
        if backend != "cuda" or not computed:
            return _Program(tuple(computed), (), None, tuple(placeholders), structure, passthrough)
        from flame.runtime.executor import _array_of, default_executor, linearize

        executor = default_executor()
        _, inputs, key = linearize(computed)
        plan = executor.plan_for(computed, inputs, key)
        sources = tuple(
            ("arg", position_of[id(node)]) if id(node) in position_of
            else ("const", _array_of(node))
            for node in inputs
        )  # fmt: skip
        return _Program(tuple(computed), sources, plan, tuple(placeholders), structure, passthrough)

    def _run(self, program: _Program, args):
        values = self._replay(program, args)
        results, computed = [], iter(values)
        count = len(program.out_nodes) + len(program.passthrough)
        for index in range(count):
            if index in program.passthrough:
                results.append(args[program.passthrough[index]])
            else:
                results.append(next(computed))
        if program.structure is Tensor:
            return results[0]
        return program.structure(results)

    def _replay(self, program: _Program, args) -> list:
        if program.plan is None:
            return self._replay_reference(program, args)
        from flame.runtime.executor import default_executor

        arrays = [
            _storage(args[value]).device_array() if kind == "arg" else value
            for kind, value in program.sources
        ]
        slots = default_executor().run(program.plan, arrays)
        return [
            _wrap(Storage("cuda", node.dtype, array=slots[slot]), node)
            for node, slot in zip(program.out_nodes, program.plan.output_slots)
        ]

    def _replay_reference(self, program: _Program, args) -> list:
        from flame.runtime.reference import evaluate

        bound = {
            id(node): _storage(arg).numpy()
            for node, arg in zip(program.placeholders, args) if node is not None
        }  # fmt: skip
        values = evaluate(list(program.out_nodes), inputs=bound, realized=False)
        return [
            _wrap(Storage("reference", node.dtype, array=value.astype(node.dtype.numpy)), node)
            for node, value in zip(program.out_nodes, values)
        ]


def _wrap(storage: Storage, like: Node) -> Tensor:
    node = Node("buffer", (), (("storage", storage),), like.dtype, like.shape, like.site)
    return Tensor(node, storage.backend)


def compile(fn=None):  # noqa: A001 (flame.compile, as torch.compile)
    """Trace ``fn`` once per signature and replay the prepared kernels on later calls."""
    if fn is None:
        return compile
    return CompiledFunction(fn)
