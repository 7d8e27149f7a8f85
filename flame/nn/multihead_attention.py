"""``multi_head_attention_forward``: the functional core of ``nn.MultiheadAttention``, as
PyTorch's (in-projection, heads, masks, out-projection; with ``need_weights=False`` the heads
go through ``scaled_dot_product_attention`` of flame/nn/attention.py, fused where it can be,
and PyTorch's ``is_causal`` hint and error types are kept).
"""

from __future__ import annotations

import math
import warnings

from flame.creation import zeros, zeros_like
from flame.joining import cat
from flame.nn.attention import _functional, scaled_dot_product_attention
from flame.nn.convolution import linear
from flame.tensor import Tensor

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
    if bias_k is not None and bias_v is not None:
        if static_k is not None:
            raise AssertionError("bias cannot be added to static key.")
        if static_v is not None:
            raise AssertionError("bias cannot be added to static value.")
    k, v, attn_mask, key_padding_mask = _extend_keys(
        k, v, attn_mask, key_padding_mask, bias_k, bias_v, add_zero_attn, bsz * num_heads,
        head_dim, False,
    )  # fmt: skip
    q = q.reshape(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
    k = _heads_of("static_k", static_k, k, bsz * num_heads, head_dim)
    v = _heads_of("static_v", static_v, v, bsz * num_heads, head_dim)
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


def _heads_of(name: str, static, projected: Tensor, heads: int, head_dim: int) -> Tensor:
    """Keys (or values) by head, [N*H, S, head_dim]: the projection's, or ``static`` (given
    whole, in place of the projection; PyTorch's checks and messages)."""
    if static is None:
        return projected.reshape(projected.shape[0], heads, head_dim).transpose(0, 1)
    if static.ndim != 3:
        raise AssertionError(f"expecting {name} of 3 dimensions, but got {static.ndim}")
    if static.shape[0] != heads:
        raise AssertionError(f"expecting {name}.size(0) of {heads}, but got {static.shape[0]}")
    if static.shape[2] != head_dim:
        raise AssertionError(f"expecting {name}.size(2) of {head_dim}, but got {static.shape[2]}")
    return static


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
