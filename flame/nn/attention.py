"""Attention with PyTorch's signatures: ``scaled_dot_product_attention`` (PyTorch's math
reference: matmul, mask, softmax, dropout, matmul) and ``multi_head_attention_forward`` (the
functional core of ``nn.MultiheadAttention``: in-projection, heads, masks, out-projection;
with ``need_weights=False`` the heads go through ``scaled_dot_product_attention``, as
PyTorch's do, and PyTorch's ``is_causal`` hint and error types are kept).

Float16 and bfloat16 attention, dropout included (its mask drawn in the kernels from the
default generator), is one fused op (``attention``, flame/ir/ops/attention.py: cuDNN's flash
attention, or FLAME's own flash kernel; the [L, S] scores are never stored); other calls take
the math path of public FLAME ops (matmul, mask, softmax, dropout, matmul). As PyTorch's, a
row whose every key is masked gives zeros (a "safe" softmax), not NaN.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from flame import reductions as R
from flame.amp.autocast_mode import lower_precision
from flame.backend import backend as use_backend
from flame.creation import tensor as constant
from flame.creation import zeros, zeros_like
from flame.functional import where
from flame.ir.shapes import ShapeError, broadcast_shapes
from flame.joining import cat
from flame.linalg import matmul
from flame.nn.convolution import linear
from flame.shaping import checked_tensor, shown, user_errors
from flame.tensor import Tensor
from flame.views import expand, reshape, transpose

__all__ = ["multi_head_attention_forward", "scaled_dot_product_attention"]


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
    from flame.random import _generator, _key

    state, local = _key(_generator(None), dropout_counters(q.shape, k.shape), q.backend)
    if not local:
        return state
    with use_backend(q.backend):
        return state + constant(np.array([0, local], dtype=np.int64))


# --- the functional form -----------------------------------------------------------------------


def multi_head_attention_forward(
    query: Tensor, key: Tensor, value: Tensor, embed_dim_to_check: int, num_heads: int,
    in_proj_weight, in_proj_bias, bias_k, bias_v, add_zero_attn: bool, dropout_p: float,
    out_proj_weight: Tensor, out_proj_bias, training: bool = True, key_padding_mask=None,
    need_weights: bool = True, attn_mask=None, use_separate_proj_weight: bool = False,
    q_proj_weight=None, k_proj_weight=None, v_proj_weight=None, static_k=None, static_v=None,
    average_attn_weights: bool = True, is_causal: bool = False,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """PyTorch's ``_functional().multi_head_attention_forward``: inputs [L, N, E] (or [L, E])."""
    if static_k is not None or static_v is not None:
        raise NotImplementedError("multi_head_attention_forward: static_k/static_v")
    is_batched = _shape_check(query, key, value, key_padding_mask, attn_mask, num_heads)
    if not is_batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    tgt_len, bsz, embed_dim = query.shape
    src_len = key.shape[0]
    key_padding_mask = _canonical_mask(
        key_padding_mask, "key_padding_mask", _dtype_or_none(attn_mask), "attn_mask",
        query.dtype,
    )  # fmt: skip
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer "
            "module method `generate_square_subsequent_mask` to create this mask."
        )
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # scaled_dot_product_attention makes the causal mask itself
    else:
        attn_mask = _canonical_mask(attn_mask, "attn_mask", None, "", query.dtype, False)
        if key_padding_mask is not None:
            is_causal = False
    head_dim = _check_dims(query, key, value, embed_dim_to_check, num_heads,
                           use_separate_proj_weight)  # fmt: skip
    if use_separate_proj_weight:
        q, k, v = _in_projection(query, key, value, q_proj_weight, k_proj_weight,
                                 v_proj_weight, in_proj_bias)  # fmt: skip
    else:
        if in_proj_weight is None:
            raise AssertionError("use_separate_proj_weight is False but in_proj_weight is None")
        q, k, v = _in_projection_packed(query, key, value, in_proj_weight, in_proj_bias)
    attn_mask = _batched_attn_mask(attn_mask, bsz * num_heads, tgt_len, src_len)
    k, v, attn_mask, key_padding_mask = _extend_keys(
        k, v, attn_mask, key_padding_mask, bias_k, bias_v, add_zero_attn, bsz * num_heads,
        head_dim, False,
    )  # fmt: skip
    q = q.reshape(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
    k = k.reshape(k.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    v = v.reshape(v.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    k, v, attn_mask, key_padding_mask = _extend_keys(
        k, v, attn_mask, key_padding_mask, None, None, add_zero_attn, bsz * num_heads,
        head_dim, True,
    )  # fmt: skip
    attn_mask = _merge_padding(attn_mask, key_padding_mask, bsz, num_heads, k.shape[1])
    if not training:
        dropout_p = 0.0
    heads = (tgt_len, bsz, num_heads, embed_dim)
    if need_weights:
        output, weights = _attend_with_weights(q, k, v, attn_mask, dropout_p, heads)
        output = linear(output, out_proj_weight, out_proj_bias).reshape(tgt_len, bsz, -1)
        if average_attn_weights:
            weights = weights.mean(dim=1)
        if not is_batched:
            return output.squeeze(1), weights.squeeze(0)
        return output, weights
    output = _attend_fused(q, k, v, attn_mask, dropout_p, is_causal, heads)
    output = linear(output, out_proj_weight, out_proj_bias).reshape(tgt_len, bsz, -1)
    return (output if is_batched else output.squeeze(1)), None


def _attend_with_weights(q, k, v, attn_mask, dropout_p: float, heads):
    """Softmax weights made explicitly: (output [L*N, E] before out_proj, weights
    [N, H, L, S])."""
    tgt_len, bsz, num_heads, embed_dim = heads
    q_scaled = q * math.sqrt(1.0 / float(q.shape[-1]))
    scores = q_scaled.bmm(k.transpose(-2, -1))
    if attn_mask is not None:
        scores = attn_mask + scores
    weights = _functional().softmax(scores, dim=-1)
    if dropout_p > 0.0:
        weights = _functional().dropout(weights, p=dropout_p)
    output = weights.bmm(v).transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
    return output, weights.reshape(bsz, num_heads, tgt_len, -1)


def _attend_fused(q, k, v, attn_mask, dropout_p: float, is_causal: bool, heads) -> Tensor:
    """The heads through ``scaled_dot_product_attention``: output [L*N, E] before out_proj."""
    from flame.nn.attention import scaled_dot_product_attention

    tgt_len, bsz, num_heads, embed_dim = heads
    src_len = k.shape[1]
    if attn_mask is not None:
        if attn_mask.shape[0] == 1 and attn_mask.ndim == 3:
            attn_mask = attn_mask.unsqueeze(0)
        else:
            attn_mask = attn_mask.reshape(bsz, num_heads, -1, src_len)
    q = q.reshape(bsz, num_heads, tgt_len, -1)
    k = k.reshape(bsz, num_heads, src_len, -1)
    v = v.reshape(bsz, num_heads, src_len, -1)
    output = scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
    return output.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim)


# --- projections and masks ---------------------------------------------------------------------


def _in_projection_packed(query, key, value, weight: Tensor, bias):
    """q, k, v from the packed [3E, E] weight: one matmul for self-attention, two for
    encoder-decoder attention (key is value), three otherwise."""
    embed_dim = query.shape[-1]
    if key is value:
        if query is key:
            projected = linear(query, weight, bias)
            return projected.chunk(3, -1)
        weight_q, weight_kv = weight.split([embed_dim, 2 * embed_dim])
        bias_q, bias_kv = (None, None) if bias is None else bias.split([embed_dim, 2 * embed_dim])
        key_value = linear(key, weight_kv, bias_kv)
        return (linear(query, weight_q, bias_q), *key_value.chunk(2, -1))
    weights = weight.chunk(3)
    biases = (None, None, None) if bias is None else bias.chunk(3)
    return tuple(linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))


def _in_projection(query, key, value, weight_q, weight_k, weight_v, bias):
    for name, weight in (("q", weight_q), ("k", weight_k), ("v", weight_v)):
        if weight is None:
            raise AssertionError(f"use_separate_proj_weight is True but {name}_proj_weight is None")
    biases = (None, None, None) if bias is None else bias.chunk(3)
    weights = (weight_q, weight_k, weight_v)
    return tuple(linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))


def _dtype_or_none(mask):
    return None if mask is None else mask.dtype


def _canonical_mask(mask, mask_name, other_type, other_name, target_type, check_other=True):
    """A bool mask as an additive float mask (-inf where ``True``); a float mask unchanged."""
    if mask is None:
        return None
    if not mask.dtype.is_bool and not mask.dtype.is_float:
        raise AssertionError(f"only bool and floating types of {mask_name} are supported")
    if check_other and other_type is not None and mask.dtype != other_type:
        warnings.warn(
            f"Support for mismatched {mask_name} and {other_name} "
            "is deprecated. Use same type for both instead.",
            stacklevel=3,
        )
    if mask.dtype.is_bool:
        mask = zeros_like(mask, dtype=target_type).masked_fill(mask, float("-inf"))
    return mask


def _batched_attn_mask(attn_mask, heads: int, tgt_len: int, src_len: int):
    """attn_mask as [1 or N*H, L, S], with PyTorch's shape errors."""
    if attn_mask is None:
        return None
    if attn_mask.ndim == 2:
        if tuple(attn_mask.shape) != (tgt_len, src_len):
            raise RuntimeError(
                f"The shape of the 2D attn_mask is {_size(attn_mask)}, but should be "
                f"{(tgt_len, src_len)}."
            )
        return attn_mask.unsqueeze(0)
    if attn_mask.ndim == 3:
        if tuple(attn_mask.shape) != (heads, tgt_len, src_len):
            raise RuntimeError(
                f"The shape of the 3D attn_mask is {_size(attn_mask)}, but should be "
                f"{(heads, tgt_len, src_len)}."
            )
        return attn_mask
    raise RuntimeError(f"attn_mask's dimension {attn_mask.ndim} is not supported")


def _extend_keys(k, v, attn_mask, key_padding_mask, bias_k, bias_v, add_zero_attn,
                 heads: int, head_dim: int, split: bool):  # fmt: skip
    """``bias_k``/``bias_v`` (before the heads are split, ``split=False``) and the zero key
    (after, ``split=True``) as one more key, the masks padded to match."""
    extra = False
    if not split:
        if (bias_k is None) != (bias_v is None):
            raise AssertionError(f"bias_{'k' if bias_v is None else 'v'} is set but "
                                 f"bias_{'v' if bias_v is None else 'k'} is None")  # fmt: skip
        if bias_k is not None:
            bsz = k.shape[1]
            k = cat([k, bias_k.repeat(1, bsz, 1)])
            v = cat([v, bias_v.repeat(1, bsz, 1)])
            extra = True
    elif add_zero_attn:
        zero = zeros((heads, 1, head_dim), dtype=k.dtype, device=k.device)
        k = cat([k, zero], dim=1)
        v = cat([v, zeros((heads, 1, head_dim), dtype=v.dtype, device=v.device)], dim=1)
        extra = True
    if extra:
        if attn_mask is not None:
            attn_mask = _functional().pad(attn_mask, (0, 1))
        if key_padding_mask is not None:
            key_padding_mask = _functional().pad(key_padding_mask, (0, 1))
    return k, v, attn_mask, key_padding_mask


def _merge_padding(attn_mask, key_padding_mask, bsz: int, num_heads: int, src_len: int):
    """attn_mask + key_padding_mask [N, S] spread over the heads: [N*H, 1, S]."""
    if key_padding_mask is None:
        return attn_mask
    if key_padding_mask.shape[0] != bsz:
        raise AssertionError(
            f"Expected key_padded_mask.shape[0] to be {bsz}, but got {key_padding_mask.shape[0]}"
        )
    if key_padding_mask.shape[1] != src_len:
        raise AssertionError(
            f"Expected key_padded_mask.shape[1] to be {src_len}, but got "
            f"{key_padding_mask.shape[1]}"
        )
    spread = key_padding_mask.reshape(bsz, 1, 1, src_len).expand(-1, num_heads, -1, -1)
    spread = spread.reshape(bsz * num_heads, 1, src_len)
    return spread if attn_mask is None else attn_mask + spread


def _check_dims(query, key, value, embed_dim_to_check, num_heads, separate: bool) -> int:
    embed_dim = query.shape[-1]
    if embed_dim != embed_dim_to_check:
        raise AssertionError(
            f"was expecting embedding dimension of {embed_dim_to_check}, but got {embed_dim}"
        )
    head_dim = embed_dim // num_heads
    if head_dim * num_heads != embed_dim:
        raise AssertionError(f"embed_dim {embed_dim} not divisible by num_heads {num_heads}")
    if separate and tuple(key.shape[:2]) != tuple(value.shape[:2]):
        raise AssertionError(
            f"key's sequence and batch dims {_size(key, 2)} do not match value's {_size(value, 2)}"
        )
    if not separate and tuple(key.shape) != tuple(value.shape):
        raise AssertionError(f"key shape {_size(key)} does not match value shape {_size(value)}")
    return head_dim


def _size(tensor: Tensor, count: int | None = None) -> str:
    """A shape as PyTorch prints a ``torch.Size``."""
    return f"flame.Size({list(tensor.shape[:count])})"


def _shape_check(query, key, value, key_padding_mask, attn_mask, num_heads) -> bool:
    """PyTorch's ``_mha_shape_check``: whether the inputs are batched."""
    if query.ndim not in (2, 3):
        raise AssertionError(
            "query should be unbatched 2D or batched 3D tensor but received "
            f"{query.ndim}-D query tensor"
        )
    batched = query.ndim == 3
    kind = "batched (3-D)" if batched else "unbatched (2-D)"
    rank = query.ndim
    if key.ndim != rank or value.ndim != rank:
        raise AssertionError(
            f"For {kind} `query`, expected `key` and `value` to be {rank}-D but found "
            f"{key.ndim}-D and {value.ndim}-D tensors respectively"
        )
    if key_padding_mask is not None and key_padding_mask.ndim != rank - 1:
        raise AssertionError(
            f"For {kind} `query`, expected `key_padding_mask` to be `None` or {rank - 1}-D but "
            f"found {key_padding_mask.ndim}-D tensor instead"
        )
    if attn_mask is not None and attn_mask.ndim not in (2, 3):
        raise AssertionError(
            f"For {kind} `query`, expected `attn_mask` to be `None`, 2-D or 3-D but found "
            f"{attn_mask.ndim}-D tensor instead"
        )
    if not batched and attn_mask is not None and attn_mask.ndim == 3:
        expected = (num_heads, query.shape[0], key.shape[0])
        if tuple(attn_mask.shape) != expected:
            raise AssertionError(
                f"Expected `attn_mask` shape to be {expected} but got {_size(attn_mask)}"
            )
    return batched
