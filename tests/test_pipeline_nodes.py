"""The pass pipeline hands a graph's node order on when a pass keeps every output
(flame/ir/passes/pipeline.py ``_nodes_kept``): fewer sorts, and each pass's graph still lists
exactly the nodes a fresh sort of its outputs gives, in that order."""

from __future__ import annotations

import numpy as np

import flame as fl
import flame.nn.functional as F
from flame.ir import graph as graph_module
from flame.ir.graph import Graph, is_input
from flame.ir.node import toposort
from flame.ir.passes import pipeline, run_pipeline


def _step_graph() -> Graph:
    with fl.backend("cuda"):
        x = fl.from_numpy(np.zeros((2, 8, 6, 6), np.float32))
        w = fl.from_numpy(np.zeros((8, 8, 3, 3), np.float32))

        def block(x):
            return F.silu(F.group_norm(F.conv2d(x, w, padding=1), 4)).sum()

        loss, pullback = fl.vjp(block, x)
        return Graph(tuple(t.node for t in (loss, *pullback(fl.ones(())))))


def _sorts(monkeypatch, graph: Graph):
    count = []
    monkeypatch.setattr(
        graph_module, "toposort", lambda *a, **k: count.append(1) or toposort(*a, **k)
    )
    with fl.backend("cuda"):
        result = run_pipeline(graph, record=True)
    monkeypatch.undo()
    return len(count), result


def test_every_pass_graph_lists_its_own_nodes_with_fewer_sorts(monkeypatch):
    kept_sorts, (final, history) = _sorts(monkeypatch, _step_graph())
    monkeypatch.setattr(pipeline, "_nodes_kept", lambda before, after: after)
    fresh_sorts, _ = _sorts(monkeypatch, _step_graph())
    assert kept_sorts < fresh_sorts
    for record in history:
        fresh = toposort(record.graph.outputs, stop=is_input)
        assert len(record.graph.nodes) == len(fresh)
        assert all(a is b for a, b in zip(record.graph.nodes, fresh)), record.name
    assert final.groups
