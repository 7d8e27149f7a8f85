"""In-place ops with PyTorch's rules: ``add_ sub_ mul_ div_ lerp_ clamp_ zero_ fill_ copy_
normal_ uniform_ masked_fill_ addcmul_ addcdiv_ ...``, the augmented operators (``e += p``)
and ``__setitem__`` (``x[:, 0] = v``, ``x[mask] = v``).

What a write does depends on what the tensor is:

* a tensor with memory (realized, or a view of realized memory): the new value is computed
  and written into that memory at once, by the kernel that computes it where it reads the
  memory only element for element (``Executor.realize_into``; an EMA step is one kernel that
  reads ``e`` and ``p`` and writes ``e``); a view writes into its base. Everything that reads
  the memory later sees the new values: other views, compiled functions closing over it,
  DLPack consumers (the write is queued on FLAME's stream after the work already there);
* a lazy value with no memory yet (``h = x * 2; h += 1``): the tensor now stands for the new
  value; nothing runs;
* inside ``flame.compile``: the write is part of the program (flame/compile.py).

Autograd refuses what PyTorch refuses: an in-place write to a leaf that requires grad (or a
view of one) outside ``no_grad``, and a backward that needs a value overwritten after it was
used (flame/autograd.py reports both lines).
"""

from __future__ import annotations

import numpy as np

from flame.ir import dtypes
from flame.ir.node import Node, format_site, user_site
from flame.ir.shapes import ShapeError, broadcast_shapes
from flame.ir.views import MOVEMENT_OPS, View, apply_movement
from flame.tensor import Tensor, grad_enabled

_VIEW_OPS = (*MOVEMENT_OPS, "detach")


class InplaceError(RuntimeError):
    """An in-place write PyTorch would refuse; the message says why and where."""


# --- where a tensor's memory is ------------------------------------------------------------------


def _storage_of(node: Node):
    if node.buffer is not None:
        return node.buffer
    if node.op == "buffer":
        return node.attr("storage")
    return None


def memory_of(node: Node):
    """``(storage, view)`` of the memory ``node`` reads as a view, or None for a lazy value
    that has no memory yet (or a view that is not one, e.g. a reshape that must copy)."""
    chain = []
    while _storage_of(node) is None and node.op in _VIEW_OPS:
        chain.append(node)
        node = node.inputs[0]
    storage = _storage_of(node)
    if storage is None:
        return None
    view = View(tuple(node.shape), tuple(storage.strides()), 0)
    for movement in reversed(chain):
        if movement.op == "detach":
            continue
        view = apply_movement(movement, view)
        if view is None:
            return None
    return storage, view


# --- the checks ------------------------------------------------------------------------------


def _requires_grad_leaf(node: Node) -> bool:
    """Whether the memory's owner is a leaf that requires grad (looking through views)."""
    while True:
        info = node.grad_info
        if info is not None and info.owner is not None and info.owner() is not None:
            return True
        if node.op not in MOVEMENT_OPS or node.buffer is not None:
            return False
        node = node.inputs[0]


def _check(target: Tensor, value: Tensor, op: str) -> Tensor:
    """``value`` broadcast and cast to ``target``; raises what PyTorch raises."""
    site = user_site()
    if grad_enabled.get() and _requires_grad_leaf(target.node):
        raise InplaceError(
            f"{op}: a leaf tensor that requires grad (or a view of one) is used in an in-place "
            f"operation; wrap it in flame.no_grad() [at {format_site(site)}]"
        )
    try:
        shape = broadcast_shapes(op, value.shape, target.shape)
    except ShapeError:
        shape = None
    if shape != target.shape:
        raise ShapeError(
            f"{op}: cannot broadcast a source of shape {list(value.shape)} to this tensor's "
            f"shape {list(target.shape)} (an in-place result keeps the tensor's shape) "
            f"[at {format_site(site)}]"
        )
    if value.dtype is not target.dtype and not _can_cast(value.dtype, target.dtype):
        raise InplaceError(
            f"{op}: result type {value.dtype.name} can't be cast to the desired output type "
            f"{target.dtype.name} [at {format_site(site)}]"
        )
    if value.backend != target.backend:
        raise ValueError(
            f"{op}: the value is on the {value.backend} backend, the tensor on {target.backend}"
        )
    if value.dtype is not target.dtype:
        value = value.to(target.dtype)
    if value.shape != target.shape:
        value = value.broadcast_to(target.shape)
    return value


def _can_cast(source: dtypes.DType, target: dtypes.DType) -> bool:
    """PyTorch's rule for in-place results: never to a lower category (float -> int,
    int -> bool)."""
    return source.category <= target.category


# --- the write ---------------------------------------------------------------------------------


def write(target: Tensor, value: Tensor, op: str) -> Tensor:
    """Make ``target`` hold ``value`` (checked by ``_check``, and a node built for this write:
    it becomes the target's node)."""
    from flame.compile import current_trace

    trace = current_trace()
    if trace is not None:
        return _write_traced(trace, target, value, op)
    old = target.node
    found = _memory_for_writing(old)
    if found is None:  # a lazy value: the tensor now stands for the new value
        target.node = value.node
        return target
    storage, view = found
    if any(stride == 0 and size > 1 for size, stride in zip(view.shape, view.strides)):
        raise InplaceError(
            f"{op}: more than one element of the written-to tensor refers to a single memory "
            f"location (a broadcast view) [at {format_site(user_site())}]"
        )
    write_memory(storage, view, value)
    if _is_whole(view, storage) and _needs_history(value):
        # the value's node, now holding the memory, keeps its history for autograd
        node = value.node
        node.buffer = storage
    else:  # a new node over the memory: no chain of old values grows across a loop
        node = _view_again(old, storage)
    if old.grad_info is not None:
        node.grad_info = old.grad_info
    target.node = node
    _mark_overwritten(old, op)
    return target


def _needs_history(value: Tensor) -> bool:
    if not grad_enabled.get():
        return False
    from flame.autograd import _requires_grad

    return _requires_grad(value)


def _is_whole(view: View, storage) -> bool:
    return (
        view.offset == 0
        and view.shape == _base_shape(storage)
        and tuple(view.strides) == tuple(storage.strides())
    )


def _base_shape(storage) -> tuple[int, ...]:
    array = storage.array if storage.array is not None else storage.host
    return tuple(array.shape)


def _view_again(node: Node, storage) -> Node:
    """The view chain of ``node`` rebuilt over a new node of its memory (the old base may be
    read by values built before the write; they are told apart by node)."""
    if _storage_of(node) is not None:
        return Node("buffer", (), (("storage", storage),), node.dtype, node.shape, node.site)
    below = _view_again(node.inputs[0], storage)
    return Node(node.op, (below,), node.attrs, node.dtype, node.shape, node.site)


def _memory_for_writing(node: Node):
    """``memory_of``, with a reference storage first made the tensor's own, writable and
    contiguous (flame.foreach.writable_array; NumPy memory may be shared or read-only)."""
    found = memory_of(node)
    if found is None or found[0].backend != "reference":
        return found
    from flame.foreach import writable_array

    storage = found[0]
    before = storage.array
    array = writable_array(storage)
    if not array.flags.c_contiguous:
        storage.array = array = np.ascontiguousarray(array)
    if array is not before:
        storage._layout = None  # its strides changed: the view is computed again
        found = memory_of(node)
    return found


def _write_traced(trace, target: Tensor, value: Tensor, op: str) -> Tensor:
    """Inside ``flame.compile``: the write becomes part of the program (its value written
    into the memory at every call); later ops of the trace read the new value."""
    storage = trace.storage_written(target)  # written before in this trace
    if storage is None:
        found = memory_of(target.node)
        if found is None:  # a lazy value of the trace: it now stands for the new value
            target.node = value.node
            return target
        storage, view = found
        if not _is_whole(view, storage):
            from flame.compile import TraceError

            raise TraceError(
                f"{op}: writing through a view of memory inside a function being compiled is "
                f"not supported yet; write the whole tensor [at {format_site(user_site())}]"
            )
    trace.note_write(target, storage, value.node)
    target.node = value.node
    return target


def write_memory(storage, view: View, value: Tensor) -> None:
    """Compute ``value`` into ``storage``'s memory seen through ``view``."""
    if storage.backend == "reference":  # made contiguous by _memory_for_writing
        array = storage.array
        result = np.asarray(value.numpy(), dtype=array.dtype)
        window = np.lib.stride_tricks.as_strided(
            array.reshape(-1)[view.offset :], view.shape,
            tuple(stride * array.itemsize for stride in view.strides),
        )  # fmt: skip
        window[...] = result
        return
    from flame.runtime.executor import default_executor
    from flame.runtime.library import strided_array

    array = storage.device_array()
    whole = view.offset == 0 and view.shape == tuple(array.shape) and array.flags.c_contiguous
    if whole and view.is_contiguous and default_executor().realize_into(value.node, array):
        return
    value.realize()
    source = _storage_of(value.node).device_array().reshape(view.shape)
    strided_array(array, view.shape, view.strides, view.offset)[...] = source


def _mark_overwritten(node: Node, op: str) -> None:
    from flame.ir import overwritten

    overwritten.note(node, op, user_site())


# --- the ops -------------------------------------------------------------------------------------


def _inplace(op: str, compute):
    """``Tensor.<op>(*args)``: ``compute(self, *args)`` written into ``self``."""

    def method(self: Tensor, *args, **kwargs) -> Tensor:
        value = compute(self, *args, **kwargs)
        if not isinstance(value, Tensor):
            from flame.creation import full

            value = full(self.shape, value, dtype=self.dtype)
        value = _check(self, value, op)
        if value.node is self.node or not _fresh(value.node):
            value = _identity(value)
        return write(self, value, op)

    method.__name__ = method.__qualname__ = op
    method.__doc__ = f"In-place ``{op[:-1]}``: writes into this tensor (PyTorch's ``{op}``)."
    return method


def _fresh(node: Node) -> bool:
    """Whether ``node`` was built by this write (not a value some tensor already holds)."""
    return node.buffer is None and node.op != "buffer" and node.op not in _VIEW_OPS


def _identity(value: Tensor) -> Tensor:
    """A new node holding ``value`` (so the write never aliases another tensor's node)."""
    node = value.node
    copy = Node("cast", (node,), (("dtype", node.dtype),), node.dtype, node.shape, user_site())
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


def _clamp(self, min=None, max=None):  # noqa: A002 (PyTorch's names)
    from flame.tensor import clamp

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
    "uniform_": _uniform,
    "normal_": _normal,
    "bernoulli_": _bernoulli,
    "neg_": lambda self: -self,
    "abs_": lambda self: abs(self),
    "exp_": lambda self: self.exp(),
    "log_": lambda self: self.log(),
    "sqrt_": lambda self: self.sqrt(),
    "rsqrt_": lambda self: self.rsqrt(),
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
    if isinstance(index, (Tensor, list)) or hasattr(index, "__array_interface__"):
        _setitem_rows(self, index, value)
        return
    if memory_of(self.node) is None:
        from flame.compile import current_trace

        if current_trace() is not None:
            raise InplaceError(
                f"setitem: assigning into a value computed inside a function being compiled "
                f"is not supported yet; build it with flame.where [at {format_site(user_site())}]"
            )
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
