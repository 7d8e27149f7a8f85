"""Tracing a call of a compiled function (flame/compile.py): the trace in progress, which
the rest of FLAME consults, and the run of the function over stand-ins of its arguments.

While ``flame.compile`` traces, a context variable holds the ``Trace`` (flame/effects.py):
ops that need a value raise ``TraceError`` (``check_not_tracing``); ``backward()``,
``zero_grad()``, in-place writes and generators record what the program must repeat at every
call (``current_trace``, ``note_grad_assignment``, ``note_grad_cleared``). ``trace_call``
runs the function once with buffer stand-ins for its tensor arguments and returns what
compile.py plans into a program: the results, the ``.grad`` assignments and the in-place
writes as flat outputs. Every name here is importable from flame/compile.py as before.
"""

from __future__ import annotations

import contextvars

from flame.effects import Trace
from flame.ir.node import Node, format_site, user_site
from flame.replay import direct_key, flatten
from flame.runtime.storage import storage_of
from flame.tensor import Tensor, realize

_tracing: contextvars.ContextVar[object] = contextvars.ContextVar("flame_tracing", default=None)


class TraceError(RuntimeError):
    """A compiled function asked for a tensor's value while being traced."""


def check_not_tracing(what: str) -> None:
    if _tracing.get() is not None:
        raise TraceError(
            f"{what} of a tensor inside a function being compiled [at {format_site(user_site())}]: "
            "the value is not known while tracing. Keep Python control flow on static "
            "arguments (static_argnames=) or use flame.where to select values."
        )


def current_trace():
    """The trace in progress in this context (None outside ``flame.compile``'s tracing)."""
    return _tracing.get()


def note_grad_assignment(owner: Tensor) -> None:
    """Called by ``backward()`` before it writes ``owner.grad``: while tracing, the compiled
    function records the tensor (and the gradient it held before) to make the new gradient
    an output of the program."""
    trace = _tracing.get()
    if trace is not None:
        trace.note_grad(owner)


def note_grad_cleared(owner: Tensor) -> None:
    """Called by ``zero_grad()`` before it replaces ``owner.grad``: a compiled step that
    clears its gradients first does not depend on them (no retrace when they appear)."""
    trace = _tracing.get()
    if trace is not None:
        trace.note_grad_cleared(owner)


def trace_call(call, args, names) -> tuple:
    """Run ``call(traced_args, names)`` (the compiled function) with each tensor argument
    replaced by a buffer stand-in over the same memory, with the trace context set.

    Returns ``(leaves, placeholders, treedef, trace, grads, call_key)``: the flat outputs
    (the results, then each new ``.grad``, then each in-place write's value), per argument
    its stand-in node (None for other arguments), how to rebuild the result, the ``Trace``,
    per ``.grad`` set ``(owner, had a grad, index in leaves)``, and the call's
    ``direct_key`` when every argument is a tensor. Every ``.grad`` the function set is put
    back as it was (a replay assigns the program's result)."""
    placeholders = []
    for a in args:
        if not isinstance(a, Tensor):
            placeholders.append(None)
            continue
        node = Node("buffer", (), (("storage", storage_of(a.node)),), a.dtype, a.shape, a.node.site)
        node.grad_info = a.node.grad_info  # backward() inside reaches the caller's tensor
        placeholders.append(node)
    traced_args = [
        Tensor(node, a.backend) if node is not None else a for node, a in zip(placeholders, args)
    ]
    trace = Trace()
    token = _tracing.set(trace)
    try:
        result = call(traced_args, names)
    except BaseException:
        for owner, previous in trace.grads.values():
            owner.grad = previous  # a failed trace leaves no traced value behind
        raise
    finally:
        _tracing.reset(token)
        trace.restore_written()
    leaves: list[Tensor] = []
    treedef = flatten(result, leaves)
    grads = []
    for owner, previous in trace.grads.values():
        # whether a .grad was there matters only if the program reads it (None: it
        # cleared it first)
        had = None if id(owner) in trace.cleared else previous is not None
        if owner.grad is None:  # set to None in the function (zero_grad(set_to_none))
            grads.append((owner, had, None))
        else:
            grads.append((owner, had, len(leaves)))
            leaves.append(owner.grad)
        owner.grad = previous  # the replay reads it, then assigns the program's result
    writes = []
    storage_position = {
        id(node.attr("storage")): position
        for position, node in enumerate(placeholders) if node is not None
    }  # fmt: skip
    for storage, value, tensors in trace.writes.values():
        position = storage_position.get(id(storage))
        target = ("arg", position) if position is not None else ("storage", storage)
        writes.append((target, len(leaves)))
        leaves.append(Tensor(value, tensors[0][0].backend))
    trace.written = tuple(writes)
    if not leaves:
        raise TypeError("flame.compile: the function returned no tensor and set no .grad")
    backend = leaves[0].backend
    if any(leaf.backend != backend for leaf in leaves) or any(
        a.backend != backend for a in args if isinstance(a, Tensor)
    ):
        raise ValueError("flame.compile: tensors on different backends in one function")
    call_key = direct_key(args) if all(node is not None for node in placeholders) else None
    return leaves, placeholders, treedef, trace, grads, call_key


def _give_memory_to_closed_over(fn) -> None:
    """Realize the lazy tensors ``fn`` closes over (its closure cells and the globals its code
    names, and the items of lists, tuples and dicts there): a program reads closed-over
    tensors through their memory, so an in-place write to one (``running.add_(x)``, with
    ``running = fl.zeros(3)`` never computed) is a write the program repeats at every call,
    not a rebinding seen only while tracing. Tensors reached through other objects (a
    module's buffers) have memory already."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    values = [cell.cell_contents for cell in (fn.__closure__ or ()) if _filled(cell)]
    names = getattr(fn, "__globals__", {})
    values += [names[name] for name in code.co_names if name in names]
    lazy = []
    for value in values:
        items = value.values() if isinstance(value, dict) else value
        for item in items if isinstance(value, (list, tuple, dict)) else (value,):
            if isinstance(item, Tensor) and not item.is_realized:
                lazy.append(item)
    if lazy:
        realize(*lazy)


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True
