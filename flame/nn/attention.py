"""Attention with PyTorch's signatures: ``scaled_dot_product_attention`` (PyTorch's math
reference: matmul, mask, softmax, dropout, matmul) and ``multi_head_attention_forward`` (the
functional core of ``nn.MultiheadAttention``: in-projection, heads, masks, out-projection).

Written with public FLAME ops, so they have autograd and run on every backend; the fused
(flash) attention kernel is a later issue. As PyTorch's math path, a row whose every key is
masked gives zeros (a "safe" softmax), not NaN; dropout draws from FLAME's generator.
"""

from __future__ import annotations

import math

import numpy as np

from flame import reductions as R
from flame.amp.autocast_mode import lower_precision
from flame.backend import backend as use_backend
from flame.creation import tensor as constant
from flame.creation import zeros
from flame.functional import where
from flame.ir.shapes import ShapeError
from flame.joining import cat, pad
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
    if enable_gqa:
        key, value = _repeat_heads(key, query.shape[-3]), _repeat_heads(value, query.shape[-3])
    factor = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
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


# --- multi-head attention ----------------------------------------------------------------------


def _float_mask(mask, name: str, dtype) -> Tensor | None:
    """PyTorch's ``_canonical_mask``: a bool mask (True: masked out) as 0 / -inf."""
    if mask is None:
        return None
    checked_tensor("multi_head_attention_forward", mask)
    if mask.dtype.is_float:
        return mask
    if not mask.dtype.is_bool:
        raise TypeError(
            f"multi_head_attention_forward: only bool and floating {name} are supported, "
            f"got {mask.dtype.name}"
        )
    return where(mask, -math.inf, 0.0).to(dtype)


def _in_projection(query, key, value, in_proj_weight, in_proj_bias, separate):
    """q, k, v projected: one packed [3E, E] weight, or three separate ones."""
    embed = query.shape[-1]
    if separate is None:
        weights = [in_proj_weight[index * embed : (index + 1) * embed] for index in range(3)]
    else:
        weights = list(separate)
    if in_proj_bias is None:
        biases = [None, None, None]
    else:
        biases = [in_proj_bias[index * embed : (index + 1) * embed] for index in range(3)]
    return tuple(
        linear(tensor, weight, bias)
        for tensor, weight, bias in zip((query, key, value), weights, biases)
    )


def _check_mha(query, key, value, embed_dim_to_check, num_heads, separate) -> None:
    op = "multi_head_attention_forward"
    for tensor in (query, key, value):
        checked_tensor(op, tensor)
        if tensor.ndim != query.ndim or tensor.ndim not in (2, 3):
            raise ShapeError(
                f"{op}: query, key and value must all be 2-d (unbatched) or 3-d [L, N, E], got "
                f"query {shown(query)}, key {shown(key)}, value {shown(value)}"
            )
    embed = query.shape[-1]
    if embed != embed_dim_to_check:
        raise ShapeError(
            f"{op}: expected embedding dim {embed_dim_to_check}, got query {shown(query)}"
        )
    if embed % num_heads:
        raise ValueError(f"{op}: embed_dim {embed} is not divisible by num_heads {num_heads}")
    if query.ndim == 3 and not (query.shape[1] == key.shape[1] == value.shape[1]):
        raise ShapeError(
            f"{op}: query {shown(query)}, key {shown(key)} and value {shown(value)} must share "
            "the batch dim (1)"
        )
    shapes_differ = key.shape[:-1] != value.shape[:-1] if separate else key.shape != value.shape
    if shapes_differ:
        raise ShapeError(f"{op}: key {shown(key)} does not match value {shown(value)}")


def _attention_mask(attn_mask, target, source, batch_heads) -> Tensor | None:
    """The mask as [1 or N*H, L, S]."""
    if attn_mask is None:
        return None
    if attn_mask.ndim == 2:
        if attn_mask.shape != (target, source):
            raise ShapeError(
                f"multi_head_attention_forward: the 2-d attn_mask is {shown(attn_mask)}, but "
                f"should be [{target}, {source}]"
            )
        return reshape(attn_mask, (1, target, source))
    if attn_mask.ndim != 3 or attn_mask.shape != (batch_heads, target, source):
        raise ShapeError(
            f"multi_head_attention_forward: attn_mask {shown(attn_mask)} should be "
            f"[{target}, {source}] or [{batch_heads}, {target}, {source}]"
        )
    return attn_mask


def _heads(tensor: Tensor, batch_heads: int, head_dim: int) -> Tensor:
    """[S, N, E] -> [N*H, S, E/H]."""
    return transpose(reshape(tensor, (tensor.shape[0], batch_heads, head_dim)), 0, 1)


def _static(static, batch_heads: int, head_dim: int, name: str) -> Tensor:
    if static.ndim != 3 or static.shape[0] != batch_heads or static.shape[2] != head_dim:
        raise ShapeError(
            f"multi_head_attention_forward: {name} must be [{batch_heads}, S, {head_dim}], "
            f"got {shown(static)}"
        )
    return static


@user_errors
def multi_head_attention_forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    embed_dim_to_check: int,
    num_heads: int,
    in_proj_weight: Tensor | None,
    in_proj_bias: Tensor | None,
    bias_k: Tensor | None,
    bias_v: Tensor | None,
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight: Tensor,
    out_proj_bias: Tensor | None,
    training: bool = True,
    key_padding_mask: Tensor | None = None,
    need_weights: bool = True,
    attn_mask: Tensor | None = None,
    use_separate_proj_weight: bool = False,
    q_proj_weight: Tensor | None = None,
    k_proj_weight: Tensor | None = None,
    v_proj_weight: Tensor | None = None,
    static_k: Tensor | None = None,
    static_v: Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
):
    """PyTorch's ``F.multi_head_attention_forward``: query [L, N, E] (or [L, E]), key and
    value [S, N, E]; returns (output [L, N, E], weights [N, L, S] averaged over heads, or
    [N, H, L, S], or None without ``need_weights``). Bool masks: True masks a position out."""
    separate = (q_proj_weight, k_proj_weight, v_proj_weight) if use_separate_proj_weight else None
    _check_mha(query, key, value, embed_dim_to_check, num_heads, separate)
    if separate is None and in_proj_weight is None:
        raise ValueError("multi_head_attention_forward: in_proj_weight is None and "
                         "use_separate_proj_weight is False")  # fmt: skip
    if separate is not None and any(weight is None for weight in separate):
        raise ValueError("multi_head_attention_forward: use_separate_proj_weight needs "
                         "q_proj_weight, k_proj_weight and v_proj_weight")  # fmt: skip
    if is_causal and attn_mask is None:
        raise ValueError(
            "multi_head_attention_forward: specifying the is_causal hint needs attn_mask"
        )
    batched = query.ndim == 3
    if not batched:
        query, key, value = (reshape(t, (t.shape[0], 1, t.shape[1])) for t in (query, key, value))
        if key_padding_mask is not None:
            key_padding_mask = reshape(key_padding_mask, (1, *key_padding_mask.shape))
    key_padding_mask = _float_mask(key_padding_mask, "key_padding_mask", query.dtype)
    attn_mask = _float_mask(attn_mask, "attn_mask", query.dtype)
    q, k, v = _in_projection(query, key, value, in_proj_weight, in_proj_bias, separate)
    target, batch, embed = query.shape
    head_dim = embed // num_heads
    batch_heads = batch * num_heads
    attn_mask = _attention_mask(attn_mask, target, key.shape[0], batch_heads)
    k, v, attn_mask, key_padding_mask = _extra_keys(
        k, v, attn_mask, key_padding_mask, bias_k, bias_v, static_k, static_v, add_zero_attn,
        batch, num_heads, head_dim,
    )  # fmt: skip
    source = k.shape[1]
    if key_padding_mask is not None:
        if key_padding_mask.shape != (batch, source):
            raise ShapeError(
                f"multi_head_attention_forward: key_padding_mask {shown(key_padding_mask)} "
                f"should be [{batch}, {source}]"
            )
        spread = expand(
            reshape(key_padding_mask, (batch, 1, 1, source)), (batch, num_heads, 1, source)
        )
        spread = reshape(spread, (batch_heads, 1, source))
        attn_mask = spread if attn_mask is None else attn_mask + spread
    q = _heads(q, batch_heads, head_dim)
    weights = matmul(q * math.sqrt(1.0 / head_dim), transpose(k, -2, -1))
    if attn_mask is not None:
        weights = weights + attn_mask
    # PyTorch: without need_weights the fused path runs, whose softmax is the safe one
    weights = _safe_softmax(weights, attn_mask is not None and not need_weights)
    if training and dropout_p > 0.0:
        weights = _functional().dropout(weights, dropout_p, training=True)
    output = matmul(weights, v)  # [N*H, L, E/H]
    output = reshape(transpose(output, 0, 1), (target * batch, embed))
    output = reshape(linear(output, out_proj_weight, out_proj_bias), (target, batch, -1))
    if not batched:
        output = reshape(output, (target, output.shape[2]))
    if not need_weights:
        return output, None
    weights = reshape(weights, (batch, num_heads, target, source))
    if average_attn_weights:
        weights = R.mean(weights, 1)
    if not batched:
        weights = reshape(weights, weights.shape[1:])
    return output, weights


def _extra_keys(k, v, attn_mask, padding, bias_k, bias_v, static_k, static_v, add_zero_attn,
                batch, num_heads, head_dim):  # fmt: skip
    """bias_k/bias_v appended as one more key, static keys/values, the zero key; each extra
    key widens the masks by an unmasked column. Returns k, v as [N*H, S, E/H]."""
    if (bias_k is None) != (bias_v is None):
        raise ValueError("multi_head_attention_forward: give both bias_k and bias_v, or neither")
    if bias_k is not None:
        if static_k is not None or static_v is not None:
            raise ValueError("multi_head_attention_forward: bias cannot be added to static keys")
        embed = k.shape[2]
        k = cat([k, expand(reshape(bias_k, (1, 1, embed)), (1, batch, embed))])
        v = cat([v, expand(reshape(bias_v, (1, 1, embed)), (1, batch, embed))])
        attn_mask = None if attn_mask is None else pad(attn_mask, (0, 1))
        padding = None if padding is None else pad(padding, (0, 1))
    batch_heads = batch * num_heads
    k = (
        _heads(k, batch_heads, head_dim)
        if static_k is None
        else _static(static_k, batch_heads, head_dim, "static_k")
    )
    v = (
        _heads(v, batch_heads, head_dim)
        if static_v is None
        else _static(static_v, batch_heads, head_dim, "static_v")
    )
    if add_zero_attn:
        with use_backend(k.backend):
            zero = zeros((batch_heads, 1, head_dim), dtype=k.dtype)
        k, v = cat([k, zero], 1), cat([v, zero.to(v.dtype)], 1)
        attn_mask = None if attn_mask is None else pad(attn_mask, (0, 1))
        padding = None if padding is None else pad(padding, (0, 1))
    return k, v, attn_mask, padding
