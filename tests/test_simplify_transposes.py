"""simplify pushes a transpose down to the leaves, so kernels read their inputs through index
maps, except into a value that other ops also read in its own order and that is not cheap to
recompute (flame/ir/passes/simplify.py): a DiT's residual stream is read as tokens by the
blocks and as channels by the patch embedding's backward. Pushed down, the whole stream was
computed a second time in channel order, reading every matmul output under it transposed."""

from __future__ import annotations

import numpy as np

import flame as fl
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.ir.passes.cost import RECOMPUTE_LIMIT
from flame.ir.passes.simplify import simplify
from flame.runtime.reference import evaluate


def _stream(rng, terms: int):
    """x = tokens + sum of ``terms`` products (each a block's gated branch), read as tokens
    (a row sum) and as channels (a transpose, then a sum over the other axes)."""
    n, t, d = 2, 12, 8
    x = fl.tensor(rng.standard_normal((n, t, d)).astype(np.float32))
    for _ in range(terms):
        gate = fl.tensor(rng.standard_normal((n, 1, d)).astype(np.float32))
        branch = fl.tensor(rng.standard_normal((n, t, d)).astype(np.float32))
        x = x + gate * fl.tanh(branch)
    as_tokens = (x * x).sum(-1)
    as_channels = x.transpose(1, 2).reshape(n, d, 3, 4).exp().sum((0, 2, 3))
    return as_tokens, as_channels


def _transposed_adds(graph: Graph) -> int:
    """Additions computed in channel order (the transposed stream, in any shape)."""
    return sum(1 for node in graph.nodes if node.op == "add" and node.shape != (2, 12, 8))


def test_an_expensive_shared_value_is_read_through_the_transpose(rng):
    outputs = _stream(rng, RECOMPUTE_LIMIT)  # more ops under the stream than the limit
    graph = simplify(Graph(tuple(t.node for t in outputs)))
    assert _transposed_adds(graph) == 0
    permutes = [node for node in graph.nodes if node.op == "permute"]
    assert [node.inputs[0].shape for node in permutes] == [(2, 12, 8)]  # on the stream itself


def test_a_cheap_shared_value_is_still_recomputed_in_the_other_order(rng):
    outputs = _stream(rng, 1)  # two ops: cheaper to recompute than to read transposed
    graph = simplify(Graph(tuple(t.node for t in outputs)))
    assert _transposed_adds(graph) == 1


def test_values_are_unchanged(rng):
    for terms in (1, RECOMPUTE_LIMIT):
        outputs = _stream(rng, terms)
        nodes = tuple(t.node for t in outputs)
        planned = run_pipeline(Graph(nodes))
        expected = evaluate(list(nodes), precision=np.float64, realized=False)
        found = evaluate(list(planned.outputs), precision=np.float64, realized=False)
        for a, b in zip(found, expected):
            np.testing.assert_allclose(a, b, rtol=1e-12)
