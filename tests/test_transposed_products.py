"""simplify computes a product read only through a transpose of its result as the transposed
product, ``(A B)^T = B^T A^T`` (flame/ir/passes/simplify.py, ``TRANSPOSED_PRODUCTS``): a
Linear's weight gradient comes out of cuBLAS in the parameter's [out, in] order instead of
[in, out] read transposed by every consumer (clipping, the optimizer: tile-transpose kernels).
The operands' transposes are views cuBLAS reads with ``OP_T``, never copies. A product that
something else reads in its own order is left alone (it would be computed twice)."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.ir.passes import simplify as simplify_module
from flame.ir.passes.simplify import simplify
from flame.runtime.library_linalg import matrix_layout
from flame.runtime.plans import LibraryCall
from flame.runtime.reference import evaluate

F = fl.nn.functional


def _linear_step(rng, autocast: bool):
    """A Linear layer over [2, 5, 6] tokens, a loss and its backward (built, not run):
    ``(loss, dx, dW, db)``; the weight is [4, 6] = [out, in]."""
    x = fl.from_numpy(rng.standard_normal((2, 5, 6)).astype(np.float32)).requires_grad_()
    w = fl.from_numpy(rng.standard_normal((4, 6)).astype(np.float32)).requires_grad_()
    b = fl.from_numpy(rng.standard_normal(4).astype(np.float32)).requires_grad_()
    if autocast:
        with fl.autocast("cuda", dtype=fl.bfloat16):
            y = F.linear(x, w, b)
    else:
        y = F.linear(x, w, b)
    loss = (fl.tanh(y.float()) * 2).sum()
    loss.backward(create_graph=True)
    return (loss, x.grad, w.grad, b.grad), (x, w, b)


def _transposed_products(graph: Graph) -> list:
    """Permutes read straight off a matmul's result."""
    return [node for node in graph.nodes if node.op == "permute" and node.inputs[0].op == "matmul"]


def _matmul_shapes(graph: Graph) -> list:
    return sorted(node.shape for node in graph.nodes if node.op == "matmul")


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_a_linear_weight_gradient_comes_out_in_the_parameters_order(rng, autocast):
    outputs, _ = _linear_step(rng, autocast)
    graph = Graph((outputs[2].node,))
    assert len(_transposed_products(graph)) == 1  # the vjp's [in, out] product, transposed
    simplified = simplify(graph)
    assert not _transposed_products(simplified)
    # forward [2, 5, 4] and the weight's gradient, now [out, in] = [4, 6]
    assert _matmul_shapes(simplified) == [(2, 5, 4), (4, 6)]
    (product,) = [node for node in simplified.nodes if node.op == "matmul" and node.shape == (4, 6)]
    left, right = product.inputs
    # dY^T (a view of the rows of dY) times X (a reshape, the vjp's X^T^T folded away)
    assert (left.op, left.attr("dims"), left.inputs[0].op) == ("permute", (1, 0), "reshape")
    assert right.op == "reshape" and right.shape == (10, 6)
    assert product.dtype is (fl.bfloat16 if autocast else fl.float32)
    assert product.attrs == next(n for n in graph.nodes if n.op == "matmul").attrs


def test_the_switch_turns_the_rule_off(rng, monkeypatch):
    monkeypatch.setattr(simplify_module, "TRANSPOSED_PRODUCTS", False)
    outputs, _ = _linear_step(rng, autocast=True)
    assert len(_transposed_products(simplify(Graph((outputs[2].node,))))) == 1


def test_the_planned_step_reads_the_operands_as_views_and_writes_no_transpose(rng):
    with fl.backend("cuda"):  # building and planning touch no GPU
        outputs, _ = _linear_step(rng, autocast=True)
        graph = run_pipeline(Graph(tuple(tensor.node for tensor in outputs)))
    assert not _transposed_products(graph)
    kernels = [group for group in graph.groups if group.kind != "library"]
    # no kernel reads a matmul's result through a permute (the weight gradient's cast)
    for group in kernels:
        for node in group.nodes:
            assert not (node.op == "permute" and node.inputs[0].op == "matmul"), group
    slot_of = {id(node): index for index, node in enumerate(graph.inputs)}
    for group in graph.groups:
        for output in group.outputs:
            slot_of[id(output)] = len(slot_of)
    calls = [
        LibraryCall.plan(group.nodes[0], slot_of)
        for group in graph.groups
        if group.kind == "library" and group.nodes[0].op == "matmul"
    ]  # fmt: skip
    assert len(calls) == 3  # forward, dX, dW
    for call in calls:
        for view in call.views:  # a transposed operand: one cuBLAS leading dimension, no copy
            if view is not None:
                rows, columns = view.shape[-2:]
                assert matrix_layout(rows, columns, *view.strides[-2:]) is not None, view


def test_a_product_read_in_its_own_order_too_is_not_rewritten(rng):
    a = fl.tensor(rng.standard_normal((3, 5)).astype(np.float32))
    b = fl.tensor(rng.standard_normal((5, 4)).astype(np.float32))
    product = a @ b
    transposed = fl.exp(product.T)
    for others in ((product.sum(0),), (product,)):  # another reader; the product an output
        graph = simplify(Graph((transposed.node, *[t.node for t in others])))
        assert len(_transposed_products(graph)) == 1
        assert _matmul_shapes(graph) == [(3, 4)]


def test_an_alias_of_the_product_counts_as_a_reader(rng):
    """``detach`` is its input again after simplify: the product, read through the detach
    and directly, has two readers even though each original node has one."""
    a = fl.tensor(rng.standard_normal((3, 5)).astype(np.float32))
    b = fl.tensor(rng.standard_normal((5, 4)).astype(np.float32))
    product = a @ b
    alias = product.detach()
    graph = simplify(Graph((alias.T.node, (alias * 2).node)))
    assert len(_transposed_products(graph)) == 1
    assert _matmul_shapes(graph) == [(3, 4)]


def test_batched_products_and_the_ones_left_alone(rng):
    def tensor(*shape):
        return fl.tensor(rng.standard_normal(shape).astype(np.float32))

    batched = (tensor(2, 3, 5) @ tensor(2, 5, 4)).transpose(1, 2)
    graph = simplify(Graph((fl.exp(batched).node,)))
    assert not _transposed_products(graph)
    assert _matmul_shapes(graph) == [(2, 4, 3)]
    # rows of a batch times one matrix (one folded GEMM), and a permute of the batch axis
    for result in (
        (tensor(2, 3, 5) @ tensor(5, 4)).transpose(1, 2),
        (tensor(2, 3, 5) @ tensor(2, 5, 4)).permute(1, 0, 2),
    ):
        graph = simplify(Graph((fl.exp(result).node,)))
        assert len(_transposed_products(graph)) == 1


def test_values_are_unchanged(rng):
    def tensor(*shape):
        return fl.tensor(rng.standard_normal(shape).astype(np.float32))

    results = [
        fl.exp((tensor(3, 5) @ tensor(5, 4)).T),
        (tensor(2, 3, 5) @ tensor(2, 5, 4).transpose(1, 2).transpose(1, 2)).transpose(1, 2),
        (tensor(5, 3).T @ tensor(4, 5).T).T * 2,
    ]
    nodes = tuple(t.node for t in results)
    simplified, planned = simplify(Graph(nodes)), run_pipeline(Graph(nodes))
    assert not _transposed_products(simplified)
    expected = evaluate(list(nodes), precision=np.float64, realized=False)
    for graph in (simplified, planned):
        found = evaluate(list(graph.outputs), precision=np.float64, realized=False)
        for a, b in zip(found, expected):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_gradients_match_the_graph_before_and_torch(rng, autocast):
    outputs, (x, w, b) = _linear_step(rng, autocast)
    nodes = tuple(t.node for t in outputs)
    planned = run_pipeline(Graph(nodes))
    assert not _transposed_products(planned)
    expected = evaluate(list(nodes), precision=np.float64, realized=False)
    found = evaluate(list(planned.outputs), precision=np.float64, realized=False)
    margin = 1e-2 if autocast else 1e-12  # bf16: the pipeline may move rounding points
    for a, want in zip(found, expected):
        scale = max(float(np.abs(want).max()), 1.0)
        np.testing.assert_allclose(a, want, rtol=margin, atol=margin * scale)
    torch = pytest.importorskip("torch")
    if autocast:
        return  # torch's CPU autocast rounds elsewhere; the float32 case checks the algebra
    tx, tw, tb = (torch.tensor(t.numpy().astype(np.float64), requires_grad=True) for t in (x, w, b))
    loss = (torch.tanh(torch.nn.functional.linear(tx, tw, tb)) * 2).sum()
    loss.backward()
    for value, tensor in zip(found[1:], (tx, tw, tb)):
        np.testing.assert_allclose(value, tensor.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_gradient_clipping_keeps_the_weight_gradient_in_the_parameters_order(rng):
    """Clipping's total of squares over every axis reads a permuted value in its stored
    order (split.UNPERMUTE_TOTALS); for a transposed product that would give the product a
    second reader in its old order, and the optimizer would read the gradient through a tile
    transpose. The total leaves such a permute alone: no kernel reads the product through a
    permute, none transposes."""
    with fl.backend("cuda"):
        (_, _, dw, db), (_, w, b) = _linear_step(rng, autocast=True)
        total = ((dw.float() ** 2).sum() + (db.float() ** 2).sum()).sqrt()
        coef = (1.0 / (total + 1e-6)).clamp(max=1.0)
        updated = [w - 0.1 * dw * coef, b - 0.1 * db * coef]
        graph = run_pipeline(Graph(tuple(tensor.node for tensor in updated)))
    for group in graph.groups:
        for node in group.nodes:
            assert not (node.op == "permute" and node.inputs[0].op == "matmul"), group
    from flame.codegen.lower import lower_group
    from flame.runtime.executor import _layout_of

    kernels = [lower_group(g, _layout_of) for g in graph.groups if g.kind == "elementwise"]
    assert kernels and all(k.spec.template == "elementwise.cu.j2" for k in kernels)
