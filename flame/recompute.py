"""``flame.checkpoint``: a region whose backward recomputes its values instead of keeping
them. The forward is ``fn(*args)`` behind an identity ``checkpoint`` node; its backward rule
(registered here) rebuilds the region over fresh stand-ins of the arguments behind a barrier,
which the fusion pass can compute inside the backward kernels, and differentiates it.
"""

from __future__ import annotations

from flame.autograd import cotangents
from flame.ir.node import Node, Token, toposort
from flame.ir.ops.registry import def_vjp
from flame.tensor import Tensor


class Recompute:
    """How a checkpoint rebuilds its region for the backward: ``fn`` over fresh stand-ins
    of its arguments, with the generators rewound to where the forward drew (dropout draws
    the same mask again). ``closed_over``: the values ``fn`` read without taking them as
    arguments (weights), found by rebuilding once: the nodes both builds share."""

    def __init__(self, fn, args: tuple, arg_nodes: tuple, out: Node, generators: list):
        self.fn, self.args, self.arg_nodes = fn, args, arg_nodes
        self.out, self.generators = out, generators
        self._closed_over = None
        self._pending = None  # a rebuild made for the frontier, used by the next backward

    def __repr__(self) -> str:
        return f"recompute({getattr(self.fn, '__name__', 'fn')})"

    def rebuild(self):
        """``(fresh stand-ins, fn's result over them)``."""
        from flame import random

        token = Token()
        fresh = [
            Tensor(
                Node("barrier", (a.node,), (("token", token),), a.dtype, a.shape, a.node.site),
                a.backend,
            )
            if isinstance(a, Tensor)
            else a  # numbers and other arguments pass through
            for a in self.args
        ]  # fmt: skip
        before = random.rewind(self.generators)
        try:
            again = self.fn(*fresh)
        finally:
            random.rewind(before)
        return fresh, again

    def take(self):
        pending, self._pending = self._pending, None
        return pending if pending is not None else self.rebuild()

    def closed_over(self) -> tuple[Node, ...]:
        if self._closed_over is None:
            forward = {id(node) for node in toposort([self.out], stop=self._is_arg)}
            fresh, again = self._pending = self.rebuild()
            barriers = {id(t.node) for t in fresh if isinstance(t, Tensor)}
            shared = {}
            stack = [again.node]
            seen = set()
            while stack:
                node = stack.pop()
                if id(node) in seen or id(node) in barriers:
                    continue
                seen.add(id(node))
                if id(node) in forward:  # built before the call: a value fn closed over
                    if node.op not in ("const",) and node.dtype.is_float:
                        shared[id(node)] = node
                    continue
                stack.extend(node.inputs)
            self._closed_over = tuple(shared.values())
        return self._closed_over

    def _is_arg(self, node: Node) -> bool:
        return any(node is arg for arg in self.arg_nodes)


def checkpoint(fn, *args, use_reentrant=None, preserve_rng_state=True, **kwargs):
    """``fn(*args)``, whose backward recomputes ``fn``'s intermediate values from ``args``
    instead of keeping them: the recomputation is a fresh copy of the region behind a
    barrier, which the fusion pass can compute inside the backward kernels. Gradients flow
    to the arguments and to every tensor ``fn`` closes over (a block's weights); random
    draws inside ``fn`` draw the same numbers again. ``use_reentrant`` is accepted (both
    values behave as PyTorch's non-reentrant checkpoint); ``preserve_rng_state=False`` is
    refused (the recomputation would see other random numbers)."""
    if kwargs:
        raise TypeError(
            f"checkpoint: unexpected keyword arguments {sorted(kwargs)}; pass fn's own "
            "arguments by position"
        )
    if not preserve_rng_state:
        raise ValueError("checkpoint: preserve_rng_state=False is not supported")
    from flame import random

    generators = random.snapshot()
    out = fn(*args)
    if not isinstance(out, Tensor):
        raise TypeError(f"checkpoint: fn must return one tensor, got {type(out).__name__}")
    tensors = tuple(a.node for a in args if isinstance(a, Tensor))
    recompute = Recompute(fn, tuple(args), tensors, out.node, generators)
    node = Node(
        "checkpoint", (out.node,), (("recompute", recompute),), out.dtype, out.shape, out.node.site
    )
    return Tensor(node, out.backend)


def _checkpoint_vjp(F, g, out, inner, recompute=None):
    closed_over = recompute.closed_over()
    fresh, again = recompute.take()
    barriers = [t.node for t in fresh if isinstance(t, Tensor)]
    # the region is rebuilt with new barriers every time: nothing to record
    total = cotangents(
        [again], [g], barriers + list(closed_over), g.backend, templates=False
    )  # fmt: skip
    return (None, *[total.get(id(node)) for node in barriers + list(closed_over)])


def_vjp("checkpoint", _checkpoint_vjp)
