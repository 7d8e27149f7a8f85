"""Kernels split to break a cycle (flame/ir/passes/cycles.py) must still find everything they
read in memory: a part left without the reduction its kernel had can no longer compute a
value derived from that reduction, so the value is written and the kernels are formed again
(fuse.py). ``verify_groups`` (flame/ir/verify.py) checks the rule on every grouped graph."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
import flame.nn.functional as F
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.ir.verify import VerifyError, verify_groups


def _classifier_step(rng, batch=16):
    """Three convs with GroupNorm + SiLU, a linear head and cross-entropy; the loss and the
    gradient of every parameter (the graph where a split part once read an unwritten value:
    cross-entropy's backward, [16, 10] logits)."""

    def parameter(*shape):
        return fl.tensor((rng.standard_normal(shape) * 0.1).astype(np.float32))

    c1, c1b, g1w, g1b = parameter(32, 3, 3, 3), parameter(32), parameter(32), parameter(32)
    c2, c2b, g2w, g2b = parameter(32, 32, 3, 3), parameter(32), parameter(32), parameter(32)
    c3, c3b, lw, lb = parameter(8, 32, 3, 3), parameter(8), parameter(10, 512), parameter(10)
    params = [c1, c1b, g1w, g1b, c2, c2b, g2w, g2b, c3, c3b, lw, lb]
    x = fl.tensor(rng.standard_normal((batch, 3, 8, 8)).astype(np.float32))
    labels = fl.tensor(rng.integers(0, 10, batch))

    def loss_of(c1, c1b, g1w, g1b, c2, c2b, g2w, g2b, c3, c3b, lw, lb):
        h = F.silu(F.group_norm(F.conv2d(x, c1, c1b, padding=1), 8, g1w, g1b))
        h = F.silu(F.group_norm(F.conv2d(h, c2, c2b, padding=1), 8, g2w, g2b))
        h = F.conv2d(h, c3, c3b, padding=1).flatten(1)
        return F.cross_entropy(F.linear(h, lw, lb), labels)

    loss, pullback = fl.vjp(loss_of, *params)  # lazy: nothing runs
    return [loss, *pullback(fl.ones_like(loss))]


def test_every_kernel_reads_only_written_values(cuda_backend, rng):
    outputs = _classifier_step(rng)
    graph = run_pipeline(Graph(tuple(t.node for t in outputs)), verify_each=True)
    verify_groups(graph)
    kinds = {group.kind for group in graph.groups}
    assert {"reduce", "elementwise", "library"} <= kinds


def test_the_check_names_a_kernel_reading_an_unwritten_value(cuda_backend, rng):
    outputs = _classifier_step(rng)
    graph = run_pipeline(Graph(tuple(t.node for t in outputs)))
    groups = list(graph.groups)
    # drop the writer of a value a later kernel reads: that kernel now reads nothing written
    written_by = {id(out): index for index, g in enumerate(groups) for out in g.outputs}
    for index, group in enumerate(groups):
        read = [written_by[id(c)] for n in group.nodes for c in n.inputs
                if id(c) in written_by and written_by[id(c)] != index]  # fmt: skip
        if read and groups[read[0]].kind != "library":
            del groups[read[0]]
            break
    else:
        pytest.fail("no kernel reads another kernel's output")
    broken = Graph(graph.outputs, graph.name, tuple(groups))
    with pytest.raises(VerifyError, match="which no earlier kernel writes"):
        verify_groups(broken)
