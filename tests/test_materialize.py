"""Values the fusion pass writes before grouping (flame/ir/passes/materialize.py), CPU tier.

A residual stream (``x = x + f(x)`` per block) used by every block's kernels would be
recomputed in each of them from every earlier contribution: block k's kernels read k
tensors (a DiT step's layer-norm kernels read up to 50). Values whose recomputation reads
more than ``WIDE_SOURCES`` tensors of their size are written once instead."""

import pytest

import flame as fl
import flame.nn.functional as F
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.ir.passes.fuse import handed_out
from flame.ir.passes.materialize import WIDE_SOURCES, materialized_values


def _residual_stream(depth: int):
    """``x = x + layer_norm(x) @ w`` per block: each block's row kernel needs ``x``, and
    the product between blocks keeps the kernels apart."""
    x = fl.randn(8, 64).realize()
    weights = [fl.randn(64, 64).realize() for _ in range(depth)]
    for w in weights:
        x = x + F.layer_norm(x, (64,)) @ w
    return Graph((x.sum().node,))


def _reads(planned) -> int:
    """Reads of whole tensors, summed over the kernels (a tensor read by two kernels counts
    twice)."""
    total = 0
    for group in planned.groups:
        members = {id(node) for node in group.nodes}
        total += len({
            id(child) for node in group.nodes for child in node.inputs
            if id(child) not in members and child.numel >= 8 * 64
        })  # fmt: skip
    return total


@pytest.mark.parametrize("depth", [3, 12, 24])
def test_no_kernel_recomputes_a_long_chain(depth):
    with fl.backend("reference"):
        planned = run_pipeline(_residual_stream(depth))
    # linear in the depth: each product read by a few kernels, not by every later one
    assert _reads(planned) <= 5 * depth


def test_wide_values_are_written_with_their_reason():
    with fl.backend("reference"):
        graph = _residual_stream(12)
    chosen, reasons = materialized_values(graph, handed_out(graph))
    wide = [reasons[key] for key in chosen if "recomputing it would read" in reasons[key]]
    assert len(wide) >= 12 // (WIDE_SOURCES + 1)
    assert all(f"{WIDE_SOURCES + 1} values of its size" in reason for reason in wide)


def test_a_value_read_once_is_not_written():
    """One reader: no kernel recomputes it twice, so a long sum stays in one kernel."""
    with fl.backend("reference"):
        terms = [fl.randn(8, 64).realize() for _ in range(12)]
        total = terms[0]
        for term in terms[1:]:
            total = total + term
        graph = Graph((total.sum().node,))
    chosen, reasons = materialized_values(graph, handed_out(graph))
    assert not any("recomputing" in reason for reason in reasons.values())
    assert len(run_pipeline(graph).groups) == 1


def test_an_update_of_many_parameters_is_several_kernels():
    """An optimizer-style in-place update of 150 same-shaped tensors: each kernel writes at
    most MAX_ELEMENTWISE_OUTPUTS values (NVRTC's time grows faster than a kernel's size)."""
    from flame.ir.passes.fuse import MAX_ELEMENTWISE_OUTPUTS

    with fl.backend("reference"):
        params = [fl.randn(256).realize() for _ in range(150)]
        grads = [fl.randn(256).realize() for _ in range(150)]
        updated = [p - 0.1 * g for p, g in zip(params, grads)]
        planned = run_pipeline(Graph(tuple(u.node for u in updated)))
    assert all(len(group.outputs) <= MAX_ELEMENTWISE_OUTPUTS for group in planned.groups)
    assert len(planned.groups) == -(-150 // MAX_ELEMENTWISE_OUTPUTS)
