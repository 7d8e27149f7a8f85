"""-0.0 is not 0.0 to a kernel (``1 / (x * -0.0)`` is -inf), though Python's == and hash
say they are equal: common-subexpression elimination, the plan cache's keys and lazy mode's
recorded walks keep them apart (``flame.ir.node.attrs_key``)."""

from __future__ import annotations

import numpy as np

import flame as fl
from flame.ir.graph import Graph, is_input
from flame.ir.passes import run_pipeline
from flame.runtime import reference
from flame.runtime.walks import compile_walk, linearize, match_walk, record_walk


def _reciprocal(x, zero: float) -> fl.Tensor:
    return 1.0 / (x.exp() * zero)


def _evaluate(graph: Graph) -> list[np.ndarray]:
    inputs = {id(n): reference.input_value(n) for n in graph.nodes if is_input(n)}
    return reference.evaluate(list(graph.outputs), inputs=inputs)


def test_the_passes_keep_a_negative_zero():
    with fl.backend("cuda"):
        x = fl.from_numpy(np.ones(4, np.float32))
        graph = Graph((_reciprocal(x, 0.0).node, _reciprocal(x, -0.0).node))
        planned = run_pipeline(graph)
    positive, negative = _evaluate(planned)
    assert np.all(positive == np.inf) and np.all(negative == -np.inf)


def test_plan_keys_and_recorded_walks_tell_the_zeros_apart():
    with fl.backend("cuda"):
        x = fl.from_numpy(np.ones(4, np.float32))
        roots = [_reciprocal(x, zero).node for zero in (0.0, -0.0, 0.0)]
    walks = [linearize([root]) for root in roots]
    keys = [key for _, _, key in walks]
    assert keys[0] != keys[1] and keys[0] == keys[2]
    order, _, key = walks[0]
    entries = record_walk(order, key)
    matcher = compile_walk(entries)
    assert match_walk(entries, roots[2]) is not None and matcher(roots[2]) is not None
    assert match_walk(entries, roots[1]) is None and matcher(roots[1]) is None
