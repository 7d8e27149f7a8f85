"""Decisions that must not turn on sizes that coincide at one image size only (a step's
first size is often square somewhere: attention over 16x16 = 256 tokens of 256 channels).

- simplify copies a reshape onto a reduction's rows read across memory; whether a reshape
  feeds such rows is read from the graph (the reduction reads it through elementwise ops),
  not from its shape equalling some reduction's rows (flame/ir/passes/simplify.py).
- plan reuse (flame/ir/passes/reuse.py) applies a grouping made at a square size to a
  non-square one where the coincidence only touched what a kernel loads through a view.
"""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
from flame.ir.graph import Graph
from flame.ir.passes.simplify import simplify
from flame.runtime.reference import evaluate
from tests.test_plan_reuse_sizes import call, check_plans, planning  # noqa: F401


def _attention_like(rng, other_rows_read: bool):
    """A square [4, 1, 8, 8] product transposed and merged to [4, 8, 8] (a view), read by
    an elementwise op; beside it a reduction over an unrelated [4, 8, 8] value, or (with
    ``other_rows_read``) over the merged view itself."""
    v = fl.tensor(rng.standard_normal((4, 1, 8, 8)).astype(np.float32)).exp()
    merged = v.permute(0, 1, 3, 2).reshape(4, 8, 8)
    other = fl.tensor(rng.standard_normal((4, 8, 8)).astype(np.float32))
    rows = (merged if other_rows_read else other).sum(-1)
    return merged * 2.0, rows


def _copies(graph: Graph) -> int:
    return sum(1 for node in graph.nodes if node.op == "copy")


@pytest.mark.parametrize(
    ("other_rows_read", "copies"),
    [(False, 0), (True, 1)],
    ids=["shape-only-equals-other-rows-stays-a-view", "read-as-rows-across-memory-is-copied"],
)
def test_a_reshape_is_copied_only_where_a_reduction_reads_it(rng, other_rows_read, copies):
    outputs = _attention_like(rng, other_rows_read=other_rows_read)
    graph = Graph(tuple(t.node for t in outputs))
    simplified = simplify(graph)
    assert _copies(simplified) == copies
    for got, want in zip(evaluate(list(simplified.outputs)), evaluate(list(graph.outputs))):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_grouping_that_loads_through_a_square_transpose_is_reused(planning):  # noqa: F811
    """A kernel that reads a product [n, 8] through its transpose (an elementwise group with
    a permute member; the product stays in memory); at n = 8 the product's shape and the
    kernel's coincide. The grouping made there is reused at n = 4 and n = 12, and its groups
    compute the graph's values."""

    @fl.compile
    def step(x, w):
        z = x @ w + 1.0
        return z.sum(), z.transpose(0, 1).exp()

    w = np.full((8, 8), 0.125, np.float32)
    check_plans(call(planning, step, np.ones((8, 8), np.float32), w))
    for n in (4, 12):
        reused, refused = planning.decisions.reused, planning.decisions.refused
        check_plans(call(planning, step, np.full((n, 8), 0.5, np.float32), w))
        assert planning.decisions.refused == refused, f"n={n}: the grouping was refused"
        assert planning.decisions.reused > reused, f"n={n}: no grouping reused"
