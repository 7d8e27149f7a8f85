"""``nn.Parameter``, ``nn.Buffer`` and ``Tensor.data``.

A parameter is a tensor a module owns and an optimizer updates: it has memory (it is
realized when it is made) and it requires a gradient unless told otherwise. Like PyTorch's,
``Parameter(t)`` shares ``t``'s memory; the gradient flag belongs to the parameter alone.

``t.data`` is the same memory without autograd history (an in-place write to it writes the
tensor, as in PyTorch), and ``t.data = other`` points the tensor at ``other``'s memory,
keeping its identity, its gradient flag and its hooks (what ``Module.to(dtype)`` does).
"""

from __future__ import annotations

from flame.ir.node import Node
from flame.tensor import Tensor


def _own_node(tensor: Tensor) -> Node:
    """A fresh node over ``tensor``'s memory (realizing it first): the new tensor's gradient
    flag and hooks hang off this node, never off the one ``tensor`` shares with others."""
    from flame.compile import check_not_tracing
    from flame.inplace import _is_whole, memory_of

    check_not_tracing("making a parameter of a value")
    tensor.realize()
    found = memory_of(tensor.node)
    if found is None or not _is_whole(found[1], found[0]):  # a view of part of a memory
        from flame.shaping import clone

        tensor = clone(tensor).realize()
        found = memory_of(tensor.node)
    site = tensor.node.site
    return Node("buffer", (), (("storage", found[0]),), tensor.dtype, tensor.shape, site)


class Parameter(Tensor):
    """``nn.Parameter(data=None, requires_grad=True)``."""

    __slots__ = ()

    def __new__(cls, data: Tensor | None = None, requires_grad: bool = True):
        if data is None:
            from flame.creation import empty

            data = empty(0)
        if not isinstance(data, Tensor):
            raise TypeError(f"Parameter: data must be a flame tensor, got {type(data).__name__}")
        self = object.__new__(cls)
        Tensor.__init__(self, _own_node(data), data.backend)
        if requires_grad:
            self.requires_grad_(True)
        return self

    def __init__(self, data=None, requires_grad: bool = True):
        pass  # everything happened in __new__

    def __repr__(self) -> str:
        return "Parameter containing:\n" + Tensor.__repr__(self)

    __str__ = __repr__

    def __reduce_ex__(self, protocol):
        raise TypeError("Parameter: use state_dict() and flame.save_file to keep weights")

    def __deepcopy__(self, memo):
        """A parameter with memory of its own holding the same values (``copy.deepcopy(model)``,
        the usual way to start an EMA copy); gradients are not copied."""
        copied = memo.get(id(self))
        if copied is None:
            copied = memo[id(self)] = Parameter(_copy_values(self), self.requires_grad)
        return copied


class Buffer(Tensor):
    """``nn.Buffer(data, persistent=True)``: assigned to a module attribute, it registers
    ``data`` as a buffer (PyTorch 2.5's spelling of ``register_buffer``)."""

    __slots__ = ("persistent",)

    def __new__(cls, data: Tensor, *, persistent: bool = True):
        if not isinstance(data, Tensor):
            raise TypeError(f"Buffer: data must be a flame tensor, got {type(data).__name__}")
        self = object.__new__(cls)
        Tensor.__init__(self, data.node, data.backend)
        self.persistent = persistent
        return self

    def __init__(self, data=None, *, persistent: bool = True):
        pass


def alias(tensor: Tensor) -> Tensor:
    """``tensor``'s memory without autograd history: new nodes over the same storage (the
    views ``tensor`` reads it through rebuilt, ``detach`` markers dropped), so that the alias
    and the tensor keep sharing memory after either is computed (a ``detach`` node of a
    computed value gets memory of its own). A lazy tensor (no memory yet): its detach."""
    from flame.autograd import detach
    from flame.inplace import _storage_of, memory_of

    if memory_of(tensor.node) is None:
        return detach(tensor)
    node = tensor.node
    chain = []
    while _storage_of(node) is None:
        if node.op != "detach":
            chain.append(node)
        node = node.inputs[0]
    storage = _storage_of(node)
    rebuilt = Node("buffer", (), (("storage", storage),), node.dtype, node.shape, node.site)
    for view in reversed(chain):
        rebuilt = Node(view.op, (rebuilt,), view.attrs, view.dtype, view.shape, view.site)
    return Tensor(rebuilt, tensor.backend)


def _copy_values(tensor: Tensor) -> Tensor:
    from flame.autograd import no_grad
    from flame.shaping import clone

    with no_grad():
        copied = clone(alias(tensor))
    return copied.realize() if tensor.is_realized else copied


def _deepcopy(self: Tensor, memo) -> Tensor:
    if not self.is_leaf:
        raise RuntimeError(
            "Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
            "protocol at the moment; detach() it first"
        )
    copied = memo.get(id(self))
    if copied is None:
        copied = memo[id(self)] = _copy_values(self)
        if self.requires_grad:
            copied.requires_grad_()
    return copied


def _get_data(self: Tensor) -> Tensor:
    return alias(self)


def _set_data(self: Tensor, value: Tensor) -> None:
    if not isinstance(value, Tensor):
        raise TypeError(f"data: expected a flame tensor, got {type(value).__name__}")
    node = _own_node(value)
    node.grad_info = self.node.grad_info
    self.node = node
    self.backend = value.backend


Tensor.data = property(_get_data, _set_data)
Tensor.__deepcopy__ = _deepcopy


def _is_leaf(self: Tensor) -> bool:
    """PyTorch's rule: a tensor that does not require grad, or one that asked for it itself
    (``requires_grad_``); not a value computed from one (computed or not)."""
    info = self.node.grad_info
    if info is not None and info.owner is not None and info.owner() is not None:
        return True
    return not self.requires_grad


Tensor.is_leaf = property(_is_leaf)
