"""Autograd as a graph-to-graph transform.

``backward`` walks the forward graph from the outputs towards the inputs and, for each node,
applies the backward rule declared with its op (``registry.def_vjp``). The rules are written
with ordinary tensor ops, so the gradients are lazy tensors whose graph shares nodes with the
forward one: realizing a gradient runs forward and backward as one schedule, through the same
passes and code generator, and the backward can itself be differentiated.

State lives on the graph, never in a global tape: ``Node.grad_info`` marks the user tensors
that asked for a gradient (``requires_grad_``) and holds their hooks; ``Tensor.grad`` holds
the accumulated (lazy) gradient.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace

from flame import grad_templates
from flame.compile import current_trace, note_grad_assignment
from flame.determinism import are_deterministic_algorithms_enabled
from flame.grad_functions import functions  # the rules' ``F``, importable from here too
from flame.ir import overwritten
from flame.ir.node import Node, format_site, toposort, user_site
from flame.ir.ops import OPS
from flame.ir.shapes import ShapeError
from flame.tensor import Tensor
from flame.tensor import grad_enabled as _grad_enabled


class GradError(RuntimeError):
    """A gradient was asked for in a way that has no answer; the message says why."""


def _at_user_line(function):
    """Errors raised while building a backward name the user's line that asked for it."""

    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except (GradError, ShapeError) as error:
            if "[at " in str(error):
                raise
            raise type(error)(f"{error} [at {format_site(user_site())}]") from None

    return wrapped


@dataclass
class GradInfo:
    owner: object = None  # weakref to the Tensor that accumulates the gradient
    hooks: list = field(default_factory=list)
    # ``hook(tensor)`` after ``backward`` wrote ``tensor.grad`` (they change no gradient)
    post_accumulate_hooks: list = field(default_factory=list)


def is_grad_enabled() -> bool:
    return _grad_enabled.get()


@contextlib.contextmanager
def no_grad():
    """Ops built inside do not carry gradients (their results are detached)."""
    token = _grad_enabled.set(False)
    try:
        yield
    finally:
        _grad_enabled.reset(token)


class inference_mode(contextlib.ContextDecorator):  # noqa: N801 (PyTorch's name)
    """As ``no_grad`` (FLAME keeps no autograd records either way); also a decorator.
    ``inference_mode(False)`` leaves gradients on."""

    def __init__(self, mode: bool = True):
        self.mode = mode
        self._tokens = []

    def __enter__(self):
        self._tokens.append(_grad_enabled.set(not self.mode and _grad_enabled.get()))
        return self

    def __exit__(self, *exc):
        _grad_enabled.reset(self._tokens.pop())
        return False


@contextlib.contextmanager
def enable_grad():
    token = _grad_enabled.set(True)
    try:
        yield
    finally:
        _grad_enabled.reset(token)


# --- the transform ----------------------------------------------------------------------------


def _extra_inputs(node: Node) -> tuple[Node, ...]:
    """Values a node's gradient flows to besides its graph inputs (a checkpoint's args)."""
    if node.op == "checkpoint":
        recompute = node.attr("recompute")
        return recompute.arg_nodes + recompute.closed_over()
    return ()


def _relevant(order, targets: set[int]) -> set[int]:
    """Nodes on a path to one of ``targets`` (only those need a cotangent)."""
    relevant: set[int] = set()
    for node in order:
        if id(node) in targets:
            relevant.add(id(node))
            continue
        children = node.inputs if node.op != "checkpoint" else _backward_inputs(node)
        for child in children:
            if id(child) in relevant:
                relevant.add(id(node))
                break
    return relevant


def _backward_inputs(node: Node) -> tuple[Node, ...]:
    """The values a node's gradient flows to: none behind a detach, a checkpoint's args too."""
    op = node.op
    if op == "detach":
        return ()
    if op == "checkpoint":
        return node.inputs + _extra_inputs(node)
    return node.inputs


def _walk(roots) -> list[Node]:
    """Forward nodes from the leaves to ``roots``, through realized values, never into a
    detached one."""
    return toposort(roots, children=_backward_inputs)


def cotangents(
    outputs, seeds, targets, backend: str, templates: bool = True, order=None
) -> dict[int, Tensor]:
    """Reverse-mode sweep: ``{id(node): cotangent}`` for the ``targets`` (and, when the
    backward rules run, every node on a path from them to ``outputs``).

    A forward graph seen before at the same line is not swept again: its backward is made
    from the recorded template (flame/grad_templates.py), the graph the rules built then.
    A backward that reads a value an in-place write changed after the forward used it is
    refused (PyTorch's version-counter error), naming both lines. ``order``: ``_walk`` of
    the outputs, when the caller has it."""
    from flame.amp.autocast_mode import _active

    token = _active.set(None)  # backward ops run in the forward's dtypes, as PyTorch's
    try:
        total = _cotangents(outputs, seeds, targets, backend, templates, order)
    finally:
        _active.reset(token)
    if overwritten._overwritten:
        found = overwritten.find([total[id(t)].node for t in targets if id(t) in total])
        if found is not None:
            raise GradError(
                overwritten.describe(found, "the backward")
                + ": one of the values needed for gradient computation has been modified by "
                "an in-place operation"
            )
    return total


def _cotangents(outputs, seeds, targets, backend: str, templates: bool, order):
    if not templates:
        return _sweep(outputs, seeds, targets, backend, order)
    roots = [out.node for out in outputs] + [seed.node for seed in seeds]
    key = (user_site(), are_deterministic_algorithms_enabled(), _grad_enabled.get(), backend)
    grads = grad_templates.lookup(key, roots, targets)
    if grads is not None:
        return {
            id(target): Tensor(grad, backend)
            for target, grad in zip(targets, grads)
            if grad is not None
        }  # fmt: skip
    total = _sweep(outputs, seeds, targets, backend, order)
    # not while flame.compile traces: the trace runs once per signature, and a retrace (new
    # sizes) does not match a template recorded over other sizes; the record cost a fifth
    # of the UNet step's backward
    if grad_templates.worth_recording(key) and current_trace() is None:
        found = [total.get(id(target)) for target in targets]
        template = grad_templates.record(
            roots, targets, [None if g is None else g.node for g in found]
        )
        grad_templates.remember(key, template)
    return total


def _sweep(outputs, seeds, targets, backend: str, order=None) -> dict[int, Tensor]:
    """The backward rules, run node by node from the outputs back."""
    if order is None:
        order = _walk([out.node for out in outputs])
    relevant = _relevant(order, {id(node) for node in targets})
    total: dict[int, Tensor] = {}
    for out, seed in zip(outputs, seeds):
        _accumulate(total, out.node, seed)
    F = functions()
    for node in reversed(order):
        g = total.get(id(node))
        if g is None or id(node) not in relevant:
            continue
        if node.grad_info is not None:
            g = _run_hooks(node, g)
            total[id(node)] = g
        if not node.inputs or node.op == "detach":
            continue
        op = OPS[node.op]
        if not op.differentiable or op.vjp is None:
            if any(id(child) in relevant for child in node.inputs):
                raise GradError(f"{node.op} has no gradient rule (built at {_where(node)})")
            continue
        wrap = [Tensor(child, backend) for child in node.inputs]
        grads = op.vjp(F, g, Tensor(node, backend), *wrap, **dict(node.attrs))
        if node.op == "checkpoint":
            children = node.inputs + _extra_inputs(node)
        else:
            children = node.inputs
        for child, grad in zip(children, grads):
            if grad is not None and id(child) in relevant:
                _accumulate(total, child, grad)
    return total


def _where(node: Node) -> str:
    return format_site(node.site) if node.site else "unknown line"


def _accumulate(total, node: Node, grad: Tensor) -> None:
    if grad.shape != node.shape:
        raise ShapeError(
            f"gradient of shape {list(grad.shape)} for a value of shape {list(node.shape)}"
        )
    if grad.dtype is not node.dtype:
        grad = grad.to(node.dtype)
    previous = total.get(id(node))
    total[id(node)] = grad if previous is None else previous + grad


def _run_hooks(node: Node, g: Tensor) -> Tensor:
    info = node.grad_info
    if info is None:
        return g
    for hook in info.hooks:
        result = hook(g)
        if result is None:
            continue
        if not isinstance(result, Tensor) or result.shape != g.shape or result.dtype is not g.dtype:
            shown = (
                f"{result.dtype.name}{list(result.shape)}"
                if isinstance(result, Tensor)
                else type(result).__name__
            )
            raise GradError(
                f"hook {getattr(hook, '__name__', hook)!r} returned {shown}; the gradient is "
                f"{g.dtype.name}{list(g.shape)} and a hook must return the same shape and dtype"
            )
        g = result
    return g


# --- the PyTorch-style API --------------------------------------------------------------------


def _info(tensor: Tensor) -> GradInfo:
    if tensor.node.grad_info is None:
        tensor.node.grad_info = GradInfo()
    return tensor.node.grad_info


def requires_grad_(self: Tensor, requires_grad: bool = True) -> Tensor:
    if requires_grad and not self.dtype.is_float:
        raise GradError(
            f"only float tensors can require gradients, got {self.dtype.name} "
            f"[at {format_site(user_site())}]"
        )
    info = _info(self)
    info.owner = weakref.ref(self) if requires_grad else None
    return self


def _requires_grad(self: Tensor) -> bool:
    for node in _walk([self.node]):
        info = node.grad_info
        if info is not None and info.owner is not None and info.owner() is not None:
            return True
    return False


def _tensors(value, name: str) -> tuple[Tensor, ...]:
    """A tensor or a sequence of tensors as a tuple; anything else is a TypeError."""
    items = (value,) if isinstance(value, Tensor) else tuple(value)
    for index, item in enumerate(items):
        if not isinstance(item, Tensor):
            raise TypeError(f"{name}[{index}] is a {type(item).__name__}, not a Tensor")
    return items


def _seeds(outputs, given, caller: str, keyword: str) -> list[Tensor]:
    """One cotangent per output: ``given`` (a tensor, or a sequence holding Nones) or, for a
    one-element output left without one, ones. A mismatched shape is ``_accumulate``'s error."""
    if given is None or isinstance(given, Tensor):
        given = [given] * len(outputs) if given is None else [given]
    given = list(given)
    if len(given) != len(outputs):
        raise GradError(f"{caller}: {len(outputs)} outputs but {len(given)} {keyword}")
    for index, (out, seed) in enumerate(zip(outputs, given)):
        if seed is None and out.numel() != 1:
            raise GradError(
                f"{caller} on a tensor of shape {list(out.shape)} needs {keyword}= (grad can "
                "be implicitly created only for one-element outputs)"
            )
        if seed is not None and not isinstance(seed, Tensor):
            raise TypeError(f"{caller}: {keyword}[{index}] is a {type(seed).__name__}")
    return [_filled(out, 1) if seed is None else seed for out, seed in zip(outputs, given)]


@_at_user_line
def backward(
    tensors, grad_tensors=None, retain_graph=None, create_graph=False, grad_variables=None,
    inputs=None,
) -> None:  # fmt: skip
    """``torch.autograd.backward``: accumulate the gradients of ``tensors`` (seeded with
    ``grad_tensors``; ones for a one-element tensor) into ``.grad`` of every leaf that requires
    grad, or of ``inputs``. With ``create_graph`` they stay differentiable (grad of grad).
    ``retain_graph`` is accepted: a backward frees no FLAME graph."""
    outputs = _tensors(tensors, "tensors")
    given = grad_variables if grad_tensors is None else grad_tensors
    _backward(outputs, _seeds(outputs, given, "backward()", "grad_tensors"), create_graph, inputs)


@_at_user_line
def _tensor_backward(
    self, gradient=None, retain_graph=None, create_graph=False, inputs=None, *, grad=None
) -> None:  # fmt: skip
    """``Tensor.backward`` (``grad=`` is FLAME's older name for ``gradient=``)."""
    seeds = _seeds([self], grad if gradient is None else gradient, "backward()", "grad")
    _backward([self], seeds, create_graph, inputs)


def _backward(outputs, seeds, create_graph: bool, inputs) -> None:
    site = format_site(user_site())
    order = None
    if inputs is None:
        order = _walk([out.node for out in outputs])  # the sweep's too
        nodes = [node for node in order if node.grad_info]
        owners = [(node, node.grad_info.owner) for node in nodes]
        leaves = [(node, ref()) for node, ref in owners if ref is not None and ref() is not None]
        if not leaves:
            raise GradError(f"backward(): nothing in this graph requires grad [at {site}]")
    else:
        leaves = [(t.node, t) for t in {id(t): t for t in _tensors(inputs, "inputs")}.values()]
        if not leaves:
            raise GradError(f"backward(): inputs= cannot be empty [at {site}]")
    targets = [node for node, _ in leaves]
    total = cotangents(outputs, seeds, targets, outputs[0].backend, order=order)
    for node, owner in leaves:
        g = total.get(id(node))
        if g is None:
            continue
        note_grad_assignment(owner)  # flame.compile: the new .grad is an output of the program
        g = g if create_graph else detach(g)
        owner.grad = g if owner.grad is None else owner.grad + g
        for hook in list(node.grad_info.post_accumulate_hooks if node.grad_info else ()):
            if hook(owner) is not None:
                raise GradError("Tensor post accumulate grad hooks should return None.")
    if not create_graph:
        _compute_now(outputs, [owner.grad for _, owner in leaves])


def _compute_now(outputs, grads) -> None:
    """Lazy mode computes the outputs and the gradients here, in one plan, as PyTorch has by
    the time ``backward()`` returns: a loss read after ``opt.step()`` wrote the weights in
    place (``loss.backward(); opt.step(); loss.item()``) is the loss of the step, not one
    recomputed from the new weights. Inside ``flame.compile`` the program orders the work."""
    if current_trace() is not None:
        return
    from flame.tensor import realize

    realize(*outputs, *[g for g in grads if isinstance(g, Tensor)])


def register_hook(self: Tensor, hook):
    """``hook(grad) -> new grad or None``: runs when this value's gradient is complete; its
    result becomes part of the backward graph (it fuses like any other op)."""
    info = _info(self)
    info.hooks.append(hook)
    return SimpleNamespace(remove=lambda: info.hooks.remove(hook) if hook in info.hooks else None)


def register_post_accumulate_grad_hook(self: Tensor, hook):
    """``hook(tensor) -> None`` after ``backward()`` has accumulated this leaf's gradient into
    ``tensor.grad`` (PyTorch's name). ``backward`` builds the whole backward graph first and
    then writes every ``.grad``, so the hooks of one ``backward`` run one after the other at
    its end; the gradients are lazy there (reading one runs the backward)."""
    info = self.node.grad_info
    owner = None if info is None or info.owner is None else info.owner()
    if owner is not self:
        if not self.requires_grad:
            raise GradError(
                "register_post_accumulate_grad_hook: cannot register a hook on a tensor that "
                "doesn't require gradient"
            )
        raise GradError("post accumulate grad hooks cannot be registered on non-leaf tensors")
    hooks = info.post_accumulate_hooks
    hooks.append(hook)
    return SimpleNamespace(remove=lambda: hooks.remove(hook) if hook in hooks else None)


def detach(self: Tensor) -> Tensor:
    node = Node("detach", (self.node,), (), self.dtype, self.shape, self.node.site)
    return Tensor(node, self.backend)


def zero_grad(self: Tensor) -> None:
    self.grad = None


# --- autograd.grad --------------------------------------------------------------------------


def grad(outputs, *args, **kwargs):
    """PyTorch's ``autograd.grad(outputs, inputs, grad_outputs=None, retain_graph=None,
    create_graph=False, only_inputs=True, allow_unused=None, is_grads_batched=False,
    materialize_grads=False)`` when ``outputs`` is a tensor or a sequence of them: a tuple of
    gradients, no ``.grad`` written (flame/func.py, ``autograd_grad``). When it is a function,
    FLAME's functional ``grad(fn, argnums=0, allow_unused=False, has_aux=False)``."""
    from flame import func

    if callable(outputs) and not isinstance(outputs, Tensor):
        return func.functional_grad(outputs, *args, **kwargs)
    return func.autograd_grad(outputs, *args, **kwargs)


def _filled(like: Tensor, value) -> Tensor:
    """A constant of ``like``'s shape and dtype on ``like``'s backend (not the current one)."""
    from flame.backend import backend as use_backend
    from flame.creation import full

    with use_backend(like.backend):
        return full(like.shape, value, dtype=like.dtype)


Tensor.requires_grad_ = requires_grad_
Tensor.requires_grad = property(_requires_grad, lambda self, value: requires_grad_(self, value))
Tensor.backward = _tensor_backward
Tensor.register_hook = register_hook
Tensor.register_post_accumulate_grad_hook = register_post_accumulate_grad_hook
Tensor.detach = detach
Tensor.zero_grad = zero_grad
