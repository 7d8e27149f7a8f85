"""A plan lowers each distinct group once (flame/codegen/lower.py ``PlanLowering``): a group
equal to one lowered before takes that result over its own nodes. Checked against lowering
every group afresh, on graphs planned for the CUDA backend without a GPU."""

from __future__ import annotations

import numpy as np

import flame as fl
import flame.nn.functional as F
from flame.codegen.lower import PlanLowering, lower_group
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.runtime.plans import _layout_of


def _zeros(*shape) -> fl.Tensor:
    return fl.from_numpy(np.zeros(shape, np.float32))


def _planned(outputs) -> Graph:
    return run_pipeline(Graph(tuple(tensor.node for tensor in outputs)))


def _blocks(x):
    """Three blocks of a convolution (a library call between the kernels), GroupNorm and
    SiLU, each with weights of its own: the same kernels over other nodes (and other user
    lines: the kernel headers differ)."""
    x = F.silu(F.group_norm(F.conv2d(x, _zeros(8, 8, 3, 3), padding=1), 4, _zeros(8), _zeros(8)))
    x = F.silu(F.group_norm(F.conv2d(x, _zeros(8, 8, 3, 3), padding=1), 4, _zeros(8), _zeros(8)))
    return F.silu(F.group_norm(F.conv2d(x, _zeros(8, 8, 3, 3), padding=1), 4, _zeros(8), _zeros(8)))


def _lowered_both_ways(graph: Graph):
    lowering = PlanLowering(_layout_of)
    groups = [group for group in graph.groups if group.kind != "library"]
    pairs = [(lowering.lower(group), lower_group(group, _layout_of)) for group in groups]
    return lowering, pairs


def test_equal_groups_are_lowered_once_with_their_own_nodes():
    with fl.backend("cuda"):
        graph = _planned([_blocks(_zeros(2, 8, 6, 6))])
        lowering, pairs = _lowered_both_ways(graph)
    assert lowering.repeated > 0, "no group repeated another"
    assert lowering.lowered < len(pairs)
    for got, want in pairs:
        assert got == want  # spec (header too), reads and outputs: the group's own nodes
        assert all(a is b for a, b in zip(got.reads, want.reads))
        assert all(a is b for a, b in zip(got.outputs, want.outputs))


def _group(function, *inputs):
    """The one kernel of ``function`` over ``inputs``, planned alone."""
    with fl.backend("cuda"):
        (group,) = _planned([function(*inputs)]).groups
    return group


def test_groups_differing_in_a_constant_or_an_input_layout_are_lowered_apart():
    """Groups of separate graphs given to one ``PlanLowering``: the same ops and sizes share
    a lowering; another scalar, or an input held transposed in memory (``layout_of``), is
    another kernel."""
    with fl.backend("cuda"):
        x, y, z, w = (_zeros(8, 8) for _ in range(4))
    twice = lambda v: (v * 2.0).exp()  # noqa: E731
    thrice = lambda v: (v * 3.0).exp()  # noqa: E731
    groups = [_group(twice, x), _group(twice, y), _group(thrice, z), _group(twice, w)]
    transposed = {id(w.node)}

    def layout_of(node):
        strides, aligned = _layout_of(node)
        return (strides[::-1], aligned) if id(node) in transposed else (strides, aligned)

    lowering = PlanLowering(layout_of)
    pairs = [(lowering.lower(group), lower_group(group, layout_of)) for group in groups]
    assert lowering.repeated == 1 and lowering.lowered == 3  # only y's repeats x's
    for got, want in pairs:
        assert got == want


def test_a_negative_zero_is_not_a_zero():
    """-0.0 == 0.0 in Python (and hashes alike), but a kernel spells them apart: groups that
    differ only so are lowered apart."""
    with fl.backend("cuda"):
        x, y = _zeros(8, 8), _zeros(8, 8)
    groups = [
        _group(lambda v: fl.nan_to_num(v.log(), nan=0.0), x),
        _group(lambda v: fl.nan_to_num(v.log(), nan=-0.0), y),
    ]
    lowering = PlanLowering(_layout_of)
    pairs = [(lowering.lower(group), lower_group(group, _layout_of)) for group in groups]
    assert lowering.repeated == 0
    for got, want in pairs:
        assert got == want
    assert pairs[0][0].spec.body != pairs[1][0].spec.body
