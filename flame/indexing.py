"""Indexing with integer tensors, as in PyTorch: ``gather``, ``index_select``,
``take_along_dim``, ``scatter_add``, ``embedding``, ``one_hot``, ``masked_fill`` and
``index_tensor`` (``x[idx]`` for an integer tensor ``idx``).

Index tensors are int32 or int64. Shape, dtype and dim errors are raised when the op is
built. Out-of-range indices raise ``IndexError`` on the reference backend; on the GPU they
are not checked but never read or write outside the tensor: gathers give 0 there,
``scatter_add`` drops the contribution, ``one_hot`` gives a zero row (see
``flame/ir/ops/indexing.py``). ``masked_fill`` is elementwise (a ``where``) and fuses with its
neighbours; the others are library ops, fusion boundaries.
"""

from __future__ import annotations

import numpy as np

from flame import creation
from flame.backend import backend as use_backend
from flame.functional import where
from flame.ir import dtypes
from flame.ir.ops import indexing as _declarations  # noqa: F401  (registers the ops)
from flame.ir.shapes import ShapeError, broadcast_shapes
from flame.linalg import at_user_line
from flame.tensor import Tensor, apply_op


def _check_tensors(op: str, **values) -> None:
    for name, value in values.items():
        if not isinstance(value, Tensor):
            raise at_user_line(
                TypeError(f"{op}: {name} must be a flame.Tensor, got {type(value).__name__}")
            )


def _dim(op: str, dim, rank: int) -> int:
    """``dim`` in ``[0, rank)``; negative dims count from the end."""
    if isinstance(dim, bool) or not hasattr(dim, "__index__"):
        raise at_user_line(TypeError(f"{op}: dim must be an int, got {dim!r}"))
    dim = dim.__index__()
    if not -rank <= dim < rank:
        raise at_user_line(IndexError(f"{op}: dim {dim} is out of range for a {rank}-d input"))
    return dim % rank


def gather(input: Tensor, dim: int, index: Tensor) -> Tensor:  # noqa: A002 (PyTorch's name)
    """``out[i][j][k] = input[i][index[i][j][k]][k]`` for ``dim=1`` (``torch.gather``): ``index``
    has ``input``'s rank and is no larger than it on the other dims; ``out`` has its shape."""
    _check_tensors("gather", input=input, index=index)
    return apply_op("gather", input, index, dim=_dim("gather", dim, input.ndim))


def index_select(input: Tensor, dim: int, index: Tensor) -> Tensor:  # noqa: A002
    """The entries of ``input`` along ``dim`` named by the 1-d ``index``, in its order."""
    _check_tensors("index_select", input=input, index=index)
    return apply_op("index_select", input, index, dim=_dim("index_select", dim, input.ndim))


def take_along_dim(input: Tensor, indices: Tensor, dim: int | None = None) -> Tensor:  # noqa: A002
    """``numpy.take_along_axis``: ``input`` and ``indices`` broadcast on every dim but
    ``dim``; with ``dim=None`` both are flattened. As in PyTorch, negative indices count from
    the end along a given ``dim`` but are out of range with ``dim=None``."""
    _check_tensors("take_along_dim", input=input, indices=indices)
    if dim is not None:
        dim = _dim("take_along_dim", dim, input.ndim)
    return apply_op("take_along_dim", input, indices, dim=dim)


def scatter_add(input: Tensor, dim: int, index: Tensor, src: Tensor) -> Tensor:  # noqa: A002
    """A copy of ``input`` with ``out[index[i][j]][j] += src[i][j]`` (``dim=0``) for every
    position of ``index``; repeated indices add up. ``input`` and ``src`` share one dtype.
    On the GPU float16/bfloat16 accumulate in float32 and round once; float sums may differ
    in the last bits between runs (atomic additions in any order)."""
    _check_tensors("scatter_add", input=input, index=index, src=src)
    dim = _dim("scatter_add", dim, input.ndim)
    return apply_op("scatter_add", input, index, src, dim=dim)


def index_add(input: Tensor, dim: int, index: Tensor, source: Tensor, *, alpha=1) -> Tensor:  # noqa: A002
    """A copy of ``input`` with ``alpha * source``'s entry ``i`` along ``dim`` added at
    ``index[i]`` (repeated indices add up): ``scatter_add`` with ``index`` placed along ``dim``.
    ``source`` has ``input``'s dtype and shape but ``len(index)`` along ``dim``; an integer
    input takes ``alpha`` as an integer, as PyTorch's."""
    _check_tensors("index_add", input=input, index=index, source=source)
    if index.dtype not in (dtypes.int32, dtypes.int64):
        raise at_user_line(
            TypeError(f"index_add: index must be int32 or int64, got {_shown(index)}")
        )
    if index.ndim > 1:
        raise at_user_line(IndexError(f"index_add: index must be a vector, got {_shown(index)}"))
    if source.dtype is not input.dtype:
        raise at_user_line(
            TypeError(
                f"index_add: input {_shown(input)} and source {_shown(source)} must have the "
                "same dtype"
            )
        )
    if input.ndim == 0:  # one entry: as a 1-d tensor of size 1
        added = index_add(input.reshape(1), dim, index.reshape(-1), source.reshape(-1), alpha=alpha)
        return added.reshape(())
    axis = _dim("index_add", dim, input.ndim)
    count = index.numel()
    expected = input.shape[:axis] + (count,) + input.shape[axis + 1 :]
    if source.shape != expected:
        raise at_user_line(
            ShapeError(
                f"index_add: source {_shown(source)} must have the shape of input "
                f"{_shown(input)} with {count} (the number of indices) along dim {dim}"
            )
        )
    if alpha != 1:
        source = source * (alpha if input.dtype.is_float else int(alpha))
    placed = [1] * input.ndim
    placed[axis] = count
    along = index.reshape(tuple(placed)).expand(source.shape)
    return apply_op("scatter_add", input, along, source, dim=axis)


def _shown(value: Tensor) -> str:
    return f"{value.dtype.name}{list(value.shape)}"


def embedding(
    input: Tensor,  # noqa: A002
    weight: Tensor,
    padding_idx: int | None = None,
    scale_grad_by_freq: bool = False,
) -> Tensor:
    """Rows of ``weight [num_embeddings, dim]`` named by the integer ``input``: shape
    ``input.shape + [dim]`` (``torch.nn.functional.embedding`` without ``max_norm``, which
    ``flame.nn.functional.embedding`` adds). ``padding_idx`` and ``scale_grad_by_freq`` only
    change the gradient, as in PyTorch: the padding row gets none; each lookup's gradient
    row is divided by how often its index occurs in ``input``."""
    _check_tensors("embedding", input=input, weight=weight)
    if padding_idx is not None and weight.ndim == 2:
        rows = weight.shape[0]
        if not -rows <= padding_idx < rows:
            raise at_user_line(
                ValueError(f"embedding: padding_idx {padding_idx} is out of range for {rows} rows")
            )
        padding_idx %= rows
    return apply_op(
        "embedding", input, weight, padding_idx=padding_idx,
        scale_grad_by_freq=bool(scale_grad_by_freq),
    )  # fmt: skip


def one_hot(tensor: Tensor, num_classes: int = -1) -> Tensor:
    """int64 ``tensor.shape + [num_classes]`` with a 1 at each label. ``num_classes=-1``
    means ``tensor.max() + 1``, which needs the values: it realizes ``tensor`` (a GPU sync);
    pass ``num_classes`` to keep the graph lazy."""
    _check_tensors("one_hot", tensor=tensor)
    if tensor.dtype not in (dtypes.int32, dtypes.int64):
        raise at_user_line(
            TypeError(f"one_hot: needs an int32 or int64 tensor, got {tensor.dtype.name}")
        )
    if num_classes == -1:
        if tensor.numel() == 0:
            raise at_user_line(ValueError("one_hot: cannot infer num_classes from an empty tensor"))
        num_classes = int(tensor.numpy().max()) + 1
    return apply_op("one_hot", tensor, num_classes=num_classes)


def _scalar_as(value, dtype: dtypes.DType):
    """A Python number converted to ``dtype``'s kind, so ``where`` keeps ``dtype``
    (``int_tensor.masked_fill(mask, 1.5)`` fills 1, as PyTorch does)."""
    if dtype.is_bool:
        return bool(value)
    if dtype.is_int:
        return int(value)
    return float(value)


def _mask_shape(op: str, input: Tensor, mask: Tensor) -> tuple:  # noqa: A002
    """The shape ``input`` and the bool ``mask`` broadcast to (errors at the user's line)."""
    _check_tensors(op, input=input, mask=mask)
    if not mask.dtype.is_bool:
        raise at_user_line(TypeError(f"{op}: mask must be bool, got {mask.dtype.name}"))
    try:
        return broadcast_shapes(op, mask.shape, input.shape)
    except ShapeError as error:
        raise at_user_line(error) from None


def masked_fill(input: Tensor, mask: Tensor, value) -> Tensor:  # noqa: A002
    """``input`` with ``value`` where the bool ``mask`` (broadcast to ``input``'s shape) is
    true. Elementwise: it fuses with the ops around it."""
    shape = _mask_shape("masked_fill", input, mask)
    if shape != input.shape:
        raise at_user_line(
            ShapeError(
                f"masked_fill: mask {list(mask.shape)} does not broadcast to input "
                f"{list(input.shape)}"
            )
        )
    if isinstance(value, Tensor):
        if value.ndim != 0:
            raise at_user_line(
                ShapeError(
                    f"masked_fill: value must be a number or a 0-d tensor, got {list(value.shape)}"
                )
            )
        value = value.to(input.dtype)
    else:
        value = _scalar_as(value, input.dtype)
    return where(mask, value, input)


def index_tensor(x: Tensor, index) -> Tensor:
    """``x[index]`` for an integer ``index`` (a tensor, or a list / NumPy array made into one
    on ``x``'s backend): shape ``index.shape + x.shape[1:]``; negative entries count from
    the end."""
    _check_tensors("index_tensor", x=x)
    if not isinstance(index, Tensor):
        with use_backend(x.backend):
            index = creation.tensor(index)
    return apply_op("index_tensor", x, index)


def _scatter_source(op: str, index: Tensor, src, dtype) -> Tensor:
    if isinstance(src, Tensor):
        return src
    with use_backend(index.backend):
        return creation.full(index.shape, src, dtype=dtype)


def scatter(input: Tensor, dim: int, index: Tensor, src=None, *, value=None, reduce=None):  # noqa: A002
    """A copy of ``input`` with ``out[index[i][j]][j] = src[i][j]`` (``dim=0``); ``src`` may
    be a number (or ``value=``). ``reduce='add'|'multiply'`` as PyTorch's (only ``'add'``).
    Where an index repeats, PyTorch leaves which write wins unspecified; FLAME writes the
    sum of the repeated values (written with ``scatter_add``, so it fuses and has a vjp)."""
    if src is None:
        src = value
    if src is None:
        raise at_user_line(TypeError("scatter: give src (a tensor or a number) or value="))
    _check_tensors("scatter", input=input, index=index)
    source = _scatter_source("scatter", index, src, input.dtype)
    if reduce == "add":
        return scatter_add(input, dim, index, source)
    if reduce is not None:
        raise at_user_line(ValueError(f"scatter: reduce must be None or 'add', got {reduce!r}"))
    return _scatter_replace(input, dim, index, source)


def _scatter_replace(input: Tensor, dim: int, index: Tensor, source: Tensor) -> Tensor:  # noqa: A002
    hits = scatter_add(creation.zeros_like(input), dim, index, creation.ones_like(source))
    placed = scatter_add(creation.zeros_like(input), dim, index, source)
    return where(hits > 0, placed, input)


def scatter_reduce(
    input: Tensor,
    dim: int,
    index: Tensor,
    src: Tensor,
    reduce: str,
    *,
    include_self=True,  # noqa: A002
) -> Tensor:
    """``torch.scatter_reduce`` for ``reduce='sum'``, ``'prod'``, ``'mean'``, ``'amax'`` and
    ``'amin'``. ``prod`` of integers is computed in float64 and rounded: exact while every
    product stays within 2**53 (PyTorch wraps on int64 overflow)."""
    _check_tensors("scatter_reduce", input=input, index=index, src=src)
    if reduce in ("amax", "amin"):
        dim = _dim("scatter_reduce", dim, input.ndim)
        return apply_op(
            "scatter_extreme", input, index, src, dim=dim, largest=reduce == "amax",
            include_self=bool(include_self),
        )  # fmt: skip
    if reduce == "prod":
        return _scatter_prod(input, dim, index, src, bool(include_self))
    if reduce not in ("sum", "mean"):
        raise at_user_line(
            ValueError(
                f"scatter_reduce: reduce={reduce!r} is not supported (sum, prod, mean, amax, amin)"
            )
        )
    summed = scatter_add(creation.zeros_like(input), dim, index, src)
    counts = scatter_add(creation.zeros_like(input), dim, index, creation.ones_like(src))
    if include_self:
        summed, counts = summed + input, counts + 1
    if reduce == "mean":
        total = summed / where(counts > 0, counts, 1)
        if input.dtype.is_int:
            total = total.floor().to(input.dtype)
    else:
        total = summed
    return total if include_self else where(counts > 0, total, input)


def _scatter_prod(input: Tensor, dim: int, index: Tensor, src: Tensor, include_self: bool):  # noqa: A002
    """The product of the values scattered to each place (and ``input``'s own, with
    ``include_self``), as sums: sign from the count of negatives, magnitude ``exp`` of the
    sum of ``log|x|`` over the non-zero values, and a factor for zeros that is 1 without a
    zero, the zero itself with one (so its gradient is the product of the others, as in
    PyTorch) and a constant 0 with two or more. Gradients follow by autograd."""
    work = dtypes.float64 if not input.dtype.is_float else input.dtype
    x, values = input.to(work), src.to(work)
    empty = creation.zeros_like(x)

    def gathered(term_of):
        total = scatter_add(empty, dim, index, term_of(values))
        return total + term_of(x) if include_self else total

    def log_magnitude(v):
        return where(v == 0, 1.0, v).abs().log()  # a zero adds nothing, and no 1/0 backward

    logs = gathered(log_magnitude)
    negatives = gathered(lambda v: (v < 0).to(work))
    zeros = gathered(lambda v: (v == 0).to(work))
    zero_sum = gathered(lambda v: where(v == 0, v, 0.0))
    sign = 1.0 - 2.0 * (negatives - 2.0 * (negatives * 0.5).floor())
    zero_factor = where(zeros >= 2, 0.0, where(zeros == 1, zero_sum, 1.0))
    product = sign * logs.exp() * zero_factor
    hits = scatter_add(empty, dim, index, creation.ones_like(values))
    product = where(hits > 0, product, x)  # untouched places keep their value exactly
    if not input.dtype.is_float:
        product = product.round()
    return product.to(input.dtype)


def checked_targets(op: str, target: Tensor, classes: int, ignore_index: int) -> Tensor:
    """``target`` (class indices) refused where a value is outside [0, classes) and not
    ``ignore_index``: PyTorch's ``IndexError: Target 7 is out of bounds.``, raised when the
    value is read (on the GPU: at the next read of any value, ``device_errors.py``)."""
    if target.dtype not in (dtypes.int32, dtypes.int64):
        raise at_user_line(
            TypeError(
                f"{op}: target must hold int32 or int64 class indices, got "
                f"{target.dtype.name}{list(target.shape)}"
            )  # fmt: skip
        )
    return apply_op("check_index", target, size=classes, ignore=ignore_index,
                    message=op + ": Target {value} is out of bounds.")  # fmt: skip


def nonzero(input: Tensor, *, as_tuple: bool = False):  # noqa: A002
    """The indices of the non-zero entries, ``[n, ndim]`` int64 (``as_tuple``: one 1-d tensor
    per dim). Its size depends on the values: it realizes ``input`` (a sync, as PyTorch's)."""
    _check_tensors("nonzero", input=input)
    positions = np.nonzero(np.asarray(input.numpy()))
    with use_backend(input.backend):
        if as_tuple:
            return tuple(creation.tensor(p.astype(np.int64)) for p in positions)
        stacked = np.stack(positions, axis=1) if positions else np.zeros((0, 0))
        return creation.tensor(stacked.astype(np.int64).reshape(-1, input.ndim))


def masked_select(input: Tensor, mask: Tensor) -> Tensor:  # noqa: A002
    """The entries of ``input`` where the bool ``mask`` is true, as a 1-d tensor (both
    broadcast). Its size depends on the mask: it realizes the mask (a sync, as PyTorch's);
    the gradient flows back to the selected entries."""
    shape = _mask_shape("masked_select", input, mask)
    flat_mask = np.broadcast_to(np.asarray(mask.numpy()), shape).reshape(-1)
    with use_backend(input.backend):
        picks = creation.tensor(np.flatnonzero(flat_mask).astype(np.int64))
    values = input.broadcast_to(shape) if input.shape != shape else input
    return index_tensor(values.reshape(-1), picks)


def advanced_index(x: Tensor, items: tuple) -> Tensor:
    """``x[items]`` with integer or bool index tensors (lists, arrays) among ints, slices,
    None and Ellipsis, by NumPy's rules (as PyTorch): the index tensors (and ints beside
    them) broadcast together; their dims replace the indexed dims where those were adjacent,
    else lead the result. A bool index stands for its ``nonzero()`` (a sync, as PyTorch's).
    One gather over the indexed dims flattened, so the gradient is one scatter-add."""
    from flame.views import getitem, permute, reshape

    items = _expand_ellipsis(x, items)
    basic, advanced = [], []  # advanced: (dim of the basic view, index tensor)
    dim = 0
    for item in items:
        if item is None:
            basic.append(None)
            dim += 1
        elif isinstance(item, slice):
            basic.append(item)
            dim += 1
        else:
            for index in _as_index_tensors(x, item):
                basic.append(slice(None))
                advanced.append((dim, index))
                dim += 1
    view = getitem(x, tuple(basic))
    dims = [d for d, _ in advanced]
    try:
        shape = broadcast_shapes("index", *(index.shape for _, index in advanced))
    except ShapeError as error:
        raise at_user_line(
            IndexError(
                f"shape mismatch: indexing tensors could not be broadcast together ({error})"
            )
        ) from None
    sizes = [view.shape[d] for d in dims]
    rest = [d for d in range(view.ndim) if d not in dims]
    moved = permute(view, tuple(dims + rest))
    flat = reshape(
        moved, (int(np.prod(sizes, dtype=np.int64)),) + tuple(view.shape[d] for d in rest)
    )
    linear = None
    stride = 1
    for (_, index), size in reversed(list(zip(advanced, sizes))):
        wrapped = where(index < 0, index + size, index)
        term = wrapped * stride if stride != 1 else wrapped
        linear = term if linear is None else linear + term
        stride *= size
    linear = linear.broadcast_to(shape) if linear.shape != shape else linear
    result = index_tensor(flat, linear)
    adjacent = dims == list(range(dims[0], dims[0] + len(dims)))
    if adjacent and dims[0] > 0:  # the index dims take the indexed dims' place
        lead, count = dims[0], len(shape)
        order = (
            list(range(count, count + lead))
            + list(range(count))
            + list(range(count + lead, result.ndim))
        )
        result = permute(result, tuple(order))
    return result


def _expand_ellipsis(x: Tensor, items: tuple) -> list:
    """``views.expand_ellipsis``, a bool index counting the dims it covers."""
    from flame.views import expand_ellipsis

    used = 0
    for item in items:
        if item is None or item is Ellipsis:
            continue
        if not isinstance(item, slice) and _bool_index(item):
            used += np.ndim(item.numpy() if isinstance(item, Tensor) else item)
        else:
            used += 1
    try:
        return expand_ellipsis(items, x.ndim, used)
    except IndexError as error:
        raise at_user_line(error) from None


def _bool_index(item) -> bool:
    if isinstance(item, Tensor):
        return item.dtype.is_bool
    return np.asarray(item).dtype == np.bool_


def _as_index_tensors(x: Tensor, item) -> list[Tensor]:
    """The int64 index tensor(s) an item stands for (a bool item: one per dim it covers)."""
    if _bool_index(item):
        mask = np.asarray(item.numpy() if isinstance(item, Tensor) else item)
        with use_backend(x.backend):
            return [creation.tensor(p.astype(np.int64)) for p in np.nonzero(mask)]
    if isinstance(item, Tensor):
        if item.dtype.is_float:
            raise at_user_line(
                IndexError(
                    f"tensors used as indices must be integer or bool, got {item.dtype.name}"
                )
            )
        return [item if item.dtype is dtypes.int64 else item.to(dtypes.int64)]
    values = np.asarray(item)
    if values.dtype.kind not in "iu":
        raise at_user_line(
            IndexError(f"unsupported index {item!r} (ints, slices, None, ..., int or bool tensors)")
        )
    with use_backend(x.backend):
        return [creation.tensor(values.astype(np.int64))]


for _name, _function in (
    ("gather", gather), ("index_select", index_select), ("take_along_dim", take_along_dim),
    ("scatter_add", scatter_add), ("masked_fill", masked_fill), ("scatter", scatter),
    ("scatter_reduce", scatter_reduce), ("nonzero", nonzero), ("masked_select", masked_select),
    ("index_add", index_add),
):  # fmt: skip
    if _name not in Tensor.__dict__:
        setattr(Tensor, _name, _function)

__all__ = [
    "embedding", "gather", "index_add", "index_select", "index_tensor", "masked_fill", "one_hot",
    "scatter_add", "take_along_dim", "scatter", "scatter_reduce", "nonzero", "masked_select",
]  # fmt: skip
