"""Kernel merges never make two kernels wait for each other (CPU tier: the pass pipeline).

A library call (cuBLAS, cuDNN) reads a view of a value in place, so it waits for the kernel
that writes the view's base. The row kernel + column-strip merge (row_columns.py) once
checked cycles without that rule while fusion's ordering used it: a DiT's backward (adaLN
modulation, layer-norm rows, matmuls reading reshaped strip sums) then failed to plan with
``_Cycle``."""

import pytest

import flame as fl
import flame.nn.functional as F
from flame.ir.graph import Graph, Group
from flame.ir.passes import run_pipeline
from flame.ir.passes.fuse import _needs
from flame.ir.passes.library_views import materialized_reads
from flame.ir.passes.row_columns import _acyclic

models = pytest.importorskip("examples.diffusion.models", reason="the diffusion example")


def _dit_step_graph(depth: int) -> Graph:
    fl.manual_seed(0)
    model = models.build_model(
        "dit", 32, 3, 10, size="full", hidden_size=32, depth=depth, num_heads=1
    )
    x = fl.randn(2, 3, 32, 32)
    t, y = fl.randint(0, 1000, (2,)), fl.randint(0, 10, (2,))
    with fl.autocast("cuda", dtype=fl.bfloat16):
        loss = F.mse_loss(model(x, t, y).float(), x)
    loss.backward(create_graph=True)  # the gradients stay lazy values, to be planned here
    grads = [p.grad.node for p in model.parameters() if p.grad is not None]
    return Graph((loss.node, *grads))


@pytest.mark.parametrize("depth", [5, 6])
def test_dit_backward_plans_in_order(depth):
    with fl.backend("reference"):
        planned = run_pipeline(_dit_step_graph(depth))
    groups = list(planned.groups)
    # every kernel reads only what kernels before it wrote
    written = set()
    materialized = {id(out): out for group in groups for out in group.outputs}
    for index, group in enumerate(groups):
        later = materialized_reads(group, materialized) - written
        own = {id(out) for out in group.outputs}
        assert later <= own, f"kernel {index} reads a value written after it"
        written |= own
    assert any(group.kind == "library" for group in groups)


def test_library_read_through_a_view_counts_as_a_wait():
    """A matmul reading a reshape of a kernel's output waits for that kernel; a kernel that
    reads the matmul's result then cannot join the first: the cycle check sees it."""
    with fl.backend("reference"):
        a = fl.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]] * 4)
        summed = (a * 2.0).sum(0)  # a kernel writes it
        product = summed.reshape(2, 3) @ fl.tensor([[1.0, 0.0, 0.0]] * 3)  # read as a view
        after = product.sum()
    nodes = Graph((after.node, summed.node)).nodes
    written = next(node for node in nodes if node.op == "reduce_sum" and node.shape == (1, 6))
    library = next(node for node in nodes if node.op == "matmul")
    reader = next(node for node in nodes if node.op == "reduce_sum" and node.inputs[0] is library)
    assert library.inputs[0] is not written  # the matmul reads a view of it
    kernel = Group("reduce", (written,), (written,), ("output",))
    call = Group("library", (library,), (library,), ("output",))
    materialized = {id(written): written, id(library): library}
    assert materialized_reads(call, materialized) == {id(written)}
    assert _needs([kernel, call], materialized) == [set(), {0}]
    # the first kernel also reading the matmul's result: no order can run them
    merged = Group("reduce", (written, reader), (written, reader), ("a", "b"))
    assert not _acyclic([merged, call], materialized)
    assert _acyclic([kernel, call], materialized)
