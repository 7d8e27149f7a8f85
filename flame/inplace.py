"""In-place writes with PyTorch's rules: the mechanism behind ``add_ sub_ mul_ div_ lerp_
clamp_ zero_ fill_ copy_ normal_ uniform_ masked_fill_ addcmul_ addcdiv_ ...``, the augmented
operators (``e += p``) and ``__setitem__`` (``x[:, 0] = v``, ``x[mask] = v``), whose methods
are in flame/inplace_ops.py.

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

from flame.compile_trace import current_trace
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
    strides = tuple(storage.strides())
    if len(strides) != len(node.shape):  # a value kept in another shape (0-d as [1]): same
        strides = _contiguous(node.shape)  # elements, C order
    view = View(tuple(node.shape), strides, 0)
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
    if value.shape == target.shape and value.dtype is target.dtype:  # the usual case
        if grad_enabled.get() and _requires_grad_leaf(target.node):
            _refuse_leaf(op)
        if value.backend != target.backend:
            raise ValueError(
                f"{op}: the value is on the {value.backend} backend, the tensor on {target.backend}"
            )
        return value
    site = user_site()
    if grad_enabled.get() and _requires_grad_leaf(target.node):
        _refuse_leaf(op)
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


def _refuse_leaf(op: str):
    raise InplaceError(
        f"{op}: a leaf tensor that requires grad (or a view of one) is used in an in-place "
        f"operation; wrap it in flame.no_grad() [at {format_site(user_site())}]"
    )


def _can_cast(source: dtypes.DType, target: dtypes.DType) -> bool:
    """PyTorch's rule for in-place results: never to a lower category (float -> int,
    int -> bool)."""
    return source.category <= target.category


# --- the write ---------------------------------------------------------------------------------


def write(target: Tensor, value: Tensor, op: str) -> Tensor:
    """Make ``target`` hold ``value`` (checked by ``_check``, and a node built for this write:
    it becomes the target's node)."""
    trace = current_trace()
    if trace is not None:
        return _write_traced(trace, target, value, op)
    old = original = target.node
    found = _memory_for_writing(old)
    if found is None and old.op in _VIEW_OPS:
        # a view of a lazy value (y = x.clone(); y[0].mul_(10)): the value gets its memory
        # (the node its tensor holds), so the write reaches it through the view
        base = old
        while base.op in _VIEW_OPS and _storage_of(base) is None:
            base = base.inputs[0]
        from flame.backend import realize_nodes

        if base.op == "const":
            # ``fl.zeros(4, 5)``/``fl.empty``/``fl.full`` are a broadcast constant until
            # realized: like PyTorch's, they are tensors of their own, so they get memory
            from flame.shaping import clone

            base = clone(Tensor(old, target.backend)).node
            old = base
        realize_nodes(target.backend, [base])
        found = _memory_for_writing(old)
    if found is None:  # a lazy value: the tensor now stands for the new value
        target.node = _keeping_leaf(original, value)
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
    if original.grad_info is not None:
        node.grad_info = original.grad_info
    target.node = node
    _mark_overwritten(old, op)
    return target


def _needs_history(value: Tensor) -> bool:
    if not grad_enabled.get():
        return False
    from flame.autograd import _requires_grad

    return _requires_grad(value)


def _is_whole(view: View, storage) -> bool:
    base = _base_shape(storage)
    if view.shape != base and len(view.shape) != len(base):  # 0-d kept as [1], say
        return (
            view.offset == 0
            and int(np.prod(view.shape)) == int(np.prod(base))
            and tuple(view.strides) == _contiguous(view.shape)
            and tuple(storage.strides()) == _contiguous(base)
        )
    return (
        view.offset == 0 and view.shape == base and tuple(view.strides) == tuple(storage.strides())
    )


def _contiguous(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


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
            target.node = _keeping_leaf(target.node, value)
            return target
        storage, view = found
        if not _is_whole(view, storage):
            from flame.compile import TraceError

            raise TraceError(
                f"{op}: writing through a view of memory inside a function being compiled is "
                f"not supported yet; write the whole tensor [at {format_site(user_site())}]"
            )
    trace.note_write(target, storage, value.node)
    target.node = _keeping_leaf(target.node, value)  # a parameter written stays a leaf
    return target


def _keeping_leaf(original: Node, value: Tensor) -> Node:
    """The node a written tensor stands for: ``value``'s, or where the tensor was a leaf
    that requires grad, a node of its own (``value``'s may be shared) that keeps the leaf's
    flag and hooks, as the write to memory keeps them."""
    if original.grad_info is None:
        return value.node
    from flame.shaping import clone

    node = clone(value).node
    node.grad_info = original.grad_info
    return node


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
