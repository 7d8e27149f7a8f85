"""The pass that joins sums of zero-padded pieces into one ``cat`` (flame/ir/passes/joins.py):
where it fires, where it must not, and that values and gradients stay the same."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import flame as fl
import flame.nn.functional as F
from flame.codegen.lower import lower_group
from flame.ir.graph import Graph
from flame.ir.infer import make_node
from flame.ir.passes import run_pipeline
from flame.ir.passes.joins import join_padded_sums
from flame.runtime.executor import _layout_of
from flame.runtime.reference import evaluate


def _count(graph: Graph, op: str) -> int:
    return sum(node.op == op for node in graph.nodes)


def _backward(loss_of, array: np.ndarray) -> Graph:
    """The (unplanned) graph of the gradient of ``loss_of`` at ``array``."""
    x = fl.tensor(array)
    return Graph((fl.grad(loss_of)(x).node,))


def _assert_same_values(before: Graph, after: Graph) -> None:
    for old, new in zip(evaluate(before.outputs), evaluate(after.outputs)):
        np.testing.assert_array_equal(new, old)  # exact: only zeros were added


def _joined(graph: Graph) -> Graph:
    after = join_padded_sums(graph)
    _assert_same_values(graph, after)
    return after


def _weighted_sum(pieces) -> fl.Tensor:
    """A loss that gives each piece a different cotangent."""
    total = None
    for index, piece in enumerate(pieces):
        term = fl.sum(piece * float(index + 2) + piece.exp())
        total = term if total is None else total + term
    return total


@pytest.mark.parametrize(
    ("shape", "split"),
    [
        ((4, 10), lambda t: t.chunk(2, dim=1)),
        ((4, 9), lambda t: t.chunk(3, dim=1)),
        ((6, 5), lambda t: t.chunk(3, dim=0)),  # uneven: pieces of 2, 2, 2 rows
        ((10, 3), lambda t: t.split([2, 5, 3], dim=0)),
        ((2, 3, 12), lambda t: (t[..., :4], t[..., 4:8], t[..., 8:])),  # qkv of one projection
    ],
    ids=["chunk2", "chunk3", "chunk3-rows", "split-unequal", "qkv-last-axis"],
)
def test_split_backward_is_one_cat(shape, split, rng, reference_backend):
    before = _backward(lambda t: _weighted_sum(split(t)), rng.standard_normal(shape, np.float32))
    assert _count(before, "pad") >= 2
    after = _joined(before)
    assert _count(after, "pad") == 0
    assert _count(after, "cat") == 1
    assert after.outputs[0].op == "cat"


def _leaves(rng, width=9, dtype="float32"):
    return [fl.tensor(rng.standard_normal((3, width)).astype(dtype)).node for _ in range(3)]


def _pad(node, axis: int, low: int, high: int, value=0.0):
    widths = tuple((low, high) if dim == axis else (0, 0) for dim in range(len(node.shape)))
    return make_node("pad", (node,), {"widths": widths, "value": value})


def _add(left, right):
    return make_node("add", (left, right))


def _three_pads(rng):
    a, b, c = (fl.tensor(rng.standard_normal((3, size), np.float32)).node for size in (2, 3, 4))
    return [_pad(a, 1, 0, 7), _pad(b, 1, 2, 4), _pad(c, 1, 5, 0)]


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
@pytest.mark.parametrize("nesting", ["left", "right"])
def test_fires_for_any_add_order(order, nesting, rng, reference_backend):
    pads = _three_pads(rng)
    first, second, third = (pads[index] for index in order)
    if nesting == "left":
        root = _add(_add(first, second), third)
    else:
        root = _add(first, _add(second, third))
    after = _joined(Graph((root,)))
    (cat,) = after.outputs
    assert cat.op == "cat" and cat.attr("dim") == 1
    assert list(cat.inputs) == [pad.inputs[0] for pad in pads]  # in axis order
    assert _count(after, "add") == 0


def test_contiguous_run_is_one_pad_of_the_cat(rng, reference_backend):
    array = rng.standard_normal((3, 9), np.float32)
    before = _backward(lambda t: _weighted_sum((t[:, 2:4], t[:, 4:7])), array)
    after = _joined(before)
    (result,) = after.outputs
    assert result.op == "pad" and result.inputs[0].op == "cat"
    assert result.attr("widths")[1] == (2, 2)
    assert _count(after, "pad") == 1


def _gaps_loss(t):
    return _weighted_sum((t[:, 1:3], t[:, 5:7]))


def test_gaps_between_pieces_are_zeros_in_the_cat(rng, reference_backend):
    before = _backward(_gaps_loss, rng.standard_normal((3, 9), np.float32))
    after = _joined(before)
    (cat,) = after.outputs
    assert cat.op == "cat" and _count(after, "pad") == 0
    widths = [part.shape[1] for part in cat.inputs]
    assert widths == [1, 2, 2, 2, 2]  # zeros, piece, zeros, piece, zeros


def test_gaps_lower_to_kernels(rng, cuda_backend):
    """The zero-filled gaps feed a library call: the planned graph still lowers (no GPU)."""
    graph = run_pipeline(_backward(_gaps_loss, rng.standard_normal((3, 9), np.float32)))
    assert _count(graph, "pad") == 0
    for group in graph.groups:
        if group.kind != "library":
            assert lower_group(group, _layout_of) is not None


def _unchanged(root) -> None:
    graph = Graph((root,))
    assert join_padded_sums(graph).outputs[0] is root


def test_does_not_fire_for_overlapping_ranges(rng, reference_backend):
    a, b, _ = _leaves(rng, width=4)
    _unchanged(_add(_pad(a, 1, 0, 3), _pad(b, 1, 2, 1)))


def test_does_not_fire_for_a_nonzero_fill(rng, reference_backend):
    a, b, _ = _leaves(rng, width=4)
    _unchanged(_add(_pad(a, 1, 0, 4, value=1.0), _pad(b, 1, 4, 0, value=1.0)))
    _unchanged(_add(_pad(a, 1, 0, 4, value=-0.0), _pad(b, 1, 4, 0, value=-0.0)))


def test_does_not_fire_for_pads_on_different_axes(rng, reference_backend):
    a = fl.tensor(rng.standard_normal((2, 4), np.float32)).node
    b = fl.tensor(rng.standard_normal((4, 2), np.float32)).node
    _unchanged(_add(_pad(a, 0, 0, 2), _pad(b, 1, 2, 0)))
    c = fl.tensor(rng.standard_normal((2, 2), np.float32)).node
    both = make_node("pad", (c,), {"widths": ((0, 2), (2, 0)), "value": 0.0})  # two axes
    _unchanged(_add(_pad(a, 0, 2, 0), both))


def test_does_not_fire_for_different_dtypes(rng, reference_backend):
    a, b, _ = _leaves(rng, width=4, dtype="float16")
    half = _pad(a, 1, 0, 4)
    single = _pad(make_node("cast", (b,), {"dtype": "float32"}), 1, 4, 0)
    _unchanged(_add(make_node("cast", (half,), {"dtype": "float32"}), single))


def test_other_leaves_are_added_to_the_cat(rng, reference_backend):
    pads = _three_pads(rng)
    other, second = _leaves(rng)[:2]
    after = _joined(Graph((_add(_add(pads[0], other), _add(pads[2], pads[1])),)))
    (root,) = after.outputs
    assert root.op == "add" and root.inputs[0] is other and root.inputs[1].op == "cat"
    # two other leaves summed apart from the pads: their sum stays as it was
    after = _joined(Graph((_add(_add(_add(other, second), pads[1]), _add(pads[0], pads[2])),)))
    assert _count(after, "pad") == 0


def test_other_leaves_spread_over_the_tree_keep_their_order(rng, reference_backend):
    pads = _three_pads(rng)
    other, second = _leaves(rng)[:2]
    # (p0 + a) + (p1 + b): joining would compute (a + b) + piece instead of (piece + a) + b
    _unchanged(_add(_add(pads[0], other), _add(pads[1], second)))


def test_an_inner_sum_read_elsewhere_is_not_taken_apart(rng, reference_backend):
    pads = _three_pads(rng)
    inner = _add(pads[0], pads[1])
    root = _add(inner, pads[2])
    after = _joined(Graph((root, inner)))
    joined_inner = after.outputs[1]
    # the inner sum itself is joined: [0, 5) of 9 columns, one pad of the cat
    assert joined_inner.op == "pad" and joined_inner.inputs[0].op == "cat"
    # the outer sum reads it (computed anyway) beside its one pad: not taken apart
    assert list(after.outputs[0].inputs) == [joined_inner, pads[2]]


def test_negative_zero_is_kept_by_the_cat(reference_backend):
    """The documented difference: the sum turned a piece's -0.0 into +0.0; the cat keeps
    it (as PyTorch's backward of split does)."""
    piece = fl.tensor(np.full((2, 2), -0.0, np.float32)).node
    other = fl.tensor(np.ones((2, 2), np.float32)).node
    root = _add(_pad(piece, 1, 0, 2), _pad(other, 1, 2, 0))
    (before,) = evaluate((root,))
    (after,) = evaluate(join_padded_sums(Graph((root,))).outputs)
    np.testing.assert_array_equal(after, before)
    assert not np.signbit(before[:, :2]).any() and np.signbit(after[:, :2]).all()


def _chunk_loss(t):
    a, b, c = t.chunk(3, dim=1)
    return fl.sum(a * b.exp() + c.tanh() * 3.0)


def test_chunk_gradient_matches_pytorch(rng, reference_backend):
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle of this test")
    array = rng.standard_normal((5, 12), np.float32)
    graph = _backward(_chunk_loss, array)
    (planned,) = evaluate(run_pipeline(graph).outputs)
    assert _count(run_pipeline(graph), "pad") == 0
    x = torch.tensor(array, requires_grad=True)
    a, b, c = x.chunk(3, dim=1)
    (a * b.exp() + c.tanh() * 3.0).sum().backward()
    np.testing.assert_allclose(planned, x.grad.numpy(), rtol=1e-6, atol=1e-6)


def _adaln_block(x, c, w):
    """A DiT-like adaLN block: shift, scale and gate from one projection of the condition."""
    shift, scale, gate = F.linear(c, w).chunk(3, dim=1)
    normed = F.layer_norm(x, (x.shape[-1],))
    modulated = normed * (1.0 + scale.unsqueeze(1)) + shift.unsqueeze(1)
    return fl.sum((x + gate.unsqueeze(1) * modulated.tanh()) ** 2)


def test_adaln_block_backward_has_no_pad(rng, reference_backend):
    arrays = [rng.standard_normal(shape, np.float32) for shape in ((2, 5, 8), (2, 8), (24, 8))]
    grads = fl.grad(_adaln_block, argnums=(0, 1, 2))(*(fl.tensor(a) for a in arrays))
    graph = Graph(tuple(grad.node for grad in grads))
    assert _count(graph, "pad") == 3
    planned = run_pipeline(graph)
    assert _count(planned, "pad") == 0
    for old, new in zip(evaluate(graph.outputs), evaluate(planned.outputs)):
        np.testing.assert_allclose(new, old, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("loss_of", [_chunk_loss, _gaps_loss], ids=["chunk3", "gaps"])
def test_same_gradients_on_the_gpu(loss_of, rng):
    array = rng.standard_normal((6, 12), np.float32)
    with fl.backend("reference"):
        expected = fl.grad(loss_of)(fl.tensor(array)).numpy()
    with fl.backend("cuda"):
        gradient = fl.grad(loss_of)(fl.tensor(array))
        plan = run_pipeline(Graph((gradient.node,)))
        assert _count(plan, "pad") == 0
        found = gradient.numpy()
    np.testing.assert_allclose(found, expected, rtol=1e-5, atol=1e-6)
