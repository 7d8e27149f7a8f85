"""Indexing ops: gathers (``gather``, ``index_select``, ``take_along_dim``, ``embedding``,
``index_tensor``), ``scatter_add``, ``one_hot`` and ``check_index``.

Every op here is a library op (a fusion boundary) whose index inputs are int32 or int64 and
whose ``dim`` attribute is already normalized (``0 <= dim < rank``) by ``flame/indexing.py``.

Out-of-range indices: the references raise ``IndexError`` naming the op, the dim and the
first offending value. On the GPU (``flame/runtime/library_indexing.py``) nothing outside
the input is touched: a gather reads 0 (zero bits: 0, 0.0, False) for an out-of-range index,
``scatter_add`` drops that contribution and ``one_hot`` writes a row of zeros; the kernel
reports the index, and the host raises the same error at its next read of any value
(``flame/runtime/device_errors.py``). ``check_index`` passes an index through with that
check alone (nll_loss's targets, which a fused kernel compares with the classes).

Negative indices count from the end only where PyTorch does that too (``take_along_dim`` with
a dim, ``index_tensor``, i.e. ``x[idx]``); elsewhere they are out of range.

Gradients (rules at the end): every gather's data cotangent is ``scatter_add`` of the
incoming cotangent into zeros at the same positions (repeated indices add up), and
``scatter_add``'s ``src`` cotangent is a gather. Index inputs get none.
"""

from __future__ import annotations

import numpy as np

from flame.ir import dtypes
from flame.ir.ops.registry import def_op, def_vjp
from flame.ir.shapes import ShapeError, broadcast_shapes

INDEX_DTYPES = (dtypes.int32, dtypes.int64)


class IndexOutOfBounds(IndexError, RuntimeError):
    """An index tensor's value outside the indexed dim: an ``IndexError``, and the
    ``RuntimeError`` PyTorch raises for gather, scatter and their kin."""


def checked_index(op: str, index: np.ndarray, size: int, dim, wrap: bool = False) -> np.ndarray:
    """``index`` as non-negative positions; IndexError names the first out-of-range value."""
    index = np.asarray(index)
    low = -size if wrap else 0
    bad = (index < low) | (index >= size)
    if bad.any():
        value = index[bad].flat[0]
        where = "the flattened input" if dim is None else f"dim {dim}"
        raise IndexOutOfBounds(f"{op}: index {value} is out of bounds for {where} with size {size}")
    if wrap:
        index = np.where(index < 0, index + size, index)
    return index.astype(np.intp)


def _shown(node) -> str:
    return f"{node.dtype.name}{list(node.shape)}"


def _check_index(op: str, index, what: str = "index") -> None:
    if index.dtype not in INDEX_DTYPES:
        hint = (
            "; a bool mask selects a data-dependent number of elements"
            if index.dtype.is_bool
            else ""
        )
        raise TypeError(f"{op}: {what} must be int32 or int64, got {_shown(index)}{hint}")


def _check_dim(op: str, dim, rank: int) -> int:
    if not isinstance(dim, int) or not 0 <= dim < rank:
        raise IndexError(f"{op}: dim {dim} is out of range for a {rank}-d input")
    return dim


def _check_not_larger(op: str, index, other, skip, what: str) -> None:
    for axis, (size, limit) in enumerate(zip(index.shape, other.shape, strict=True)):
        if axis != skip and size > limit:
            raise ShapeError(
                f"{op}: index {_shown(index)} is larger than {what} {_shown(other)} at dim {axis} "
                f"({size} > {limit})"
            )


def _check_ranks(op: str, *nodes) -> None:
    if len({len(node.shape) for node in nodes}) > 1:
        shown = ", ".join(_shown(node) for node in nodes)
        raise ShapeError(f"{op}: inputs must have the same number of dims, got {shown}")


# --- gather ----------------------------------------------------------------------------------


def _gather_rule(inputs, attrs):
    source, index = inputs
    _check_index("gather", index)
    _check_ranks("gather", source, index)
    dim = _check_dim("gather", attrs["dim"], len(source.shape))
    _check_not_larger("gather", index, source, dim, "input")
    return source.dtype, index.shape


def _gather_ref(source, index, dim=0):
    index = checked_index("gather", index, source.shape[dim], dim)
    trimmed = tuple(
        slice(None) if axis == dim else slice(0, size) for axis, size in enumerate(index.shape)
    )
    return np.take_along_axis(source[trimmed], index, axis=dim)


def_op(
    "gather", "library", 2, ref=_gather_ref, shape_rule=_gather_rule, attrs={"dim": 0},
    doc="out[..., i, ...] = input[..., index[..., i, ...], ...] along dim (torch.gather)",
)  # fmt: skip


# --- index_select --------------------------------------------------------------------------


def _index_select_rule(inputs, attrs):
    source, index = inputs
    _check_index("index_select", index)
    if len(index.shape) > 1:
        raise ShapeError(f"index_select: index must be 0-d or 1-d, got {_shown(index)}")
    dim = _check_dim("index_select", attrs["dim"], len(source.shape))
    shape = list(source.shape)
    shape[dim] = index.numel
    return source.dtype, tuple(shape)


def _index_select_ref(source, index, dim=0):
    index = checked_index("index_select", index, source.shape[dim], dim).reshape(-1)
    return np.take(source, index, axis=dim)


def_op(
    "index_select", "library", 2, ref=_index_select_ref, shape_rule=_index_select_rule,
    attrs={"dim": 0}, doc="the entries index names along dim (torch.index_select)",
)  # fmt: skip


# --- take_along_dim -------------------------------------------------------------------------


def take_along_shapes(source_shape, index_shape, dim):
    """(result shape, source shape, index shape) of take_along_dim with broadcasting: every
    axis but ``dim`` broadcasts; the result has the index's size along ``dim``."""
    source_rest = tuple(1 if axis == dim else size for axis, size in enumerate(source_shape))
    index_rest = tuple(1 if axis == dim else size for axis, size in enumerate(index_shape))
    shape = list(broadcast_shapes("take_along_dim", source_rest, index_rest))
    source_target, index_target = list(shape), list(shape)
    source_target[dim], index_target[dim] = source_shape[dim], index_shape[dim]
    shape[dim] = index_shape[dim]
    return tuple(shape), tuple(source_target), tuple(index_target)


def _take_along_rule(inputs, attrs):
    source, index = inputs
    _check_index("take_along_dim", index)
    dim = attrs.get("dim")
    if dim is None:
        return source.dtype, (index.numel,)
    _check_ranks("take_along_dim", source, index)
    dim = _check_dim("take_along_dim", dim, len(source.shape))
    return source.dtype, take_along_shapes(source.shape, index.shape, dim)[0]


def _take_along_ref(source, index, dim=None):
    if dim is None:
        flat = source.reshape(-1)
        # as PyTorch: negative entries count from the end only along a given dim
        return flat[checked_index("take_along_dim", index, flat.size, None).reshape(-1)]
    _, source_shape, index_shape = take_along_shapes(source.shape, index.shape, dim)
    index = checked_index("take_along_dim", index, source.shape[dim], dim, wrap=True)
    source, index = np.broadcast_to(source, source_shape), np.broadcast_to(index, index_shape)
    return np.take_along_axis(source, index, axis=dim)


def_op(
    "take_along_dim", "library", 2, ref=_take_along_ref, shape_rule=_take_along_rule,
    attrs={"dim": None}, doc="numpy.take_along_axis with broadcasting (torch.take_along_dim)",
)  # fmt: skip


# --- scatter_add ----------------------------------------------------------------------------


def _scatter_add_rule(inputs, attrs):
    target, index, source = inputs
    _check_index("scatter_add", index)
    if target.dtype is not source.dtype:
        raise TypeError(
            f"scatter_add: input and src must share one dtype, got {_shown(target)} and "
            f"{_shown(source)}"
        )
    if target.dtype.is_bool:
        raise TypeError(f"scatter_add: not defined for bool (input {_shown(target)})")
    _check_ranks("scatter_add", target, index, source)
    dim = _check_dim("scatter_add", attrs["dim"], len(target.shape))
    _check_not_larger("scatter_add", index, source, None, "src")
    _check_not_larger("scatter_add", index, target, dim, "input")
    return target.dtype, target.shape


def _scatter_add_ref(target, index, source, dim=0):
    index = checked_index("scatter_add", index, target.shape[dim], dim)
    out = np.array(target, copy=True)
    coordinates = list(np.indices(index.shape, sparse=True))
    coordinates[dim] = index
    np.add.at(out, tuple(coordinates), source[tuple(slice(0, size) for size in index.shape)])
    return out


def_op(
    "scatter_add", "library", 3, ref=_scatter_add_ref, shape_rule=_scatter_add_rule,
    attrs={"dim": 0}, categories="if",
    doc="out = input; out[..., index[..., i, ...], ...] += src[..., i, ...] (torch.scatter_add)",
)  # fmt: skip


def _scatter_extreme_rule(inputs, attrs):
    target, index, source = inputs
    _scatter_add_rule(inputs, attrs)  # the same checks (names aside)
    if not target.dtype.is_float:
        raise TypeError(f"scatter_reduce: amax/amin need a float input, got {_shown(target)}")
    return target.dtype, target.shape


def _scatter_extreme_ref(target, index, source, dim=0, largest=True, include_self=True):
    """``torch.scatter_reduce(..., 'amax' | 'amin', include_self=)``: each position the
    max (min) of the values scattered to it, and of its own value with ``include_self``
    (NaN wins, as in PyTorch); positions nothing is scattered to keep their value."""
    index = checked_index("scatter_reduce", index, target.shape[dim], dim)
    coordinates = list(np.indices(index.shape, sparse=True))
    coordinates[dim] = index
    coordinates = tuple(coordinates)
    values = source[tuple(slice(0, size) for size in index.shape)]
    combine = np.maximum if largest else np.minimum
    out = np.array(target, copy=True)
    if not include_self:
        out[coordinates] = -np.inf if largest else np.inf
    combine.at(out, coordinates, values)
    return out


def_op(
    "scatter_extreme", "library", 3, ref=_scatter_extreme_ref, shape_rule=_scatter_extreme_rule,
    attrs={"dim": 0, "largest": True, "include_self": True}, categories="f",
    doc="torch.scatter_reduce with reduce='amax' (largest) or 'amin'",
)  # fmt: skip


# --- embedding, x[idx] ----------------------------------------------------------------------


def _embedding_rule(inputs, attrs):
    index, weight = inputs
    _check_index("embedding", index, "input")
    if len(weight.shape) != 2:
        raise ShapeError(
            f"embedding: weight must be 2-d [num_embeddings, dim], got {_shown(weight)}"
        )
    return weight.dtype, tuple(index.shape) + (weight.shape[1],)


def _embedding_ref(index, weight, padding_idx=None, scale_grad_by_freq=False):
    # padding_idx and scale_grad_by_freq only change the gradient, never the forward value
    return weight[checked_index("embedding", index, weight.shape[0], 0)]


def_op(
    "embedding", "library", 2, ref=_embedding_ref, shape_rule=_embedding_rule,
    attrs={"padding_idx": None, "scale_grad_by_freq": False},
    doc="rows of weight named by input (torch.nn.functional.embedding)",
)  # fmt: skip


def _index_tensor_rule(inputs, attrs):
    source, index = inputs
    _check_index("index_tensor", index)
    if not source.shape:
        raise ShapeError(f"index_tensor: cannot index a 0-d tensor ({_shown(source)})")
    return source.dtype, tuple(index.shape) + tuple(source.shape[1:])


def _index_tensor_ref(source, index):
    return source[checked_index("index_tensor", index, source.shape[0], 0, wrap=True)]


def_op(
    "index_tensor", "library", 2, ref=_index_tensor_ref, shape_rule=_index_tensor_rule,
    doc="x[idx] for an integer tensor idx along dim 0 (negative entries count from the end)",
)  # fmt: skip


# --- one_hot --------------------------------------------------------------------------------


def _one_hot_rule(inputs, attrs):
    (labels,) = inputs
    _check_index("one_hot", labels, "tensor")
    classes = attrs["num_classes"]
    if not isinstance(classes, int) or classes < 0:
        raise ValueError(f"one_hot: num_classes must be a non-negative int, got {classes!r}")
    return dtypes.int64, tuple(labels.shape) + (classes,)


def _one_hot_ref(labels, num_classes=0):
    bad = (labels < 0) | (labels >= num_classes)
    if bad.any():
        value = labels[bad].flat[0]
        raise IndexError(f"one_hot: class {value} is out of range for num_classes={num_classes}")
    return (labels[..., None] == np.arange(num_classes)).astype(np.int64)


def_op(
    "one_hot", "library", 1, ref=_one_hot_ref, shape_rule=_one_hot_rule,
    attrs={"num_classes": 0}, categories="i", differentiable=False,
    doc="int64 [..., num_classes] with a 1 at each label (torch.nn.functional.one_hot)",
)  # fmt: skip


# --- check_index ----------------------------------------------------------------------------


def _check_index_rule(inputs, attrs):
    (index,) = inputs
    _check_index("check_index", index)
    size = attrs["size"]
    if not isinstance(size, int) or size < 0:
        raise ValueError(f"check_index: size must be a non-negative int, got {size!r}")
    return index.dtype, index.shape


def _check_index_ref(index, size=0, ignore=None, message="index {value} is out of range"):
    bad = (index < 0) | (index >= size)
    if ignore is not None:
        bad &= index != ignore
    if bad.any():
        raise IndexOutOfBounds(message.format(value=index[bad].flat[0]))
    return index.copy()


def_op(
    "check_index", "library", 1, ref=_check_index_ref, shape_rule=_check_index_rule,
    attrs={"size": 0, "ignore": None, "message": "index {value} is out of range"},
    categories="i", differentiable=False,
    doc="index, unchanged, refused where a value is outside [0, size) and not ignore "
    "(the GPU reports it at the next read: flame/runtime/device_errors.py)",
)  # fmt: skip


# --- backward rules ---------------------------------------------------------------------------
# rule(F, g, out, *inputs, **attrs) -> one cotangent per input; see registry.def_vjp. Index
# inputs are integers: they get no cotangent (None).


def _zeros(g, shape, dtype):
    """Zeros on the cotangent's backend (not the caller's current one)."""
    from flame.backend import backend as use_backend
    from flame.creation import zeros

    with use_backend(g.backend):
        return zeros(tuple(shape), dtype=dtype)


def _scatter_into(F, g, shape, dtype, dim, index):
    """``zeros(shape)`` with ``g`` added at ``index`` along ``dim`` (index shaped like g)."""
    return F.scatter_add(_zeros(g, shape, dtype), dim, index, g)


def _wrapped(F, index, size):
    """Negative positions counted from the end, as the forward read them."""
    return F.where(index < 0, index + size, index)


def _along(F, index, shape, dim):
    """A 1-d ``index`` placed along ``dim`` and broadcast to ``shape``."""
    placed = [1] * len(shape)
    placed[dim] = index.numel()
    return F.expand(F.reshape(index, tuple(placed)), tuple(shape))


def _gather_vjp(F, g, out, source, index, dim=0):
    return (_scatter_into(F, g, source.shape, source.dtype, dim, index), None)


def _index_select_vjp(F, g, out, source, index, dim=0):
    spread = _along(F, index, g.shape, dim)
    return (_scatter_into(F, g, source.shape, source.dtype, dim, spread), None)


def _take_along_dim_vjp(F, g, out, source, index, dim=None):
    if dim is None:
        flat = F.reshape(index, (index.numel(),))
        grad = _scatter_into(F, g, (source.numel(),), source.dtype, 0, flat)
        return (F.reshape(grad, source.shape), None)
    _, source_target, _ = take_along_shapes(source.shape, index.shape, dim)
    spread = F.expand(_wrapped(F, index, source.shape[dim]), g.shape)
    grad = _scatter_into(F, g, source_target, source.dtype, dim, spread)
    return (F.sum_to(grad, source.shape), None)


def _rows_vjp(F, g, index, table_shape, dtype, wrap):
    """Cotangent of ``table[index]`` (rows along dim 0) for a table of ``table_shape``."""
    count = index.numel()
    width = 1
    for size in table_shape[1:]:  # from the table: an empty index has no rows to divide by
        width *= size
    rows = F.reshape(index, (count,))
    if wrap:
        rows = _wrapped(F, rows, table_shape[0])
    spread = F.expand(F.reshape(rows, (count, 1)), (count, width))
    flat = _scatter_into(F, F.reshape(g, (count, width)), (table_shape[0], width), dtype, 0, spread)
    return F.reshape(flat, tuple(table_shape))


def _embedding_vjp(F, g, out, index, weight, padding_idx=None, scale_grad_by_freq=False):
    if padding_idx is not None:  # that row gets no gradient, as in PyTorch
        g = F.where(F.unsqueeze(index, -1) == padding_idx, 0.0, g)
    if scale_grad_by_freq:
        g = g * F.unsqueeze(_inverse_frequency(F, index, weight.shape[0], g.dtype), -1)
    return (None, _rows_vjp(F, g, index, weight.shape, weight.dtype, wrap=False))


def _inverse_frequency(F, index, rows: int, dtype):
    """1 / (how often each entry of ``index`` occurs in it), shaped like ``index``: PyTorch's
    ``scale_grad_by_freq`` factor (counted in int64, as its counts are)."""
    flat = F.reshape(index, (index.numel(),)).to(dtypes.int64)
    ones = F.where(flat == flat, 1, 0).to(dtypes.int64)
    counts = F.gather(_scatter_into(F, ones, (rows,), dtypes.int64, 0, flat), 0, flat)
    precision = dtypes.float64 if dtype is dtypes.float64 else dtypes.float32
    return F.reshape(1.0 / counts.to(precision), tuple(index.shape)).to(dtype)


def _index_tensor_vjp(F, g, out, source, index):
    return (_rows_vjp(F, g, index, source.shape, source.dtype, wrap=True), None)


def _scatter_add_vjp(F, g, out, target, index, source, dim=0):
    """``target`` passes ``g`` through; ``src`` reads ``g`` where it was added. A ``src``
    larger than ``index`` contributed nothing beyond it: zeros there."""
    picked = F.gather(g, dim, index)
    for axis, size in enumerate(source.shape):
        picked = F.unslice_axis(picked, axis, size, 0, 1)
    return (g, None, picked)


def _scatter_extreme_vjp(F, g, out, target, index, source, dim=0, largest=True,
                         include_self=True):  # fmt: skip
    """PyTorch's rule: the gradient of a position is shared evenly by every value equal to
    its result (its own value where it took part, and each scattered value)."""
    reached = source  # a src larger than index contributes only its index-shaped corner
    for axis, size in enumerate(index.shape):
        if reached.shape[axis] != size:
            reached = F.narrow(reached, axis, 0, size)
    ones = F.where(index == index, 1.0, 0.0).to(g.dtype)
    source_hit = F.where(reached == F.gather(out, dim, index), 1.0, 0.0).to(g.dtype)
    own = target == out
    if not include_self:  # its own value takes part only where nothing was scattered
        hits = F.scatter_add(F.zeros(target.shape, dtype=g.dtype), dim, index, ones)
        own = own & (hits == 0.0)
    self_hit = F.where(own, 1.0, 0.0).to(g.dtype)
    count = F.scatter_add(self_hit, dim, index, source_hit)
    share = g / F.where(count == 0.0, 1.0, count)
    grad_source = F.gather(share, dim, index) * source_hit
    for axis, size in enumerate(source.shape):
        grad_source = F.unslice_axis(grad_source, axis, size, 0, 1)
    return (share * self_hit, None, grad_source)


def_vjp("scatter_extreme", _scatter_extreme_vjp)
def_vjp("gather", _gather_vjp)
def_vjp("index_select", _index_select_vjp)
def_vjp("take_along_dim", _take_along_dim_vjp)
def_vjp("embedding", _embedding_vjp)
def_vjp("index_tensor", _index_tensor_vjp)
def_vjp("scatter_add", _scatter_add_vjp)
