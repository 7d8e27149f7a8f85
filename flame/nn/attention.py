"""Attention with PyTorch's signature: ``scaled_dot_product_attention`` (PyTorch's math
reference: matmul, mask, softmax, dropout, matmul). ``multi_head_attention_forward``, the
functional core of ``nn.MultiheadAttention``, is in flame/nn/multihead_attention.py.

Float16 and bfloat16 attention, dropout included (its mask drawn in the kernels from the
default generator), is one fused op (``attention``, flame/ir/ops/attention.py: cuDNN's flash
attention, or FLAME's own flash kernel; the [L, S] scores are never stored); other calls take
the math path of public FLAME ops (matmul, mask, softmax, dropout, matmul). As PyTorch's, a
row whose every key is masked gives zeros (a "safe" softmax), not NaN.
"""

from __future__ import annotations

import math

import numpy as np

from flame import reductions as R
from flame.amp.autocast_mode import lower_precision
from flame.backend import backend as use_backend
from flame.creation import tensor as constant
from flame.functional import where
from flame.ir.shapes import ShapeError, broadcast_shapes
from flame.linalg import matmul
from flame.shaping import checked_tensor, shown, user_errors
from flame.tensor import Tensor
from flame.views import expand, reshape, transpose

__all__ = ["scaled_dot_product_attention"]


def _functional():
    from flame.nn import functional  # at call time: functional re-exports this module

    return functional


def _check_attention(query, key, value, attn_mask, is_causal, enable_gqa) -> None:
    op = "scaled_dot_product_attention"
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        checked_tensor(op, tensor)
        if tensor.ndim < 2:
            raise ShapeError(f"{op}: {name} must have at least 2 dims, got {shown(tensor)}")
    if query.shape[-1] != key.shape[-1] or key.shape[-2] != value.shape[-2]:
        raise ShapeError(
            f"{op}: query {shown(query)} and key {shown(key)} must share the embedding dim, "
            f"key and value {shown(value)} the sequence dim (-2)"
        )
    if is_causal and attn_mask is not None:
        raise ValueError(f"{op}: an explicit attn_mask should not be set when is_causal=True")
    if enable_gqa and (query.ndim < 3 or key.ndim < 3 or value.ndim < 3):
        raise ShapeError(f"{op}: enable_gqa needs query, key and value with a head dim (-3)")
    if enable_gqa and (query.shape[-3] % key.shape[-3] or query.shape[-3] % value.shape[-3]):
        raise ShapeError(
            f"{op}: with enable_gqa the query heads ({shown(query)}) must be a multiple of the "
            f"key heads ({shown(key)}) and value heads ({shown(value)})"
        )
    heads = 3 if enable_gqa else 2  # the head dim may differ only with enable_gqa
    lead = [tensor.shape[: tensor.ndim - heads] for tensor in (query, key, value)]
    try:
        batch = broadcast_shapes(op, *lead)
    except ShapeError:
        raise ShapeError(
            f"{op}: the batch dims of query {shown(query)}, key {shown(key)} and value "
            f"{shown(value)} do not broadcast"
        ) from None
    if attn_mask is not None:
        checked_tensor(op, attn_mask)
        scores = (*broadcast_shapes(op, batch, query.shape[-3:-2] if heads == 3 else ()),
                  query.shape[-2], key.shape[-2])  # fmt: skip
        try:
            broadcast_shapes(op, attn_mask.shape, scores)
        except ShapeError:
            raise ShapeError(
                f"{op}: attn_mask {shown(attn_mask)} does not broadcast to the scores "
                f"{list(scores)} of query {shown(query)} and key {shown(key)}"
            ) from None
        if not (attn_mask.dtype.is_bool or attn_mask.dtype.is_float):
            raise TypeError(f"{op}: attn_mask must be bool or float, got {shown(attn_mask)}")


def _repeat_heads(tensor: Tensor, heads: int) -> Tensor:
    """Each head repeated heads/H times in place (``repeat_interleave`` on dim -3)."""
    count = heads // tensor.shape[-3]
    if count == 1:
        return tensor
    *lead, own, length, width = tensor.shape
    spread = expand(
        reshape(tensor, (*lead, own, 1, length, width)), (*lead, own, count, length, width)
    )
    return reshape(spread, (*lead, heads, length, width))


def _causal_keep(query: Tensor, length: int, source: int) -> Tensor:
    keep = np.tril(np.ones((length, source), dtype=bool))
    with use_backend(query.backend):
        return constant(keep)


def _safe_softmax(scores: Tensor, may_mask_rows: bool) -> Tensor:
    """Softmax over the last dim; a row of only -inf gives zeros (and zero gradients)."""
    softmax = _functional().softmax
    if not may_mask_rows:
        return softmax(scores, -1)
    empty = R.all(scores == -math.inf, -1, keepdim=True)
    weights = softmax(where(empty, 0.0, scores), -1)
    return where(empty, 0.0, weights)


@user_errors
def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``softmax(query @ key^T * scale + mask) @ value`` for query [..., L, E], key
    [..., S, E], value [..., S, Ev]. ``attn_mask``: bool (True keeps a position) or added
    to the scores, broadcast to [..., L, S]; ``is_causal``: the lower-left triangle kept;
    ``scale``: default 1/sqrt(E); ``enable_gqa``: key/value heads (dim -3) shared by groups
    of query heads."""
    _check_attention(query, key, value, attn_mask, is_causal, enable_gqa)
    query, key, value = lower_precision(query, key, value)
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(
            f"scaled_dot_product_attention: dropout_p must be in [0, 1], got {dropout_p}"
        )
    factor = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if _fusable(query, key, value, attn_mask, dropout_p, enable_gqa):
        return _attention_op(query, key, value, attn_mask, is_causal, factor, dropout_p)
    if enable_gqa:
        key, value = _repeat_heads(key, query.shape[-3]), _repeat_heads(value, query.shape[-3])
    scores = matmul(query, transpose(key, -2, -1)) * factor
    length, source = query.shape[-2], key.shape[-2]
    if is_causal:
        scores = where(_causal_keep(query, length, source), scores, -math.inf)
    if attn_mask is not None:
        checked_tensor("scaled_dot_product_attention", attn_mask)
        if attn_mask.dtype.is_bool:
            scores = where(attn_mask, scores, -math.inf)
        else:
            scores = scores + attn_mask.to(scores.dtype)
    weights = _safe_softmax(scores, is_causal or attn_mask is not None)
    if dropout_p > 0.0:
        weights = _functional().dropout(weights, dropout_p, training=True)
    return matmul(weights, value)


# --- the fused op ------------------------------------------------------------------------------

FUSED_DTYPES = ("float16", "bfloat16")
MAX_FUSED_HEAD_DIM = 256


def _fusable(query, key, value, attn_mask, dropout_p: float, enable_gqa: bool) -> bool:
    """Whether the attention op (cuDNN's fused attention, or FLAME's flash kernel) computes
    this call; the rest takes the math path above. The op covers 16-bit floats, head dims
    that are multiples of 8 up to 256, up to 4 dims with key/value heads that equal the
    query's (or divide them, with ``enable_gqa``), and masks that need no gradient; dropout
    too (its mask drawn in the kernels)."""
    if query.dtype.name not in FUSED_DTYPES or query.ndim > 4:
        return False
    if not (query.dtype is key.dtype is value.dtype) or not key.ndim == value.ndim == query.ndim:
        return False
    dims = (query.shape[-1], value.shape[-1])
    if any(dim == 0 or dim % 8 or dim > MAX_FUSED_HEAD_DIM for dim in dims):
        return False
    if key.shape[:-1] != value.shape[:-1] or query.shape[:-3] != key.shape[:-3]:
        return False
    if query.ndim >= 3 and key.shape[-3] != query.shape[-3] and not enable_gqa:
        return False
    if attn_mask is not None and (attn_mask.ndim > query.ndim or attn_mask.requires_grad):
        return False
    return True


def _four_dims(tensor: Tensor) -> Tensor:
    return reshape(tensor, (1,) * (4 - tensor.ndim) + tuple(tensor.shape))


def _attention_op(query, key, value, attn_mask, is_causal: bool, scale: float,
                  dropout_p: float = 0.0) -> Tensor:  # fmt: skip
    from flame.ir.ops.attention import stats_slots, unpack
    from flame.tensor import apply_op

    q, k, v = _four_dims(query), _four_dims(key), _four_dims(value)
    extra = ()
    if attn_mask is not None:
        checked_tensor("scaled_dot_product_attention", attn_mask)
        if attn_mask.dtype.is_bool:
            bias = where(attn_mask, 0.0, -math.inf).to(q.dtype)
        else:
            bias = attn_mask.to(q.dtype)
        extra = (_four_dims(bias),)
    attrs = {}
    if dropout_p > 0.0:  # without dropout the node (and its kernels) are those of before
        extra += (_dropout_state(q, k),)
        attrs["dropout"] = float(dropout_p)
    packed = apply_op(
        "attention", q, k, v, *extra, scale=float(scale), causal=bool(is_causal),
        slots=stats_slots(q.dtype), **attrs,
    )  # fmt: skip
    (out,) = unpack(_views(), packed, [(*q.shape[:3], v.shape[3])])
    return reshape(out, (*query.shape[:-1], value.shape[-1]))


def _views():
    from flame.autograd import functions

    return functions()


def _dropout_state(q: Tensor, k: Tensor) -> Tensor:
    """The (seed, offset) int64 [2] of one dropout mask from the default generator, drawn as
    ``F.dropout`` draws (flame/random.py): lazy, a buffer of its own; compiled, the generator's
    state buffer (read at every call) plus the draw's place in the trace."""
    from flame.ir.ops.attention import dropout_counters
    from flame.random import state_operand

    return state_operand(dropout_counters(q.shape, k.shape), q.backend)
