"""A reduction over every axis of elementwise work on permuted values reads the values in
their stored order (flame/ir/passes/split.py, ``UNPERMUTE_TOTALS``): gradient clipping's
``(permute(dW).abs() ** 2).sum()`` on a weight gradient that arrives in another order than
its parameter (a conv's [O, kh, kw, C] against [O, C, kh, kw]) no longer needs a
tile-transposing kernel. Values stay the reference's."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline, split
from flame.runtime.reference import evaluate


def _planned(*outputs):
    return run_pipeline(Graph(tuple(t.node for t in outputs)), verify_each=True)


def _permutes_under_reductions(graph) -> int:
    found, stack, seen = 0, [n for n in graph.nodes if n.op.startswith("reduce")], set()
    while stack:
        node = stack.pop()
        for child in node.inputs:
            if id(child) in seen:
                continue
            seen.add(id(child))
            found += child.op == "permute"
            stack.append(child)
    return found


def _clip_norm(g, scale=2.0):
    p = g.permute(0, 3, 1, 2)
    return ((p.abs() * p.abs()) * scale).sum()


@pytest.mark.parametrize("shape", [(64, 3, 3, 32), (512, 3, 3, 256)])  # unsplit, two-stage
def test_the_total_reads_the_stored_order(shape, rng, cuda_backend):
    g = fl.tensor(rng.standard_normal(shape).astype(np.float32))
    graph = _planned(_clip_norm(g))
    assert _permutes_under_reductions(graph) == 0


def test_switch_off_keeps_the_permute(rng, cuda_backend, monkeypatch):
    monkeypatch.setattr(split, "UNPERMUTE_TOTALS", False)
    g = fl.tensor(rng.standard_normal((512, 3, 3, 256)).astype(np.float32))
    assert _permutes_under_reductions(_planned(_clip_norm(g))) > 0


def test_mixed_orders_are_left_alone(rng, cuda_backend):
    """a * b with a permuted and b not: no common stored order to read both in."""
    a = fl.tensor(rng.standard_normal((16, 16)).astype(np.float32))
    b = fl.tensor(rng.standard_normal((16, 16)).astype(np.float32))
    node = (a.permute(1, 0) * b).sum().node
    while node.op != "reduce_sum":
        node = node.inputs[0]
    assert split._unpermuted(node.inputs[0]) is None
    assert split._unpermuted((a.permute(1, 0) * b.permute(1, 0)).node) is not None


def test_a_reduction_over_some_axes_keeps_its_permute(rng, cuda_backend):
    g = fl.tensor(rng.standard_normal((64, 3, 3, 32)).astype(np.float32))
    node = g.permute(0, 3, 1, 2).abs().sum(dim=(1, 2, 3)).node
    while node.op != "reduce_sum":
        node = node.inputs[0]
    assert split._split(node) is None


@pytest.mark.parametrize("op", ["sum", "amax"])
@pytest.mark.parametrize("shape", [(64, 3, 3, 32), (512, 3, 3, 256)])
def test_values(op, shape, rng, reference_backend):
    values = rng.standard_normal(shape).astype(np.float32)
    g = fl.tensor(values)
    p = g.permute(0, 3, 1, 2)
    out = getattr((p.abs() * p.abs()) * 2.0, op)()
    graph = _planned(out)
    (got,) = evaluate(list(graph.outputs), precision=np.float64, realized=False)
    expected = getattr(np, op)(np.abs(values) ** 2 * 2.0)
    np.testing.assert_allclose(np.asarray(got, np.float64).reshape(()), expected, rtol=1e-5)
