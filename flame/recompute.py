"""``flame.checkpoint``: a region whose backward recomputes its values instead of keeping
them. The forward is ``fn(*args)`` behind an identity ``checkpoint`` node; its backward rule
(registered here) rebuilds the region over fresh stand-ins of the arguments behind a barrier,
which the fusion pass can compute inside the backward kernels, and differentiates it.

The rebuild runs under the autocast state of the forward (as PyTorch's checkpoint does: the
backward usually runs outside the region, and a recomputation in float32 would double the
memory it was meant to save). Each barrier also reads one element of the region's incoming
gradient (``barrier(x, after)``, the element unused): the recomputation then cannot be
scheduled before the backward reaches the region, so its values live from there to their
use, not from the forward on.
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

    def __init__(self, fn, args: tuple, arg_nodes: tuple, out: Node, generators: list,
                 autocast_state: tuple):  # fmt: skip
        self.fn, self.args, self.arg_nodes = fn, args, arg_nodes
        self.out, self.generators = out, generators
        self.autocast_state = autocast_state
        self._closed_over = None

    def __repr__(self) -> str:
        return f"recompute({getattr(self.fn, '__name__', 'fn')})"

    def rebuild(self, after: Tensor | None = None):
        """``(fresh stand-ins, fn's result over them)``; the stand-ins wait for ``after``
        (the region's incoming gradient) when it is given."""
        from flame import random
        from flame.amp import autocast_mode

        token = Token()
        fresh = [
            self._stand_in(a, token, after) if isinstance(a, Tensor) else a for a in self.args
        ]  # fmt: skip (numbers and other arguments pass through)
        before = random.rewind(self.generators)
        region, active = self.autocast_state
        tokens = (autocast_mode._region.set(region), autocast_mode._active.set(active))
        try:
            again = self.fn(*fresh)
        finally:
            autocast_mode._active.reset(tokens[1])
            autocast_mode._region.reset(tokens[0])
            random.rewind(before)
        return fresh, again

    @staticmethod
    def _stand_in(a: Tensor, token: Token, after: Tensor | None) -> Tensor:
        inputs = (a.node,)
        if after is not None:  # one element of the gradient, as a's type: an ordering edge
            first = after.detach().reshape(-1)[:1].to(a.dtype)
            inputs += (first.reshape((1,) * a.ndim).expand(a.shape).node,)
        else:
            inputs += (a.node,)
        node = Node("barrier", inputs, (("token", token),), a.dtype, a.shape, a.node.site)
        return Tensor(node, a.backend)

    def closed_over(self) -> tuple[Node, ...]:
        if self._closed_over is None:
            forward = {id(node) for node in toposort([self.out], stop=self._is_arg)}
            fresh, again = self.rebuild()
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
    from flame.amp import autocast_mode

    generators = random.snapshot()
    autocast_state = (autocast_mode._region.get(), autocast_mode._active.get())
    out = fn(*args)
    if not isinstance(out, Tensor):
        raise TypeError(f"checkpoint: fn must return one tensor, got {type(out).__name__}")
    tensors = tuple(a.node for a in args if isinstance(a, Tensor))
    recompute = Recompute(fn, tuple(args), tensors, out.node, generators, autocast_state)
    node = Node(
        "checkpoint", (out.node,), (("recompute", recompute),), out.dtype, out.shape, out.node.site
    )
    return Tensor(node, out.backend)


def _checkpoint_vjp(F, g, out, inner, recompute=None):
    closed_over = recompute.closed_over()
    fresh, again = recompute.rebuild(after=g)
    barriers = [t.node for t in fresh if isinstance(t, Tensor)]
    # the region is rebuilt with new barriers every time: nothing to record
    total = cotangents(
        [again], [g], barriers + list(closed_over), g.backend, templates=False
    )  # fmt: skip
    return (None, *[total.get(id(node)) for node in barriers + list(closed_over)])


def_vjp("checkpoint", _checkpoint_vjp)
