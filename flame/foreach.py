"""``flame.foreach``: one elementwise rule applied to lists of tensors, in place, in one launch.

    foreach(rule, params, grads, exp_avg, exp_avg_sq, scalars=hyper, into=(0, 2, 3))

calls ``rule(p, g, m, v, hyper)`` on stand-ins for one tensor of each list and writes its
results, element by element, back into the lists named by ``into``. ``hyper`` is a small
float32 tensor of values shared by every tensor (a learning rate, bias corrections): it is
read by the kernel from memory, so changing it never recompiles anything.

On the CUDA backend the rule is traced once per (rule, dtypes), fused into one elementwise
group, and launched as one multi-tensor kernel over every tensor (flame/runtime/multi_tensor.py).
On the reference backend the rule runs in lazy mode on each tensor in turn: the same
semantics, which is what the CPU tests compare against PyTorch.
"""

from __future__ import annotations

import threading

import numpy as np

from flame.ir.graph import Graph
from flame.ir.node import Node
from flame.ir.passes import run_pipeline
from flame.runtime.storage import Storage, storage_of
from flame.tensor import Tensor, realize

_TRACE_LENGTH = 1 << 20  # the stand-ins' length: any value gives the same code


class ForeachError(ValueError):
    pass


class _Traced:
    def __init__(self, group, placeholders, shared_node, order):
        self.group, self.placeholders = group, placeholders
        self.shared_node = shared_node
        self.order = order  # per kernel output: which of the rule's results it is
        self.kernels = {}  # executor id -> MultiTensorKernel


_cache: dict[tuple, _Traced] = {}  # keyed by (rule, dtypes): read-mostly, guarded below
_cache_lock = threading.Lock()


def foreach(rule, *lists, scalars: Tensor | None = None, into=()):
    """Apply ``rule`` to each index of ``lists`` (equal-length lists of tensors with equal
    shapes per index) and store its results in place into the lists named by ``into``."""
    lists = [list(column) for column in lists]
    count = len(lists[0]) if lists else 0
    _check(rule, lists, into)
    if count == 0:
        return
    backend = lists[0][0].backend
    nodes = [[t.node for t in column] for column in lists]
    pending = [
        t for column, column_nodes in zip(lists, nodes) for t, node in zip(column, column_nodes)
        if node.buffer is None and node.op != "buffer"
    ]  # fmt: skip
    if scalars is not None and not scalars.is_realized:
        pending.append(scalars)
    if pending:
        realize(*pending)
    if backend == "reference":
        _foreach_reference(rule, lists, scalars, into)
        return _renew_written(lists, into)
    column_dtypes = [{node.dtype for node in column} for column in nodes]
    if all(len(kinds) == 1 for kinds in column_dtypes):  # the usual case: one kernel
        by_dtypes = {tuple(next(iter(kinds)) for kinds in column_dtypes): None}
    else:
        by_dtypes = {}
        for index in range(count):
            key = tuple(column[index].dtype for column in lists)
            by_dtypes.setdefault(key, []).append(index)
    for dtypes_, indices in by_dtypes.items():
        traced = _trace(rule, dtypes_, scalars, tuple(into))
        kernel = _kernel(traced)
        columns = nodes if indices is None else [[c[i] for i in indices] for c in nodes]
        storages = [
            [storage_of(node) for node in column]
            for column in columns
        ]  # fmt: skip
        shared = {}
        if traced.shared_node is not None:
            shared[id(traced.shared_node)] = _array(scalars)
        kernel.launch(storages, [into[result] for result in traced.order], shared)
    _renew_written(lists, into)


def _renew_written(lists, into) -> None:
    """Each written tensor gets a new node over its memory, and the old one is noted as
    overwritten (as ``inplace.write`` does): a lazy value built from a parameter before an
    optimizer step and read after it is refused with both lines named, instead of being
    computed from the new values (flame/ir/overwritten.py)."""
    from flame.inplace import _mark_overwritten, _view_again

    renewed = set()  # a tensor listed twice is renewed once
    for position in sorted(set(into)):
        for tensor in lists[position]:
            if id(tensor) in renewed:
                continue
            renewed.add(id(tensor))
            old = tensor.node
            node = _view_again(old, storage_of(old))
            if old.grad_info is not None:
                node.grad_info = old.grad_info
            tensor.node = node
            _mark_overwritten(old, "foreach")


def _check(rule, lists, into):
    if not lists:
        raise ForeachError(f"foreach({getattr(rule, '__name__', rule)}): no tensor lists given")
    count = len(lists[0])
    for position, column in enumerate(lists):
        if len(column) != count:
            raise ForeachError(
                f"foreach: list {position} has {len(column)} tensors, list 0 has {count}"
            )
    for position in into:
        if not 0 <= position < len(lists):
            raise ForeachError(f"foreach: into names list {position}; there are {len(lists)}")
    try:  # the fast check: one comprehension per list
        shapes = [t.node.shape for t in lists[0]]
        if all([t.node.shape for t in column] == shapes for column in lists[1:]):
            return
    except AttributeError:
        pass
    for index in range(count):  # something is wrong: find it, and say where
        for position, column in enumerate(lists):
            if not isinstance(column[index], Tensor):
                raise ForeachError(f"foreach: list {position}[{index}] is not a tensor")
        shape = lists[0][index].shape
        for position, column in enumerate(lists):
            if column[index].shape != shape:
                raise ForeachError(
                    f"foreach: tensor {index} has shape {list(shape)} in list 0 but "
                    f"{list(column[index].shape)} in list {position}"
                )


def _array(tensor: Tensor):
    array = storage_of(tensor.node).device_array()
    if not array.flags.c_contiguous:
        raise ForeachError(f"foreach: a tensor of shape {list(tensor.shape)} is not contiguous")
    return array


def _stand_in(dtype, length: int, name: str) -> Node:
    host = np.lib.stride_tricks.as_strided(
        np.zeros(1, dtype=dtype.numpy), shape=(length,), strides=(dtype.itemsize,)
    )
    storage = Storage("cuda", dtype, host=host)
    return Node("buffer", (), (("storage", storage), ("name", name)), dtype, (length,), None)


def _trace(rule, dtypes_, scalars, into: tuple) -> _Traced:
    outputs = len(into)
    key = (rule, dtypes_, None if scalars is None else scalars.shape, into)
    traced = _cache.get(key)
    if traced is not None:
        return traced
    placeholders = [
        _stand_in(dtype, _TRACE_LENGTH, f"list{i}") for i, dtype in enumerate(dtypes_)
    ]  # fmt: skip
    shared = None
    arguments = [Tensor(node, "cuda") for node in placeholders]
    if scalars is not None:
        host = np.zeros(scalars.shape, dtype=scalars.dtype.numpy)
        shared = Node(
            "buffer", (), (("storage", Storage("cuda", scalars.dtype, host=host)),),
            scalars.dtype, scalars.shape, None,
        )  # fmt: skip
        arguments.append(Tensor(shared, "cuda"))
    results = rule(*arguments)  # stand-ins never require grad: no autograd nodes
    results = [results] if isinstance(results, Tensor) else list(results)
    if len(results) != outputs:
        raise ForeachError(
            f"foreach: {rule.__name__} returned {len(results)} values; into names {outputs}"
        )
    for position, result in enumerate(results):
        if result.shape != (_TRACE_LENGTH,):
            raise ForeachError(
                f"foreach: result {position} of {rule.__name__} has shape {list(result.shape)}; "
                "a rule must be elementwise"
            )
    # each result is stored in its list's dtype (the rule may compute wider, e.g. a bfloat16
    # parameter times a float32 learning rate)
    results = [result.to(dtypes_[target]) for result, target in zip(results, into)]
    graph = run_pipeline(Graph(tuple(result.node for result in results)))
    groups = graph.groups
    if len(groups) != 1 or groups[0].kind != "elementwise":
        kinds = [group.kind for group in groups]
        raise ForeachError(
            f"foreach: {rule.__name__} must fuse into one elementwise kernel; it became "
            f"{len(groups)} kernels ({', '.join(kinds)}); a rule may use elementwise ops only"
        )
    group = groups[0]
    result_of = {id(node): position for position, node in enumerate(graph.outputs)}
    order = tuple(result_of.get(id(node), -1) for node in group.outputs)
    if sorted(order) != list(range(len(results))):
        raise ForeachError(
            f"foreach: each result of {rule.__name__} must be a new value computed from its "
            "arguments (not an argument itself, nor the same value twice)"
        )
    traced = _Traced(group, placeholders, shared, order)
    with _cache_lock:
        _cache.setdefault(key, traced)
    return _cache[key]


def _kernel(traced: _Traced):
    from flame.runtime.executor import default_executor
    from flame.runtime.multi_tensor import MultiTensorKernel

    executor = default_executor()
    kernel = traced.kernels.get(id(executor))
    if kernel is None:
        kernel = MultiTensorKernel(traced.group, traced.placeholders, executor)
        traced.kernels[id(executor)] = kernel
    return kernel


def _foreach_reference(rule, lists, scalars, into):
    from flame.autograd import no_grad

    for index in range(len(lists[0])):
        row = [column[index] for column in lists]
        with no_grad():
            results = rule(*[t.detach() for t in row], *([scalars] if scalars is not None else []))
        results = [results] if isinstance(results, Tensor) else list(results)
        realize(*results)
        for result, position in zip(results, into):
            target = lists[position][index]
            writable_array(storage_of(target.node))[...] = result.numpy().astype(target.dtype.numpy)


def writable_array(storage):
    """The reference storage's array, made private and writable first if it is a view or
    read-only (a broadcast constant, a view of another value): writing in place must never
    change another tensor."""
    array = storage.array
    if not array.flags.writeable or array.base is not None:
        storage.array = array = np.array(array, copy=True)
    return array
