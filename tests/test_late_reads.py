"""A library call's operand read again much later (a GELU output read by the second linear
layer in the forward and by its weight gradient in the backward) is computed again for the
late read instead of being kept (flame/ir/passes/late_reads.py)."""

from __future__ import annotations

import numpy as np

import flame as fl
import flame.nn.functional as F
from flame.ir.graph import Graph
from flame.ir.passes import cse, dce, late_reads
from flame.runtime import reference


def _mlp_gradients(rng, tokens=64, width=32, hidden=128):
    def t(*shape):
        return fl.tensor((rng.standard_normal(shape) * 0.2).astype(np.float32))

    x, w1, b1, w2 = t(tokens, width), t(hidden, width), t(hidden), t(width, hidden)

    def loss_of(w1, b1, w2):
        h = F.linear(x, w1, b1)
        for _ in range(3):  # a few layers after it: the backward comes much later
            h = F.gelu(F.linear(F.gelu(h), w2) @ w1.transpose(0, 1) + b1)
        return (F.linear(F.gelu(h), w2) ** 2).mean()

    loss, pullback = fl.vjp(loss_of, w1, b1, w2)
    return [loss, *pullback(fl.ones_like(loss))]


def _graph(outputs):
    return dce.dce(cse.cse(Graph(tuple(t.node for t in outputs))))


def test_late_reads_of_a_gelu_output_read_a_copy_with_the_same_values(
    cuda_backend, rng, monkeypatch
):
    monkeypatch.setattr(late_reads, "MIN_BYTES", 0)
    monkeypatch.setattr(late_reads, "MIN_GAP", 8)
    graph = _graph(_mlp_gradients(rng))
    copied = late_reads.late_reads(graph)
    gelus = [n for n in graph.nodes if n.op == "gelu"]
    copied_gelus = [n for n in copied.nodes if n.op == "gelu"]
    assert len(copied_gelus) > len(gelus)
    barriers = [n for n in copied.nodes if n.op == "barrier"]
    assert barriers  # each copy waits for the backward
    # the copies are read (through views) by matmuls (the late weight gradients) or by the
    # copies' own chains (a GELU of a GELU), never by a node the forward had
    new = {id(n) for n in copied_gelus} - {id(n) for n in gelus}
    made = {id(n) for n in copied.nodes} - {id(n) for n in graph.nodes}
    matmuls = 0
    for node in copied.nodes:
        if node.op in ("reshape", "permute", "expand", "slice"):
            continue
        for child in node.inputs:
            while child.op in ("reshape", "permute", "expand", "slice"):
                child = child.inputs[0]
            if id(child) in new:
                assert node.op == "matmul" or id(node) in made, node
                matmuls += node.op == "matmul"
    assert matmuls
    want = reference.evaluate(list(graph.outputs))
    got = reference.evaluate(list(copied.outputs))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_no_copy_for_a_small_value_or_when_off(cuda_backend, rng, monkeypatch):
    graph = _graph(_mlp_gradients(rng))
    assert late_reads.late_reads(graph) is graph  # every value under MIN_BYTES
    monkeypatch.setattr(late_reads, "MIN_BYTES", 0)
    monkeypatch.setattr(late_reads, "MIN_GAP", 8)
    monkeypatch.setattr(late_reads, "ENABLED", False)
    assert late_reads.late_reads(graph) is graph
