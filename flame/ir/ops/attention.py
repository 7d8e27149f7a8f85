"""Fused attention as two library ops: ``attention`` (forward) and ``attention_backward``.

``attention(q, k, v[, bias], scale=, causal=)``: q [B, Hq, Lq, D], k [B, Hk, Lk, D],
v [B, Hk, Lk, Dv] with ``Hq % Hk == 0`` (grouped-query attention: query head h reads key and
value head ``h // (Hq // Hk)``), an optional additive ``bias`` of q's dtype that broadcasts to
[B, Hq, Lq, Lk] (a mask: ``-inf`` removes a key), ``causal`` (PyTorch's top-left rule: key j
is removed for query i when j > i). A query row whose every key is removed gives 0.

An op has one result, and the backward needs two values of the forward: the output O and
each row's log-sum-exp of the scores (the softmax statistics, float32). So the result is one
flat buffer of q's dtype holding O ([B, Hq, Lq, Dv], C order) followed by the statistics,
``stats_slots(dtype)`` elements per row (a float32 in two 16-bit slots; the ``slots``
attribute says how many, so the reference, which sees arrays in compute precision, knows).
The front end (``flame/nn/attention.py``) hands the user O, a view of the buffer's head; only
``attention_backward`` reads the tail. The same trick packs the backward's three results:
``attention_backward(q, k, v, out, dO[, bias])`` is one flat buffer holding dQ, dK, dV.

No [Lq, Lk] matrix is ever stored on the GPU: cuDNN's fused attention (flash class) runs the
ops, or FLAME's own flash-attention kernel where cuDNN refuses a case or is absent
(``flame/runtime/library_attention.py``). The references compute in float64 and materialise
the scores; their statistics slots are not meant to be read (the reference backward
recomputes what it needs), so only the O part of a forward result is compared with a GPU's.

Dropout (``dropout=p > 0``, PyTorch's ``dropout_p``): the softmax probabilities (after the
masks) are dropped with probability ``p`` and the kept ones scaled by ``1 / (1 - p)``; the
statistics stay those of the undropped softmax. The op then takes one more input, last: an
int64 [2] tensor (seed, offset) from FLAME's generator (flame/random.py), and
``attention_backward`` takes the same tensor, so both draw the same mask. The mask is a pure
function of (seed, offset, b, h, i, j): element (b, h, i, j) of [B, Hq, Lq, Lk] keeps its value
when ``u >= p``, u the 24 random bits of Philox word ``2 (i % 2) + j % 2`` of counter
``offset + (((b Hq + h) ceil(Lq/2) + i // 2) ceil(Lk/2) + j // 2)`` (key ``seed``) times 2**-24:
one Philox call serves a 2 x 2 block of scores, which both the forward kernel (rows = queries)
and the backward kernel (rows = keys) hold two of in one thread (``dropout_keep``). A draw
takes ``dropout_counters`` counters of the generator.
"""

from __future__ import annotations

import numpy as np

from flame.ir.ops.leaves import philox4x32
from flame.ir.ops.registry import def_op, def_vjp
from flame.ir.shapes import ShapeError

FLOATS = ("float16", "bfloat16", "float32", "float64")


def stats_slots(dtype) -> int:
    """Elements of ``dtype`` that hold one row's float32 statistic in a packed result."""
    return max(1, 4 // dtype.itemsize)


def output_count(q_shape, v_shape) -> int:
    """Elements of the O part of a packed attention result."""
    batch, heads, length, _ = q_shape
    return batch * heads * length * v_shape[-1]


def _shown(node) -> str:
    return f"{node.dtype.name}{list(node.shape)}"


def _check_qkv(op: str, q, k, v, bias) -> None:
    nodes = (q, k, v) + ((bias,) if bias is not None else ())
    for node in nodes:
        if node.dtype.name not in FLOATS:
            raise TypeError(f"{op}: needs float tensors, got {_shown(node)}")
        if node.dtype is not q.dtype:
            raise TypeError(
                f"{op}: query, key, value (and bias) must share one dtype, got "
                + ", ".join(_shown(node) for node in nodes)
            )
    shown = f"query {_shown(q)}, key {_shown(k)}, value {_shown(v)}"
    if len(q.shape) != 4 or len(k.shape) != 4 or len(v.shape) != 4:
        raise ShapeError(f"{op}: expected 4-d [batch, heads, length, dim] tensors, got {shown}")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ShapeError(
            f"{op}: batch, key/value lengths and query/key head dims must agree, got {shown}"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ShapeError(
            f"{op}: query heads ({q.shape[1]}) must be a multiple of key/value heads "
            f"({k.shape[1]}), got {shown}"
        )
    if bias is not None:
        target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        if len(bias.shape) != 4 or any(
            size not in (1, full) for size, full in zip(bias.shape, target)
        ):
            raise ShapeError(
                f"{op}: bias {_shown(bias)} does not broadcast to [batch, heads, query length, "
                f"key length] = {list(target)} ({shown})"
            )


def _split(inputs, count: int):
    if len(inputs) not in (count, count + 1):
        raise TypeError(f"expected {count} or {count + 1} inputs, got {len(inputs)}")
    return tuple(inputs[:count]), (inputs[count] if len(inputs) > count else None)


def split_inputs(inputs, count: int, dropout) -> tuple:
    """(the ``count`` leading inputs, the bias or None, the (seed, offset) input or None): the
    random state comes last, and only with dropout."""
    inputs = tuple(inputs)
    rng = None
    if dropout:
        if not inputs:
            raise TypeError("expected the (seed, offset) input last with dropout")
        rng, inputs = inputs[-1], inputs[:-1]
    main, bias = _split(inputs, count)
    return main, bias, rng


def _check_dropout(op: str, dropout, rng) -> None:
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise TypeError(f"{op}: dropout must be a float in [0, 1], got {dropout!r}")
    if not 0.0 <= dropout <= 1.0:
        raise ValueError(f"{op}: dropout must be in [0, 1], got {dropout}")
    if rng is not None and (rng.dtype.name != "int64" or tuple(rng.shape) != (2,)):
        raise TypeError(
            f"{op}: with dropout the last input must be the int64[2] (seed, offset) of a "
            f"generator, got {_shown(rng)}"
        )


def _attention_rule(inputs, attrs):
    dropout = attrs.get("dropout", 0.0)
    (q, k, v), bias, rng = split_inputs(inputs, 3, dropout)
    _check_dropout("attention", dropout, rng)
    _check_qkv("attention", q, k, v, bias)
    if attrs.get("slots") != stats_slots(q.dtype):
        raise ValueError(
            f"attention: slots must be {stats_slots(q.dtype)} for {q.dtype.name}, "
            f"got {attrs.get('slots')}"
        )
    rows = q.shape[0] * q.shape[1] * q.shape[2]
    return q.dtype, (output_count(q.shape, v.shape) + rows * stats_slots(q.dtype),)


def _backward_rule(inputs, attrs):
    dropout = attrs.get("dropout", 0.0)
    (q, k, v, out, d_out), bias, rng = split_inputs(inputs, 5, dropout)
    _check_dropout("attention_backward", dropout, rng)
    _check_qkv("attention_backward", q, k, v, bias)
    o_shape = (*q.shape[:3], v.shape[3])
    if tuple(d_out.shape) != o_shape or d_out.dtype is not q.dtype:
        raise ShapeError(
            f"attention_backward: the output gradient {_shown(d_out)} must be "
            f"{q.dtype.name}{list(o_shape)}"
        )
    sizes = (q.shape, k.shape, v.shape)
    return q.dtype, (sum(int(np.prod(shape)) for shape in sizes),)


# --- references (float64, the scores materialised) ---------------------------------------------


def _probabilities(q, k, bias, scale: float, causal: bool):
    """(P, keep): softmax probabilities [B, Hq, Lq, Lk] (0 on rows with no key) and the rows'
    log-sum-exp."""
    groups = q.shape[1] // k.shape[1]
    keys = np.repeat(k, groups, axis=1)
    scores = scale * (q @ np.swapaxes(keys, -1, -2))
    if bias is not None:
        scores = scores + bias
    if causal:
        lq, lk = scores.shape[-2:]
        scores = np.where(np.triu(np.ones((lq, lk), bool), 1), -np.inf, scores)
    top = np.max(scores, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    weights = np.exp(scores - top)
    total = weights.sum(axis=-1, keepdims=True)
    probabilities = np.divide(weights, total, out=np.zeros_like(weights), where=total > 0)
    with np.errstate(divide="ignore"):
        lse = np.log(total[..., 0]) + top[..., 0]
    return probabilities, lse


def _lifted(*arrays):
    return [None if array is None else np.asarray(array, np.float64) for array in arrays]


# --- dropout's mask ----------------------------------------------------------------------------

_UINT64 = (1 << 64) - 1


def dropout_counters(q_shape, k_shape) -> int:
    """Counters of the generator one mask takes: one a 2 x 2 block of the scores."""
    batch, heads, lq = q_shape[:3]
    return batch * heads * (-(-lq // 2)) * (-(-k_shape[2] // 2))


def keep_scale(p: float) -> float:
    """What a kept probability is multiplied by: 1 / (1 - p) (0 at p = 1: nothing is kept)."""
    return 1.0 / (1.0 - p) if p < 1.0 else 0.0


def dropout_keep(rng, shape, p: float) -> np.ndarray:
    """The mask (True: kept) of the [B, Hq, Lq, Lk] scores drawn from ``rng`` = (seed,
    offset): element (b, h, i, j) is kept when u >= p, u the 24 bits of Philox word
    2 (i % 2) + j % 2 of counter offset + ((b Hq + h) ceil(Lq/2) + i // 2) ceil(Lk/2) + j // 2
    times 2**-24 (FLAME's Philox, keyed by the seed, as ``rand`` draws)."""
    seed, offset = (int(value) for value in np.asarray(rng).astype(np.int64).reshape(2))
    batch, heads, lq, lk = shape
    rows, cols = np.uint64(-(-lq // 2)), np.uint64(-(-lk // 2))
    head = np.arange(batch * heads, dtype=np.uint64).reshape(batch, heads, 1, 1)
    query = np.arange(lq, dtype=np.uint64).reshape(1, 1, lq, 1)
    key = np.arange(lk, dtype=np.uint64).reshape(1, 1, 1, lk)
    block = (head * rows + query // np.uint64(2)) * cols + key // np.uint64(2)
    words = philox4x32(block + np.uint64(offset & _UINT64), seed & _UINT64)
    pick = np.broadcast_to(2 * (query % np.uint64(2)) + key % np.uint64(2), block.shape)
    word = np.choose(pick.astype(np.intp), words)
    uniform = (word >> np.uint32(8)).astype(np.float64) * (1.0 / (1 << 24))
    return uniform >= p


def _dropped(weights, dropout: float, rng):
    """``weights`` [B, Hq, Lq, Lk] with dropout's mask applied and the kept ones scaled."""
    if not dropout:
        return weights
    keep = dropout_keep(rng, weights.shape, dropout)
    return np.where(keep, weights * keep_scale(dropout), 0.0)


def _attention_ref(q, k, v, bias=None, scale=1.0, causal=False, dropout=0.0, rng=None):
    q, k, v, bias = _lifted(q, k, v, bias)
    probabilities, lse = _probabilities(q, k, bias, scale, causal)
    weights = _dropped(probabilities, dropout, rng)
    out = weights @ np.repeat(v, q.shape[1] // k.shape[1], axis=1)
    return out, lse


def _attention_packed_ref(*inputs, scale=1.0, causal=False, slots=1, dropout=0.0):
    (q, k, v), bias, rng = split_inputs(inputs, 3, dropout)
    out, lse = _attention_ref(q, k, v, bias, scale, causal, dropout, rng)
    return np.concatenate([out.ravel(), np.repeat(lse.ravel(), slots)])


def _attention_backward_ref(*inputs, scale=1.0, causal=False, dropout=0.0):
    (q, k, v, _out, d_out), bias, rng = split_inputs(inputs, 5, dropout)
    q, k, v, d_out, bias = _lifted(q, k, v, d_out, bias)
    groups = q.shape[1] // k.shape[1]
    probabilities, _ = _probabilities(q, k, bias, scale, causal)
    values = np.repeat(v, groups, axis=1)
    weights = _dropped(probabilities, dropout, rng)  # what multiplied V
    out = weights @ values
    d_values = np.swapaxes(weights, -1, -2) @ d_out
    # through the dropout (the same mask and scale) back to the probabilities; the row sums
    # sum(dP * P) equal sum(dO * O) with dropout too
    d_probabilities = _dropped(d_out @ np.swapaxes(values, -1, -2), dropout, rng)
    d_scores = probabilities * (d_probabilities - np.sum(d_out * out, axis=-1, keepdims=True))
    d_q = scale * (d_scores @ np.repeat(k, groups, axis=1))
    d_keys = scale * (np.swapaxes(d_scores, -1, -2) @ q)

    def per_kv_head(array):  # sum the query heads that share a key/value head
        return array.reshape(array.shape[0], k.shape[1], groups, *array.shape[2:]).sum(axis=2)

    return np.concatenate([d_q.ravel(), per_kv_head(d_keys).ravel(), per_kv_head(d_values).ravel()])


def_op(
    "attention", "library", -1, ref=_attention_packed_ref, shape_rule=_attention_rule,
    attrs={"scale": 1.0, "causal": False, "slots": 1, "dropout": 0.0}, categories="f",
    doc="fused attention: O (and the softmax statistics the backward reads) in one buffer",
)  # fmt: skip
def_op(
    "attention_backward", "library", -1, ref=_attention_backward_ref,
    shape_rule=_backward_rule, attrs={"scale": 1.0, "causal": False, "dropout": 0.0},
    categories="f",
    differentiable=False, internal=True,
    doc="dQ, dK and dV of fused attention, in one buffer",
)  # fmt: skip


# --- backward rule -----------------------------------------------------------------------------


def unpack(F, packed, shapes):
    """Views of consecutive C-ordered tensors of ``shapes`` at the head of a flat ``packed``."""
    views, start = [], 0
    for shape in shapes:
        count = int(np.prod(shape))
        views.append(F.reshape(F.narrow(packed, 0, start, count), tuple(shape)))
        start += count
    return views


def _attention_vjp(F, g, out, *inputs, scale=1.0, causal=False, slots=1, dropout=0.0):
    from flame.tensor import apply_op

    (q, k, v), bias, rng = split_inputs(inputs, 3, dropout)
    (d_out,) = unpack(F, g, [(*q.shape[:3], v.shape[3])])
    extra = tuple(value for value in (bias, rng) if value is not None)
    # the same (seed, offset) tensor: the backward draws the forward's mask again
    attrs = {"dropout": dropout} if dropout else {}
    packed = apply_op(
        "attention_backward", q, k, v, out, d_out, *extra, scale=scale, causal=causal, **attrs
    )
    d_q, d_k, d_v = unpack(F, packed, [q.shape, k.shape, v.shape])
    return (d_q, d_k, d_v) + (None,) * len(extra)


def_vjp("attention", _attention_vjp)
