"""Graph outputs handed out as views of a library call's result (no copy): only where no other
value of the graph reads them (the plan's kernels take what they read from an earlier kernel
to be contiguous). CPU tier: the grouping; gpu tier: values, with the view read in the same
graph and in a later one."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline, simplify


def _groups(*tensors):
    graph = run_pipeline(Graph(tuple(tensor.node for tensor in tensors)))
    return [
        (group.kind, [node.op for node in group.nodes], group.reasons) for group in graph.groups
    ]


def _operands(rng):
    a = fl.tensor(rng.standard_normal((4, 6)).astype(np.float32))
    b = fl.tensor(rng.standard_normal((6, 8)).astype(np.float32))
    return a, b


def test_an_output_view_nothing_else_reads_is_handed_out(rng):
    with fl.backend("cuda"):  # building and planning touch no GPU
        a, b = _operands(rng)
        product = a @ b
        groups = _groups(product.T, product[1:3])
    views = [group for group in groups if group[0] == "library" and group[1][0] != "matmul"]
    assert sorted(group[1][0] for group in views) == ["permute", "slice"], groups
    assert all("no copy" in group[2][0] for group in views)


def test_an_output_view_another_value_reads_is_written_out(rng, monkeypatch):
    # a product read only transposed is computed transposed (no view left to hand out)
    monkeypatch.setattr(simplify, "TRANSPOSED_PRODUCTS", False)
    with fl.backend("cuda"):
        a, b = _operands(rng)
        transposed = (a @ b).T
        groups = _groups(transposed, transposed * 2.0)
    assert [group[1] for group in groups if group[0] == "library"] == [["matmul"]], groups
    kernel = next(group for group in groups if group[0] == "elementwise")
    assert "permute" in kernel[1] and "mul" in kernel[1]


@pytest.mark.gpu
def test_values_of_views_read_in_the_same_and_a_later_graph(rng):
    a, b = _operands(rng)
    want = a.numpy() @ b.numpy()
    transposed = (a @ b).T
    doubled = transposed * 2.0
    fl.realize(transposed, doubled)
    np.testing.assert_allclose(transposed.numpy(), want.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(doubled.numpy(), 2 * want.T, rtol=1e-5, atol=1e-5)
    sliced = (a @ b)[:, 1:]  # handed out as a view at an unaligned offset, then read again
    np.testing.assert_allclose(sliced.numpy(), want[:, 1:], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose((sliced + 1.0).numpy(), want[:, 1:] + 1, rtol=1e-5, atol=1e-5)
