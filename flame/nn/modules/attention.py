"""``MultiheadAttention`` (its functional form, ``F.multi_head_attention_forward``, is in
flame/nn/multihead_attention.py), as PyTorch's: the same constructor arguments, parameter names and
shapes (``in_proj_weight``
[3E, E] or ``q/k/v_proj_weight`` when ``kdim``/``vdim`` differ, ``in_proj_bias`` [3E],
``out_proj.weight``/``out_proj.bias``, ``bias_k``/``bias_v`` [1, 1, E]), initialisation
(xavier_uniform_ projections, zero biases) and results.

With ``need_weights=True`` the scores are computed explicitly (``mask + q @ k.T / sqrt(d)``,
softmax, dropout, ``@ v``) so the weights can be returned, averaged over heads unless
``average_attn_weights=False``; with ``need_weights=False`` the heads go through
``scaled_dot_product_attention`` (one fused attention op), as PyTorch's do. PyTorch's
inference fast path (``_native_multi_head_attention``) computes the same values and is not
a separate path here. Boolean masks are ``True`` where attention is *not* allowed.
"""

from __future__ import annotations

from flame.nn import init
from flame.nn.modules.linear import Linear, empty_parameter
from flame.nn.modules.module import Module
from flame.nn.multihead_attention import (
    _canonical_mask,
    _dtype_or_none,
    multi_head_attention_forward,
)
from flame.tensor import Tensor

# (NonDynamicallyQuantizableLinear and the functional form are not flame.nn names, as in
# PyTorch: the module's out_proj class, and F.multi_head_attention_forward)
__all__ = ["MultiheadAttention"]


class NonDynamicallyQuantizableLinear(Linear):
    """PyTorch's name for ``MultiheadAttention.out_proj`` (a ``Linear``; the name shows in
    ``repr``)."""


class MultiheadAttention(Module):
    """Attention from ``query`` to ``key``/``value`` over ``num_heads`` heads of
    ``embed_dim // num_heads`` features: inputs [L, N, E] ([N, L, E] with ``batch_first``,
    [L, E] unbatched)."""

    __constants__ = ["batch_first"]

    def __init__(
        self,
        embed_dim,
        num_heads,
        dropout=0.0,
        bias=True,
        add_bias_kv=False,
        add_zero_attn=False,
        kdim=None,
        vdim=None,
        batch_first=False,
        device=None,
        dtype=None,
    ) -> None:
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                f"embed_dim and num_heads must be greater than 0,"
                f" got embed_dim={embed_dim} and num_heads={num_heads} instead"
            )
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        if self.head_dim * num_heads != self.embed_dim:
            raise AssertionError("embed_dim must be divisible by num_heads")
        self._make_parameters(bias, add_bias_kv, device, dtype)
        self.add_zero_attn = add_zero_attn
        self._reset_parameters()

    def _make_parameters(self, bias: bool, add_bias_kv: bool, device, dtype) -> None:
        embed_dim = self.embed_dim
        if not self._qkv_same_embed_dim:
            self.q_proj_weight = empty_parameter((embed_dim, embed_dim), device, dtype)
            self.k_proj_weight = empty_parameter((embed_dim, self.kdim), device, dtype)
            self.v_proj_weight = empty_parameter((embed_dim, self.vdim), device, dtype)
            self.register_parameter("in_proj_weight", None)
        else:
            self.in_proj_weight = empty_parameter((3 * embed_dim, embed_dim), device, dtype)
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        if bias:
            self.in_proj_bias = empty_parameter((3 * embed_dim,), device, dtype)
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(
            embed_dim, embed_dim, bias=bias, device=device, dtype=dtype
        )
        if add_bias_kv:
            self.bias_k = empty_parameter((1, 1, embed_dim), device, dtype)
            self.bias_v = empty_parameter((1, 1, embed_dim), device, dtype)
        else:
            self.bias_k = self.bias_v = None

    def _reset_parameters(self) -> None:
        if self._qkv_same_embed_dim:
            init.xavier_uniform_(self.in_proj_weight)
        else:
            init.xavier_uniform_(self.q_proj_weight)
            init.xavier_uniform_(self.k_proj_weight)
            init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            init.constant_(self.in_proj_bias, 0.0)
            init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            init.xavier_normal_(self.bias_k)
        if self.bias_v is not None:
            init.xavier_normal_(self.bias_v)

    def __setstate__(self, state):
        if "_qkv_same_embed_dim" not in state:
            state["_qkv_same_embed_dim"] = True
        super().__setstate__(state)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        is_batched = query.ndim == 3
        key_padding_mask = _canonical_mask(
            key_padding_mask, "key_padding_mask", _dtype_or_none(attn_mask), "attn_mask",
            query.dtype,
        )  # fmt: skip
        attn_mask = _canonical_mask(attn_mask, "attn_mask", None, "", query.dtype, False)
        if self.batch_first and is_batched:
            query, key, value = _sequence_first(query, key, value)
        separate = not self._qkv_same_embed_dim
        output, weights = multi_head_attention_forward(
            query, key, value, self.embed_dim, self.num_heads, self.in_proj_weight,
            self.in_proj_bias, self.bias_k, self.bias_v, self.add_zero_attn, self.dropout,
            self.out_proj.weight, self.out_proj.bias, training=self.training,
            key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
            use_separate_proj_weight=separate, q_proj_weight=self.q_proj_weight,
            k_proj_weight=self.k_proj_weight, v_proj_weight=self.v_proj_weight,
            average_attn_weights=average_attn_weights, is_causal=is_causal,
        )  # fmt: skip
        if self.batch_first and is_batched:
            output = output.transpose(1, 0)
        return output, weights


def _sequence_first(query: Tensor, key: Tensor, value: Tensor):
    """[N, L, E] -> [L, N, E], keeping ``query is key is value`` (self-attention packs its
    projection into one matmul)."""
    if key is value:
        if query is key:
            query = key = value = query.transpose(1, 0)
        else:
            query, key = (x.transpose(1, 0) for x in (query, key))
            value = key
        return query, key, value
    return tuple(x.transpose(1, 0) for x in (query, key, value))
