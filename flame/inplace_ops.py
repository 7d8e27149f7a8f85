"""The in-place methods of ``Tensor``: the ``op_`` forms, the augmented operators and
``__setitem__``. Each computes its new value with ordinary ops and hands it to
``flame.inplace.write`` (the memory, the checks, the refusals live there)."""

from __future__ import annotations

import numpy as np

from flame.backend import backend as use_backend
from flame.backend import get_backend
from flame.inplace import (
    _VIEW_OPS,
    InplaceError,
    _check,
    _is_whole,
    _mark_overwritten,
    _memory_for_writing,
    _view_again,
    memory_of,
    write,
    write_memory,
)
from flame.ir import dtypes
from flame.ir.node import Node, builder_site, format_site, user_site
from flame.ir.shapes import ShapeError
from flame.tensor import Tensor, grad_enabled

# --- the ops -------------------------------------------------------------------------------------


def _inplace(op: str, compute):
    """``Tensor.<op>(*args)``: ``compute(self, *args)`` written into ``self``."""

    def method(self: Tensor, *args, **kwargs) -> Tensor:
        if get_backend() == self.backend:  # the usual case: no context to enter
            value = compute(self, *args, **kwargs)
        else:
            with use_backend(self.backend):  # values made from scalars live with the tensor
                value = compute(self, *args, **kwargs)
        if not isinstance(value, Tensor):
            value = _filled(self, value)
        value = _check(self, value, op)
        held = [self.node] + [a.node for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
        if not _fresh(value.node) or any(value.node is node for node in held):
            # a node a tensor already holds (``x.copy_(y)`` with a lazy y): the write takes
            # a node of its own, so y never comes to stand for this tensor's memory
            value = _identity(value)
        return write(self, value, op)

    method.__name__ = method.__qualname__ = op
    method.__doc__ = f"In-place ``{op[:-1]}``: writes into this tensor (PyTorch's ``{op}``)."
    return method


def _filled(self: Tensor, value) -> Tensor:
    """A scalar result as a tensor shaped and typed like ``self``, on its backend."""
    from flame.creation import full

    with use_backend(self.backend):
        return full(self.shape, value, dtype=self.dtype)


def _fresh(node: Node) -> bool:
    """Whether ``node`` was built by this write (not a value some tensor already holds)."""
    return node.buffer is None and node.op != "buffer" and node.op not in _VIEW_OPS


def _identity(value: Tensor) -> Tensor:
    """A new node holding ``value`` (so the write never aliases another tensor's node)."""
    node = value.node
    copy = Node("cast", (node,), (("dtype", node.dtype),), node.dtype, node.shape, builder_site())
    return Tensor(copy, value.backend)


def _scaled(other, alpha):
    return other if alpha == 1 else other * alpha


def _copy_value(self, source, non_blocking=False):
    if not isinstance(source, Tensor):
        from flame.backend import backend as use_backend
        from flame.creation import tensor

        with use_backend(self.backend):
            source = tensor(np.asarray(source), dtype=self.dtype)
    return source


def _fill_value(self, value):
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.ndim > 0:
            raise ShapeError(
                f"fill_: only supports 0-dimension value tensor but got tensor with "
                f"{value.ndim} dimensions [at {format_site(user_site())}]"
            )
        return value
    return value


def _uniform(self, from_=0.0, to=1.0, *, generator=None):
    from flame.creation import rand

    return rand(self.shape, generator=generator, dtype=self.dtype) * (to - from_) + from_


def _normal(self, mean=0.0, std=1.0, *, generator=None):
    from flame.creation import randn

    return randn(self.shape, generator=generator, dtype=self.dtype) * std + mean


def _bernoulli(self, p=0.5, *, generator=None):
    from flame.creation import rand

    return (rand(self.shape, generator=generator) < p).to(self.dtype)


def _div(self, other, *, rounding_mode=None):
    if rounding_mode is None:
        return self / other
    if rounding_mode == "floor":
        return self // other
    if rounding_mode == "trunc":
        quotient = self / other
        truncated = quotient.sign() * quotient.abs().floor()
        return truncated if self.dtype.is_float else truncated.to(self.dtype)
    raise ValueError(f"div_: rounding_mode must be None, 'trunc' or 'floor', got {rounding_mode!r}")


def _lerp(self, end, weight):
    return self + weight * (end - self)


def _addcmul(self, tensor1, tensor2, *, value=1):
    return self + _scaled(tensor1 * tensor2, value)


def _addcdiv(self, tensor1, tensor2, *, value=1):
    return self + _scaled(tensor1 / tensor2, value)


def _masked_fill(self, mask, value):
    from flame.indexing import masked_fill

    return masked_fill(self, mask, value)


def _index_add(self, dim, index, source, *, alpha=1):
    from flame.indexing import index_add

    return index_add(self, dim, index, source, alpha=alpha)


def _clamp(self, min=None, max=None):  # noqa: A002 (PyTorch's names)
    from flame.functional import clamp

    return clamp(self, min, max)


_OPS = {
    "add_": lambda self, other, *, alpha=1: self + _scaled(other, alpha),
    "sub_": lambda self, other, *, alpha=1: self - _scaled(other, alpha),
    "mul_": lambda self, other: self * other,
    "div_": _div,
    "floor_divide_": lambda self, other: self // other,
    "remainder_": lambda self, other: self % other,
    "pow_": lambda self, other: self**other,
    "lerp_": _lerp,
    "addcmul_": _addcmul,
    "addcdiv_": _addcdiv,
    "clamp_": _clamp,
    "clip_": _clamp,
    "zero_": lambda self: 0,
    "fill_": _fill_value,
    "copy_": _copy_value,
    "masked_fill_": _masked_fill,
    "index_add_": _index_add,
    "uniform_": _uniform,
    "normal_": _normal,
    "bernoulli_": _bernoulli,
    "neg_": lambda self: -self,
    "abs_": lambda self: abs(self),
    "exp_": lambda self: self.exp(),
    "log_": lambda self: self.log(),
    "sqrt_": lambda self: self.sqrt(),
    "rsqrt_": lambda self: self.rsqrt(),
    "square_": lambda self: self * self,
    "sigmoid_": lambda self: self.sigmoid(),
    "tanh_": lambda self: self.tanh(),
    "relu_": lambda self: self.relu(),
    "reciprocal_": lambda self: self.reciprocal(),
    "floor_": lambda self: self.floor(),
    "ceil_": lambda self: self.ceil(),
    "round_": lambda self: self.round(),
    "sign_": lambda self: self.sign(),
    "bitwise_and_": lambda self, other: self & other,
    "bitwise_or_": lambda self, other: self | other,
    "bitwise_xor_": lambda self, other: self ^ other,
}

for _name, _compute in _OPS.items():
    setattr(Tensor, _name, _inplace(_name, _compute))

# the augmented operators write in place, as PyTorch's
_AUGMENTED = {
    "__iadd__": "add_", "__isub__": "sub_", "__imul__": "mul_", "__itruediv__": "div_",
    "__ifloordiv__": "floor_divide_", "__imod__": "remainder_", "__ipow__": "pow_",
    "__iand__": "bitwise_and_", "__ior__": "bitwise_or_", "__ixor__": "bitwise_xor_",
}  # fmt: skip
for _dunder, _name in _AUGMENTED.items():
    setattr(Tensor, _dunder, getattr(Tensor, _name))


# --- __setitem__ -----------------------------------------------------------------------------


def setitem(self: Tensor, index, value) -> None:
    """``self[index] = value``: basic indexing writes through the view; a bool mask writes
    where it is true; an integer index tensor writes the rows it names."""
    from flame.views import getitem

    if isinstance(index, Tensor) and index.dtype.is_bool:
        if index.shape != self.shape[: index.ndim]:
            raise IndexError(
                f"setitem: the mask of shape {list(index.shape)} does not match the indexed "
                f"tensor's leading shape {list(self.shape[: index.ndim])}"
            )
        mask = index.reshape(index.shape + (1,) * (self.ndim - index.ndim))
        if isinstance(value, Tensor) and value.numel() != 1:
            raise IndexError("setitem: a bool mask takes a number or a one-element value")
        from flame.functional import where

        fill = value if not isinstance(value, Tensor) else value.reshape(()).to(self.dtype)
        Tensor.copy_(self, where(mask.broadcast_to(self.shape), fill, self))
        return
    from flame.compile import current_trace

    items = index if isinstance(index, tuple) else (index,)
    advanced = [_is_array_index(item) for item in items]
    if (
        current_trace() is not None
        or _needs_history(self, value)
        or sum(advanced) > 1
        or (any(advanced) and len(items) > 1)
    ):
        # the whole new value, one scatter: differentiable, and a write the trace can keep
        Tensor.copy_(self, _assigned(self, index, value))
        return
    if any(advanced):
        _setitem_rows(self, index, value)
        return
    if memory_of(self.node) is None:
        self.realize()  # it gets the memory PyTorch's tensor would have had
    view = getitem(self, index)
    found = _memory_for_writing(view.node)
    if found is None:
        raise InplaceError(
            f"setitem: the index does not select a view of the tensor's memory "
            f"[at {format_site(user_site())}]"
        )
    if not isinstance(value, Tensor):
        from flame.creation import full

        value = full(view.shape, value, dtype=self.dtype)
    value = _check(view, value, "setitem")
    storage, region = found
    if region.shape != view.shape:
        raise IndexError("setitem: the index does not select a view of the tensor's memory")
    old = self.node
    write_memory(storage, region, value)
    own = memory_of(old)
    if own is not None and _is_whole(own[1], own[0]):
        node = Node("buffer", (), (("storage", storage),), storage.dtype, old.shape, old.site)
    else:
        node = _view_again(old, storage)
    node.grad_info = old.grad_info
    self.node = node
    _mark_overwritten(old, "setitem")


def _is_array_index(item) -> bool:
    return isinstance(item, (Tensor, list)) or hasattr(item, "__array_interface__")


def _needs_history(self: Tensor, value) -> bool:
    """Whether the assignment must stay in the autograd graph (PyTorch's setitem keeps it)."""
    if not grad_enabled.get():
        return False
    from flame.autograd import _requires_grad

    return _requires_grad(self) or (isinstance(value, Tensor) and _requires_grad(value))


def _assigned(self: Tensor, index, value) -> Tensor:
    """``self`` with ``value`` at ``self[index]``, as one scatter into the flattened tensor at
    the positions ``index`` selects (an index-generated arange indexed alike: no copy, no
    sync for basic indices). A repeated position takes the sum of its values (as
    ``flame.scatter``)."""
    from flame.backend import backend as use_backend
    from flame.creation import arange, full
    from flame.indexing import scatter
    from flame.views import getitem

    with use_backend(self.backend):
        count = self.numel()
        positions = getitem(arange(count, dtype=dtypes.int64).reshape(self.shape), index)
        if not isinstance(value, Tensor):
            value = full(positions.shape, value, dtype=self.dtype)
        value = value.to(self.dtype)
        if value.shape != positions.shape:
            value = value.broadcast_to(positions.shape)
        flat = positions.reshape(-1)
        placed = scatter(self.reshape(count), 0, flat, value.reshape(flat.shape[0]))
        return placed.reshape(self.shape)


def _setitem_rows(self: Tensor, index, value) -> None:
    """``self[rows] = value`` for an integer index along the first axis (the rows are read
    on the host to check their range, as PyTorch's index checks sync)."""
    from flame.backend import backend as use_backend
    from flame.creation import tensor
    from flame.functional import where

    with use_backend(self.backend):
        if not isinstance(index, Tensor):
            index = tensor(np.asarray(index))
        if index.dtype.is_float or index.dtype.is_bool or index.ndim != 1:
            raise IndexError("setitem: an index tensor must be a 1-d integer tensor")
        size = self.shape[0]
        rows = index.numpy().astype(np.int64)
        if rows.size and (rows.min() < -size or rows.max() >= size):
            raise IndexError(
                f"setitem: index out of range for dimension 0 with size {size} "
                f"[at {format_site(user_site())}]"
            )
        rows = np.where(rows < 0, rows + size, rows)
        source = np.full(size, -1, dtype=np.int64)  # per row, the last index naming it
        source[rows] = np.arange(rows.size)
        if not isinstance(value, Tensor):
            value = tensor(np.asarray(value, dtype=self.dtype.numpy))
        shape = (rows.size,) + self.shape[1:]
        values = value.to(self.dtype)
        values = values.broadcast_to(shape) if values.shape != shape else values
        gathered = values[tensor(np.maximum(source, 0))] if rows.size else self
        chosen = tensor(source >= 0).reshape((size,) + (1,) * (self.ndim - 1))
        Tensor.copy_(self, where(chosen.broadcast_to(self.shape), gathered, self))


Tensor.__setitem__ = setitem
