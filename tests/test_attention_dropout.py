"""Dropout inside the fused attention op (``F.scaled_dot_product_attention(..., dropout_p)``).

The mask is FLAME's own (flame/ir/ops/attention.py, ``dropout_keep``): a pure function of the
generator's (seed, offset) and the score's place (b, h, i, j), one Philox call a 2 x 2 block.

CPU tier (reference backend): the mask's statistics and its definition (Philox words of
``philox_ref``, the function the random ops use); forward values equal the dense computation
with that mask, and the gradients of q, k, v equal PyTorch's autograd through
``softmax(q k^T scale + bias) * mask / (1 - p) @ v`` (and central differences of the
reference); the identity trick that reads a kernel's mask back (Lk = D, V = I: O = dropout(P));
a compiled function draws a new mask at every call and ``manual_seed`` repeats them; p = 0
builds the node of before (same attributes, no random input), p = 1 gives zeros, p outside
[0, 1] fails at the user's line; the planned graph of forward + backward holds no [L, L]
value; MultiheadAttention's dropout reaches the op; every dropout variant of the flash
template renders (the others unchanged) and NVRTC compiles it.

GPU tier: FLAME's flash kernel draws the reference's mask bit for bit (read back by the
identity trick, forward and backward), its values and gradients match the reference backend,
lazy == compiled; cuDNN's path (its own Philox stream) uses one mask for forward and
backward, its kept fraction is 1 - p, and a compiled CUDA graph draws new masks on replay.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from gradcheck import check_against_finite_differences

import flame as fl
import flame.nn.functional as F
from flame.autograd import functions
from flame.ir.ops.attention import (
    _attention_backward_ref,
    _attention_ref,
    dropout_counters,
    dropout_keep,
    unpack,
)
from flame.ir.ops.random import philox_ref
from flame.runtime import reference
from flame.tensor import apply_op

# --- helpers ---------------------------------------------------------------------------------


def _rounded(array, dtype) -> np.ndarray:
    with fl.backend("reference"):
        return fl.tensor(np.asarray(array, np.float32)).to(dtype).numpy()


def attention_nodes(tensor) -> list:
    """The ``attention`` nodes ``tensor`` depends on."""
    seen, found, stack = set(), [], [tensor.node]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.op == "attention":
            found.append(node)
        stack.extend(node.inputs)
    return found


def drawn_state(out) -> np.ndarray:
    """The (seed, offset) the one attention op under ``out`` read."""
    (node,) = attention_nodes(out)
    assert node.attr("dropout", 0.0) > 0.0
    (state,) = reference.evaluate([node.inputs[-1]])
    return np.asarray(state, np.int64)


def dense(q, k, v, keep, p, scale, causal=False, bias=None, d_out=None):
    """float64 NumPy: (out, dq, dk, dv) of softmax(q k^T scale + bias) * keep / (1 - p) @ v
    for ``keep`` [B, Hq, Lq, Lk] (key/value heads repeated for grouped queries), written out
    independently of the op's reference."""
    q, k, v = (np.asarray(array, np.float64) for array in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    keys, values = np.repeat(k, groups, 1), np.repeat(v, groups, 1)
    scores = scale * q @ np.swapaxes(keys, -1, -2)
    if bias is not None:
        scores = scores + bias
    if causal:
        scores = np.where(np.triu(np.ones(scores.shape[-2:], bool), 1), -np.inf, scores)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    probabilities = weights / weights.sum(-1, keepdims=True)
    factor = keep / (1.0 - p) if p < 1 else np.zeros(keep.shape)
    dropped = probabilities * factor
    out = dropped @ values
    if d_out is None:
        return out, None, None, None
    d_values = np.swapaxes(dropped, -1, -2) @ d_out
    d_dropped = d_out @ np.swapaxes(values, -1, -2)
    d_probabilities = d_dropped * factor
    d_scores = probabilities * (
        d_probabilities - (d_probabilities * probabilities).sum(-1, keepdims=True)
    )
    d_q = scale * d_scores @ keys
    d_keys = scale * np.swapaxes(d_scores, -1, -2) @ q

    def per_kv_head(array):
        return array.reshape(array.shape[0], k.shape[1], groups, *array.shape[2:]).sum(2)

    return out, d_q, per_kv_head(d_keys), per_kv_head(d_values)


def run_sdpa(q, k, v, d_out, **kwargs):
    """(out, dq, dk, dv, (seed, offset)) of F.scaled_dot_product_attention on the current
    backend, as float64 arrays."""
    primals = [fl.tensor(array) for array in (q, k, v)]
    out, pullback = fl.vjp(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs),
                           *primals)  # fmt: skip
    grads = pullback(fl.tensor(d_out))
    values = [np.asarray(t.numpy(), np.float64) for t in (out, *grads)]
    return (*values, drawn_state(out))


class Case:
    """One attention configuration: shapes [B, Hq, Lq, D], [B, Hk, Lk, D], [B, Hk, Lk, Dv]."""

    def __init__(self, batch, heads, kv_heads, lq, lk, dim, value_dim=None, causal=False,
                 bias=False, p=0.3):  # fmt: skip
        self.batch, self.heads, self.kv_heads = batch, heads, kv_heads
        self.lq, self.lk, self.dim, self.value_dim = lq, lk, dim, value_dim or dim
        self.causal, self.bias, self.p = causal, bias, p

    def __repr__(self) -> str:
        flags = "-causal" * self.causal + "-bias" * self.bias
        return (f"b{self.batch}h{self.heads}kv{self.kv_heads}-l{self.lq}s{self.lk}-d{self.dim}"
                f"v{self.value_dim}{flags}-p{self.p}")  # fmt: skip

    def arrays(self, rng, dtype, magnitude=1.0):
        shapes = [(self.batch, self.heads, self.lq, self.dim),
                  (self.batch, self.kv_heads, self.lk, self.dim),
                  (self.batch, self.kv_heads, self.lk, self.value_dim),
                  (self.batch, self.heads, self.lq, self.value_dim)]  # fmt: skip
        q, k, v, d_out = (_rounded(magnitude * rng.standard_normal(s), dtype) for s in shapes)
        bias = None
        if self.bias:
            bias = _rounded(rng.standard_normal((1, 1, self.lq, self.lk)), dtype)
        return q, k, v, d_out, bias

    def kwargs(self, bias):
        extra = {"enable_gqa": True} if self.heads != self.kv_heads else {}
        mask = None if bias is None else fl.tensor(bias)
        return {"dropout_p": self.p, "is_causal": self.causal, "attn_mask": mask, **extra}


CASES = [
    Case(2, 2, 2, 33, 33, 32),
    Case(1, 2, 2, 7, 40, 64, p=0.1),
    Case(1, 4, 2, 17, 9, 64, causal=True),  # grouped queries
    Case(2, 1, 1, 20, 31, 40, value_dim=72, bias=True, p=0.5),
    Case(1, 2, 2, 64, 64, 128, causal=True, p=0.2),  # the flash backward's paired layout
    Case(1, 2, 1, 24, 40, 160, p=0.25),  # dK, dV in a float32 scratch, one Q/dO buffer
]


def assert_matches_dense(case, got, arrays, keep, tolerance):
    q, k, v, d_out, bias = arrays
    want = dense(q, k, v, keep, case.p, 1 / math.sqrt(case.dim), case.causal,
                 None if bias is None else np.asarray(bias, np.float64), d_out)  # fmt: skip
    for name, actual, expected in zip(("out", "dq", "dk", "dv"), got, want):
        atol = tolerance * max(float(np.abs(expected).max(initial=0.0)), 1e-30)
        np.testing.assert_allclose(actual, expected, rtol=tolerance, atol=atol, err_msg=name)


# --- CPU tier: the mask ---------------------------------------------------------------------


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_mask_keeps_one_minus_p_of_the_scores(p):
    shape = (2, 3, 65, 130)
    keep = dropout_keep(np.array([1234, 77]), shape, p)
    count = keep.size
    kept = keep.mean()
    assert abs(kept - (1 - p)) < 5 * math.sqrt(p * (1 - p) / count), (p, kept)
    # every word of the Philox block is used alike: no row or column parity is biased
    for parity in ((slice(0, None, 2), slice(0, None, 2)), (slice(1, None, 2), slice(1, None, 2))):
        part = keep[..., parity[0], parity[1]]
        assert abs(part.mean() - (1 - p)) < 6 * math.sqrt(p * (1 - p) / part.size)


def test_mask_is_philox_of_the_block_counter():
    """Element (b, h, i, j) is word 2 (i % 2) + j % 2 of Philox at counter offset + ((b H + h)
    ceil(Lq/2) + i // 2) ceil(Lk/2) + j // 2, compared >= p as rand's uniform would be."""
    seed, offset, p = -987654321, 5000, 0.4
    shape = (2, 2, 5, 7)
    keep = dropout_keep(np.array([seed, offset]), shape, p)
    rows, cols = 3, 4
    for b, h, i, j in np.ndindex(shape):
        counter = offset + ((b * 2 + h) * rows + i // 2) * cols + j // 2
        bits = int(philox_ref(np.int64(seed), np.int64(counter), word=2 * (i % 2) + j % 2))
        assert keep[b, h, i, j] == (bits * 2.0**-24 >= p), (b, h, i, j)
    assert dropout_counters((2, 2, 5, 32), (2, 2, 7, 32)) == 2 * 2 * rows * cols


def test_mask_depends_on_seed_and_offset_only_through_the_counter():
    shape = (1, 2, 8, 10)
    first = dropout_keep(np.array([7, 0]), shape, 0.5)
    assert np.array_equal(first, dropout_keep(np.array([7, 0]), shape, 0.5))
    assert not np.array_equal(first, dropout_keep(np.array([8, 0]), shape, 0.5))
    # head 1 at offset 0 is head 0 at offset (one head's counters)
    shifted = dropout_keep(np.array([7, 4 * 5]), (1, 1, 8, 10), 0.5)
    assert np.array_equal(first[:, 1:], shifted)


# --- CPU tier: values and gradients -----------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_reference_matches_dense_math_with_the_reference_mask(case, rng, reference_backend):
    arrays = case.arrays(rng, fl.bfloat16)
    q, k, v, d_out, bias = arrays
    fl.manual_seed(int(rng.integers(1 << 40)))
    *got, state = run_sdpa(q, k, v, d_out, **case.kwargs(bias))
    keep = dropout_keep(state, (case.batch, case.heads, case.lq, case.lk), case.p)
    assert 0 < keep.mean() < 1
    assert_matches_dense(case, got, arrays, keep, 1e-2)  # one rounding to bfloat16


@pytest.mark.parametrize("case", CASES[:4], ids=repr)
def test_gradients_match_torch_through_the_same_mask(case, rng, reference_backend):
    torch = pytest.importorskip("torch", reason="PyTorch is the reference for these checks")
    arrays = case.arrays(rng, fl.float16)
    q, k, v, d_out, bias = arrays
    fl.manual_seed(11)
    *got, state = run_sdpa(q, k, v, d_out, **case.kwargs(bias))
    keep = dropout_keep(state, (case.batch, case.heads, case.lq, case.lk), case.p)
    tq, tk, tv = (torch.tensor(np.asarray(a, np.float64), requires_grad=True) for a in arrays[:3])
    groups = case.heads // case.kv_heads
    keys, values = tk.repeat_interleave(groups, 1), tv.repeat_interleave(groups, 1)
    scores = tq @ keys.transpose(-1, -2) / math.sqrt(case.dim)
    if bias is not None:
        scores = scores + torch.tensor(np.asarray(bias, np.float64))
    if case.causal:
        scores = scores.masked_fill(torch.ones(case.lq, case.lk).triu(1).bool(), -math.inf)
    weights = torch.softmax(scores, -1) * torch.from_numpy(keep) / (1 - case.p)
    out = weights @ values
    out.backward(torch.tensor(np.asarray(d_out, np.float64)))
    want = [out.detach().numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()]
    for name, actual, expected in zip(("out", "dq", "dk", "dv"), got, want):
        atol = 2e-3 * np.abs(expected).max()
        np.testing.assert_allclose(actual, expected, rtol=2e-3, atol=atol, err_msg=name)


def test_backward_reference_matches_finite_differences(rng):
    q, k, v = (rng.standard_normal(shape) for shape in [(1, 2, 3, 4), (1, 1, 5, 4), (1, 1, 5, 3)])
    bias = rng.standard_normal((1, 2, 3, 5))
    state, p, scale = np.array([99, 3]), 0.35, 0.7
    d_out = rng.standard_normal((1, 2, 3, 3))
    out, _ = _attention_ref(q, k, v, bias, scale, True, p, state)
    packed = _attention_backward_ref(q, k, v, out, d_out, bias, state, scale=scale, causal=True,
                                     dropout=p)  # fmt: skip
    analytic = np.split(packed, [q.size, q.size + k.size])
    inputs = [q, k, v]
    for position, expected in enumerate(analytic):
        numeric = np.zeros_like(inputs[position])
        for index in np.ndindex(numeric.shape):
            total = []
            for step in (1e-6, -1e-6):
                changed = [array.copy() for array in inputs]
                changed[position][index] += step
                value = _attention_ref(*changed, bias, scale, True, p, state)[0]
                total.append(float(np.sum(value * d_out)))
            numeric[index] = (total[0] - total[1]) / 2e-6
        np.testing.assert_allclose(expected.reshape(numeric.shape), numeric, rtol=1e-6,
                                   atol=1e-8, err_msg="qkv"[position])  # fmt: skip


def test_op_vjp_matches_finite_differences_with_a_fixed_state(rng):
    shapes = [(1, 2, 3, 4), (1, 1, 4, 4), (1, 1, 4, 3)]
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    arrays.append(np.array([5, 17], np.int64))

    def build(q, k, v, state):
        packed = apply_op("attention", q, k, v, state, scale=0.6, causal=False, slots=1,
                          dropout=0.4)  # fmt: skip
        (out,) = unpack(functions(), packed, [(1, 2, 3, 3)])
        return out

    check_against_finite_differences(build, arrays, [0, 1, 2], rng, rtol=1e-5, atol=1e-6)


def identity_trick_mask(out: np.ndarray) -> np.ndarray:
    """With Lk = D = Dv and V = I, O = dropout(P) exactly: the kept scores are O != 0."""
    return out != 0


def identity_inputs(rng, batch, heads, lq, dim, dtype):
    q = _rounded(0.3 * rng.standard_normal((batch, heads, lq, dim)), dtype)
    k = _rounded(0.3 * rng.standard_normal((batch, heads, dim, dim)), dtype)
    v = _rounded(np.broadcast_to(np.eye(dim), (batch, heads, dim, dim)), dtype)
    d_out = _rounded(rng.standard_normal((batch, heads, lq, dim)), dtype)
    return q, k, v, d_out


def test_identity_trick_reads_the_reference_mask(rng, reference_backend):
    q, k, v, d_out = identity_inputs(rng, 2, 2, 19, 64, fl.bfloat16)
    fl.manual_seed(5)
    out, *_, state = run_sdpa(q, k, v, d_out, dropout_p=0.25)
    np.testing.assert_array_equal(identity_trick_mask(out), dropout_keep(state, out.shape, 0.25))


# --- CPU tier: the generator ------------------------------------------------------------------


def _dropped_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)


def test_compiled_calls_draw_new_masks_and_manual_seed_repeats_them(rng, reference_backend):
    q, k, v, _ = identity_inputs(rng, 1, 2, 9, 16, fl.bfloat16)
    tensors = [fl.tensor(array) for array in (q, k, v)]
    compiled = fl.compile(_dropped_attention)
    runs = []
    for _ in range(2):
        fl.manual_seed(2024)
        runs.append([identity_trick_mask(compiled(*tensors).numpy()) for _ in range(3)])
    first, again = runs
    assert not np.array_equal(first[0], first[1]) and not np.array_equal(first[1], first[2])
    for mask, repeated in zip(first, again):
        np.testing.assert_array_equal(mask, repeated)
    # lazy calls after the same seed draw the same masks (same generator offsets)
    fl.manual_seed(2024)
    for mask in first:
        np.testing.assert_array_equal(identity_trick_mask(_dropped_attention(*tensors).numpy()),
                                      mask)  # fmt: skip
    assert compiled.cache_info().traces == 1


def test_two_draws_in_a_compiled_call_differ_at_every_call(rng, reference_backend):
    q, k, v, _ = identity_inputs(rng, 1, 1, 8, 16, fl.float16)
    tensors = [fl.tensor(array) for array in (q, k, v)]

    def twice(q, k, v):
        return _dropped_attention(q, k, v), _dropped_attention(q, k, v)

    compiled = fl.compile(twice)
    fl.manual_seed(3)
    # two calls of two draws each: the second draw reads the state plus its place in the call
    masks = [identity_trick_mask(t.numpy()) for _ in range(2) for t in compiled(*tensors)]
    for index, mask in enumerate(masks):
        assert not any(np.array_equal(mask, other) for other in masks[index + 1 :]), index
    fl.manual_seed(3)
    lazy = [identity_trick_mask(t.numpy()) for _ in range(2) for t in twice(*tensors)]
    for got, want in zip(masks, lazy):
        np.testing.assert_array_equal(got, want)


def test_checkpointed_attention_draws_the_same_mask_again(rng, reference_backend):
    """A checkpoint recomputes the region in the backward with the generator rewound: the
    recomputed attention draws the forward's mask (gradients equal the plain ones)."""
    q, k, v, d_out = Case(1, 2, 2, 9, 12, 16).arrays(rng, fl.bfloat16)[:4]
    results = []
    for wrap in (lambda f: f, lambda f: lambda *a: fl.checkpoint(f, *a)):
        fl.manual_seed(8)
        primals = [fl.tensor(array) for array in (q, k, v)]
        out, pullback = fl.vjp(wrap(_dropped_attention), *primals)
        grads = pullback(fl.tensor(d_out))
        results.append([np.asarray(t.numpy(), np.float64) for t in (out, *grads)])
    for plain, checkpointed in zip(*results):
        np.testing.assert_allclose(checkpointed, plain, rtol=1e-6, atol=1e-6)


# --- CPU tier: p = 0, p = 1, bad p ------------------------------------------------------------


def test_p_zero_builds_the_node_of_before(rng, reference_backend):
    q, k, v = (fl.tensor(rng.standard_normal((1, 2, 8, 32)).astype(np.float32)).half()
               for _ in range(3))  # fmt: skip
    (plain,) = attention_nodes(F.scaled_dot_product_attention(q, k, v))
    (zero,) = attention_nodes(F.scaled_dot_product_attention(q, k, v, dropout_p=0.0))
    assert zero.attrs == plain.attrs and len(zero.inputs) == 3
    assert zero.attr("dropout") is None
    (dropped,) = attention_nodes(F.scaled_dot_product_attention(q, k, v, dropout_p=0.2))
    assert dropped.attr("dropout") == 0.2 and dropped.inputs[-1].dtype.name == "int64"


def test_p_one_gives_zeros_and_zero_gradients(rng, reference_backend):
    q, k, v, d_out = identity_inputs(rng, 1, 2, 5, 16, fl.bfloat16)
    out, *grads, _ = run_sdpa(q, k, v, d_out, dropout_p=1.0)
    for value in (out, *grads):
        assert not value.any() and np.isfinite(value).all()


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan")])
def test_p_outside_zero_one_fails_at_the_users_line(p, reference_backend):
    q = fl.zeros((1, 1, 4, 16), dtype=fl.bfloat16)
    with pytest.raises(ValueError) as raised:
        F.scaled_dot_product_attention(q, q, q, dropout_p=p)
    message = str(raised.value)
    assert "dropout_p must be in [0, 1]" in message and "test_attention_dropout.py" in message


def test_op_checks_its_random_input(reference_backend):
    q = fl.zeros((1, 1, 4, 16), dtype=fl.bfloat16)
    with pytest.raises(TypeError, match="attention: with dropout the last input must be the "
                       r"int64\[2\]"):  # fmt: skip
        apply_op("attention", q, q, q, fl.zeros((2,), dtype=fl.int32), slots=2, dropout=0.1)
    with pytest.raises(ValueError, match=r"attention: dropout must be in \[0, 1\]"):
        apply_op("attention", q, q, q, fl.zeros((2,), dtype=fl.int64), slots=2, dropout=2.0)


# --- CPU tier: memory and modules -------------------------------------------------------------


def test_planned_forward_and_backward_hold_nothing_of_size_l_squared(rng, cuda_backend):
    """Building on the cuda backend touches no GPU: the pass pipeline's graph of the forward
    and the three gradients has no value of [.., L, L] (or anywhere near L^2 elements)."""
    from flame.ir.graph import Graph
    from flame.ir.passes import run_pipeline

    length, dim = 1024, 64
    q, k, v = (fl.tensor(rng.standard_normal((1, 2, length, dim)).astype(np.float32))
               .to(fl.bfloat16) for _ in range(3))  # fmt: skip
    out, pullback = fl.vjp(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1),
                           q, k, v)  # fmt: skip
    grads = pullback(fl.ones_like(out))
    graph = run_pipeline(Graph(tuple(t.node for t in (out, *grads))))
    ops = {node.op for node in graph.nodes}
    assert {"attention", "attention_backward"} <= ops and "matmul" not in ops
    for node in graph.nodes:
        assert math.prod(node.shape) < length * length, (node.op, node.shape)


def test_multihead_attention_dropout_reaches_the_op(rng, reference_backend):
    layer = fl.nn.MultiheadAttention(64, 4, dropout=0.25).to(fl.bfloat16)
    x = fl.tensor(rng.standard_normal((9, 2, 64)).astype(np.float32)).to(fl.bfloat16)
    out, _ = layer(x, x, x, need_weights=False)
    (node,) = attention_nodes(out)
    assert node.attr("dropout") == 0.25
    layer.eval()
    out, _ = layer(x, x, x, need_weights=False)
    (node,) = attention_nodes(out)
    assert node.attr("dropout") is None


# --- CPU tier: the flash kernel's dropout variants --------------------------------------------

# the head-dim pairs of tests/test_flash_attention.py (plain, paired, scratch backward layouts)
HEAD_DIMS = [(8, 8), (32, 32), (40, 40), (64, 64), (72, 72), (80, 80), (128, 128), (160, 160),
             (256, 256), (64, 128), (128, 64), (40, 72)]  # fmt: skip
FLAGS = [(False, False), (True, False), (False, True), (True, True)]  # (causal, bias)
# to compile: every head-dim pair in bfloat16 with the flags taken in turn, float16 for a few
VARIANTS = [("bfloat16", *dims, *FLAGS[index % 4]) for index, dims in enumerate(HEAD_DIMS)]
VARIANTS += [("float16", 40, 72, False, True), ("float16", 128, 128, True, False)]


def test_dropout_is_a_template_switch(monkeypatch):
    from flame.runtime import flash_attention as fa

    monkeypatch.delenv(fa.TILES_VARIABLE, raising=False)
    names = set()
    for part in ("forward", "backward"):
        for dtype in ("bfloat16", "float16"):
            for dims in HEAD_DIMS:
                for flags in FLAGS:
                    case = (dtype, *dims, *flags)
                    name, plain = fa.render(part, *case)
                    dropout_name, dropped = fa.render(part, *case, True)
                    assert dropout_name == name + "d" or name.endswith("plain")
                    assert "flame_philox" not in plain and "keep_threshold" not in plain
                    assert dropped.count("swap_keep_bits(") >= 2 and "keep_scale" in dropped
                    assert fa.render(part, *case, False) == (name, plain)
                    names.add(dropout_name)
    assert len(names) == len(HEAD_DIMS) * len(FLAGS) * 2  # one name a dropout kernel


def test_keep_threshold_is_the_reference_comparison():
    from flame.runtime.flash_attention import keep_threshold

    for p in (0.1, 0.3, 0.5, 1 / 3, 1 - 2**-24, 1.0):
        threshold = keep_threshold(p)
        assert (threshold * 2.0**-24 >= p) and not ((threshold - 1) * 2.0**-24 >= p), p


@pytest.mark.parametrize("part", ["forward", "backward"])
def test_dropout_variants_compile_for_sm90(part, nvrtc, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from flame.runtime import flash_attention as fa
    from flame.runtime.compiler import nvrtc_compile

    monkeypatch.delenv(fa.TILES_VARIABLE, raising=False)

    def compile_one(case):
        name, source = fa.render(part, *case, True)
        return case, nvrtc_compile(source, name, "sm_90")

    with ThreadPoolExecutor(max_workers=4) as pool:
        for case, cubin in pool.map(compile_one, VARIANTS):
            assert len(cubin) > 1000, case


# --- gpu tier -----------------------------------------------------------------------------------


@pytest.fixture(params=[True, False], ids=["cudnn", "flash"])
def cudnn_enabled(request):
    with fl.backends.cudnn.flags(enabled=request.param):
        yield request.param


@pytest.fixture
def flash_only():
    with fl.backends.cudnn.flags(enabled=False):
        yield


GPU_TOLERANCE = {"bfloat16": 4e-2, "float16": 1e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(2, 2, 19, 64), (1, 3, 130, 64), (1, 1, 64, 128)], ids=str)
def test_gpu_identity_trick_reads_the_mask(shape, dtype_name, cudnn_enabled, rng, cuda_backend):
    """O = dropout(P): the flash kernel's mask is the reference's, bit for bit; cuDNN's is its
    own, but keeps 1 - p of the scores; either way the backward went through the same mask
    (the gradients equal the dense math with the mask read back)."""
    batch, heads, lq, dim = shape
    dtype = getattr(fl, dtype_name)
    q, k, v, d_out = identity_inputs(rng, batch, heads, lq, dim, dtype)
    p = 0.3
    fl.manual_seed(int(rng.integers(1 << 40)))
    out, *grads, state = run_sdpa(q, k, v, d_out, dropout_p=p)
    keep = identity_trick_mask(out)
    if not cudnn_enabled:
        np.testing.assert_array_equal(keep, dropout_keep(state, out.shape, p))
    assert abs(keep.mean() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / keep.size)
    case = Case(batch, heads, heads, lq, dim, dim, p=p)
    assert_matches_dense(case, [out, *grads], (q, k, v, d_out, None), keep,
                         GPU_TOLERANCE[dtype_name])  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_gpu_flash_matches_the_reference_mask(case, rng, flash_only):
    arrays = case.arrays(rng, fl.bfloat16)
    q, k, v, d_out, bias = arrays
    seed = int(rng.integers(1 << 40))
    with fl.backend("cuda"):
        fl.manual_seed(seed)
        *got, state = run_sdpa(q, k, v, d_out, **case.kwargs(bias))
    with fl.backend("reference"):
        fl.manual_seed(seed)
        *want, reference_state = run_sdpa(q, k, v, d_out, **case.kwargs(bias))
    np.testing.assert_array_equal(state, reference_state)
    keep = dropout_keep(state, (case.batch, case.heads, case.lq, case.lk), case.p)
    assert_matches_dense(case, got, arrays, keep, GPU_TOLERANCE["bfloat16"])


@pytest.mark.gpu
def test_gpu_p_one_gives_zeros(cudnn_enabled, rng, cuda_backend):
    q, k, v, d_out = identity_inputs(rng, 1, 2, 24, 64, fl.bfloat16)
    out, *grads, _ = run_sdpa(q, k, v, d_out, dropout_p=1.0)
    for value in (out, *grads):
        assert not value.any() and np.isfinite(value).all()


def _dropout_step(q, k, v, target):
    def loss(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
        return F.mse_loss(out.float(), target)

    return fl.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


@pytest.mark.gpu
def test_gpu_lazy_equals_compiled_equals_reference(rng, flash_only):
    shape = (2, 2, 33, 64)
    arrays = [_rounded(rng.standard_normal(shape), fl.bfloat16) for _ in range(3)]
    target = rng.standard_normal(shape).astype(np.float32)

    def run(compiled: bool, backend: str):
        with fl.backend(backend):
            tensors = [fl.tensor(array) for array in arrays] + [fl.tensor(target)]
            step = fl.compile(_dropout_step) if compiled else _dropout_step
            fl.manual_seed(77)
            results = []
            for _ in range(2):
                loss, grads = step(*tensors)
                results.append([np.asarray(t.numpy(), np.float64) for t in (loss, *grads)])
            return results

    lazy, compiled, want = run(False, "cuda"), run(True, "cuda"), run(False, "reference")
    for call in range(2):
        for got_lazy, got_compiled, expected in zip(lazy[call], compiled[call], want[call]):
            # dQ's float32 atomics make runs differ in the last bits, another mask by O(1)
            atol = 1e-2 * np.abs(got_lazy).max()
            np.testing.assert_allclose(got_compiled, got_lazy, rtol=1e-2, atol=atol)
            atol = 4e-2 * np.abs(expected).max()
            np.testing.assert_allclose(got_lazy, expected, rtol=4e-2, atol=atol)
    assert not np.array_equal(lazy[0][1], lazy[1][1])  # a new mask at the second call


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_draw_new_masks(cudnn_enabled, rng, cuda_backend):
    q, k, v, _ = identity_inputs(rng, 1, 2, 40, 64, fl.bfloat16)
    tensors = [fl.tensor(array).realize() for array in (q, k, v)]
    graphed = fl.compile(_dropped_attention, cuda_graph=True)
    fl.manual_seed(9)
    masks = [identity_trick_mask(np.asarray(graphed(*tensors).numpy())) for _ in range(3)]
    fl.manual_seed(9)
    again = [identity_trick_mask(np.asarray(graphed(*tensors).numpy())) for _ in range(3)]
    assert not np.array_equal(masks[0], masks[1]) and not np.array_equal(masks[1], masks[2])
    for mask, repeated in zip(masks, again):
        np.testing.assert_array_equal(mask, repeated)
    info = graphed.cache_info()
    assert info.traces == 1 and info.graph_captures == 1, info
    assert not info.graph_failures, info.graph_failures
