"""Passes, printer and verifier on small graphs (CPU tier, no GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
from flame.ir.graph import Graph
from flame.ir.node import Node
from flame.ir.passes import run_pipeline
from flame.ir.passes.cost import RECOMPUTE_LIMIT
from flame.ir.passes.cse import cse
from flame.ir.passes.fuse import fuse
from flame.ir.passes.simplify import simplify
from flame.ir.verify import VerifyError, verify
from flame.runtime.reference import evaluate


def buffer(shape=(4, 8), dtype=np.float32, seed=0):
    return fl.from_numpy(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


def ops_of(graph):
    return [node.op for node in graph.nodes if not node.op == "buffer"]


def test_cse_merges_identical_subexpressions():
    x = buffer()
    y = (x.exp() + 1) * (x.exp() + 1)
    graph = cse(Graph((y.node,)))
    assert ops_of(graph).count("exp") == 1
    assert ops_of(graph).count("add") == 1
    expected = (np.exp(x.numpy()) + 1) ** 2
    np.testing.assert_allclose(evaluate(graph.outputs)[0], expected, rtol=1e-5)


def test_cse_keeps_distinct_buffers_apart():
    a, b = buffer(seed=0), buffer(seed=0)  # equal contents, two arrays
    graph = cse(Graph(((a + b).node,)))
    assert len(graph.inputs) == 2


def test_simplify_folds_constants_and_drops_identities():
    x = buffer()
    y = (x * 1) / 1 - 0
    z = fl.full((4, 8), 2.0) * 3.0 + x
    graph = simplify(Graph((y.node, z.node)))
    assert graph.outputs[0] is x.node
    assert "mul" not in ops_of(Graph((graph.outputs[1],)))
    folded = [node for node in graph.nodes if node.op == "const"]
    assert [node.attr("value") for node in folded] == [6.0]


def test_simplify_keeps_float_add_zero_and_mul_zero():
    # x + 0.0 turns -0.0 into 0.0 and x * 0 is not 0 for inf/NaN: both must stay.
    x = buffer()
    graph = simplify(Graph(((x + 0.0).node, (x * 0.0).node)))
    assert [node.op for node in graph.outputs] == ["add", "mul"]


def test_simplify_integer_add_zero():
    x = fl.from_numpy(np.arange(6, dtype=np.int32))
    graph = simplify(Graph(((x + 0).node,)))
    assert graph.outputs[0] is x.node


def test_pow_two_becomes_multiply():
    x = buffer()
    graph = simplify(Graph(((x**2).node,)))
    assert graph.outputs[0].op == "mul"


def test_fusion_makes_one_kernel_for_a_chain_with_broadcast():
    x = buffer((64, 32))
    b = buffer((32,), seed=1)
    y = fl.gelu(x * 1.5 + b, approximate="tanh") * x.sigmoid() - 0.5 * x * x
    graph = run_pipeline(Graph((y.node,)), verify_each=True)
    assert len(graph.groups) == 1
    assert graph.groups[0].outputs == graph.outputs


def test_fusion_writes_shared_values_once_in_one_kernel():
    x = buffer()
    shared = x.exp()
    first, second = shared + 1, shared * 2
    graph = run_pipeline(Graph((shared.node, first.node, second.node)))
    assert len(graph.groups) == 1
    assert len(graph.groups[0].outputs) == 3
    assert sum(node.op == "exp" for node in graph.groups[0].nodes) == 1


def test_fusion_materializes_large_broadcast_computations():
    x = buffer((16, 8))
    row = buffer((8,), seed=1)
    for _ in range(RECOMPUTE_LIMIT + 2):
        row = row.tanh()
    graph = fuse(Graph(((x + row).node,)))
    assert len(graph.groups) == 2
    first, second = graph.groups
    assert first.outputs[0].shape == (8,)
    assert "recomputed" in first.reasons[0]
    assert any(child is first.outputs[0] for node in second.nodes for child in node.inputs)


def test_fusion_recomputes_small_broadcast_computations():
    x = buffer((16, 8))
    row = buffer((8,), seed=1).exp()
    graph = run_pipeline(Graph(((x + row).node,)))  # simplify pushes the broadcast below exp
    assert len(graph.groups) == 1


def test_outputs_of_different_shapes_get_one_kernel_each_in_order():
    row = buffer((8,)).exp()
    x = buffer((16, 8), seed=2)
    graph = run_pipeline(Graph((row.node, (x + row).node)))
    assert [group.outputs[0].shape for group in graph.groups] == [(8,), (16, 8)]
    # the larger kernel reads the realized row instead of recomputing it
    assert not any(node.op == "exp" for node in graph.groups[1].nodes)


def test_pipeline_preserves_values():
    x, y = buffer(), buffer(seed=3)
    z = ((x * 1 + y) * (x * 1 + y)).tanh() - fl.full((4, 8), 1.0) * 2
    before = evaluate([z.node])[0]
    after = run_pipeline(Graph((z.node,)))
    np.testing.assert_allclose(evaluate(after.outputs)[0], before, rtol=1e-6)


def test_printer_is_deterministic_and_names_by_position():
    def build():
        x = fl.from_numpy(np.ones((2, 3), np.float32))
        return (x.exp() + 1.0).node

    first, second = str(Graph((build(),))), str(Graph((build(),)))
    assert first == second
    assert first.splitlines()[0] == "graph f(%0: f32[2,3]) {"
    assert "exp(%0)" in first
    assert "test_passes.py:" in first  # each line names the user's line


def test_verifier_rejects_a_node_that_disagrees_with_its_rule():
    x = buffer()
    wrong = Node("exp", (x.node,), (), fl.int32, x.shape)
    with pytest.raises(VerifyError, match="exp"):
        verify(Graph((wrong,)))
    bad_shape = Node("add", (x.node, buffer((8,)).node), (), fl.float32, (4, 8))
    with pytest.raises(Exception, match="add"):
        verify(Graph((bad_shape,)))


def test_views_of_realized_values_read_them_instead_of_recomputing(reference_backend):
    """A reshape/permute/expand of a value that is already realized must read its memory:
    pushing the view through it would recompute everything behind it (and, on the GPU,
    plan a kernel that reads a value no kernel writes)."""
    from flame.ir.graph import Graph
    from flame.ir.passes.simplify import simplify

    x = fl.tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
    z = ((x * 2.0).exp() + 1.0).realize()
    for view in (z.reshape(4, 3), z.T, z.reshape(3, 1, 4).expand(3, 2, 4)):
        result = (view * 3.0).sum()
        graph = simplify(Graph((result.node,)))
        ops = {node.op for node in graph.nodes}
        assert "exp" not in ops, ops  # z is read, not recomputed
        expected = (np.asarray(view.numpy()) * 3.0).sum()
        np.testing.assert_allclose(result.numpy(), expected, rtol=1e-6)


def test_a_transpose_of_a_value_with_other_readers_reads_it(cuda_backend):
    """h = gelu(x) feeds a matmul and, transposed, another matmul (a weight gradient): the
    transposed use must read h through a view, not recompute gelu in transposed order."""
    x = fl.tensor(np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(64, 32))
    w = fl.tensor(np.ones((32, 16), np.float32))
    h = fl.gelu(x)
    out = (h @ w).sum() + (h.T @ fl.tensor(np.ones((64, 8), np.float32))).sum()
    graph = run_pipeline(Graph((out.node,)))
    gelu_kernels = [g for g in graph.groups if any(n.op == "gelu" for n in g.nodes)]
    assert len(gelu_kernels) == 1, [[n.op for n in g.nodes] for g in graph.groups]
    # and cuBLAS reads h through the transposed view: no copy kernel
    copies = [
        g
        for g in graph.groups
        if g.kind != "library"
        and {n.op for n in g.nodes} <= {"permute", "reshape", "expand", "slice"}
    ]
    assert not copies


def test_detach_is_the_same_value(reference_backend):
    x = fl.tensor(np.arange(6, dtype=np.float32))
    y = (x * 2.0).detach() + 1.0
    graph = simplify(Graph((y.node,)))
    assert "detach" not in {node.op for node in graph.nodes}
    np.testing.assert_array_equal(y.numpy(), np.arange(6) * 2 + 1)


def test_a_split_reduction_reads_a_value_a_matmul_reads_anyway(cuda_backend):
    """The bias gradient of an MLP's first layer sums d_hidden over the batch: the split
    reduction must read d_hidden (written anyway for the weight gradient's matmul) instead of
    recomputing GELU's derivative from its two inputs."""
    import flame.nn.functional as F

    b, d, h = 8192, 256, 4096
    x = fl.tensor(np.ones((b, d), np.float32))
    y = fl.tensor(np.ones((b, d), np.float32))
    ws = [fl.tensor(np.ones(s, np.float32)) for s in [(d, h), (h,), (h, d), (d,)]]

    def loss(w1, b1, w2, b2):
        return F.mse_loss(F.gelu(x @ w1 + b1) @ w2 + b2, y)

    _, grads = fl.value_and_grad(loss, argnums=(0, 1, 2, 3))(*ws)
    graph = run_pipeline(Graph(tuple(g.node for g in grads)))
    recomputing = [
        g for g in graph.groups if g.kind == "reduce" and any(n.op == "erf" for n in g.nodes)
    ]
    assert not recomputing
    # GELU's derivative is computed once, by the elementwise kernel that writes d_hidden
    assert sum(any(n.op == "erf" for n in g.nodes) for g in graph.groups) == 1


def test_a_library_call_runs_after_the_kernel_writing_the_base_of_its_view(cuda_backend):
    """embedding's backward scatters a reshaped, masked gradient: the scatter reads the
    masked value through a view, so the kernel that writes it must come first."""
    from flame.ir.passes.library_views import library_view

    i = fl.tensor(np.array([[0, 2, 1], [4, 2, 3]], np.int64))
    w = fl.tensor(np.ones((5, 3), np.float32))
    g = fl.grad(lambda w: (fl.embedding(i, w, padding_idx=2) * 2.0).sum())(w)
    graph = run_pipeline(Graph((g.node,)))
    written_before: set[int] = set()
    for group in graph.groups:
        if group.kind == "library":
            for child in group.nodes[0].inputs:
                view = library_view(child)
                base = view[0] if view else child
                if not (base.buffer is not None or base.op == "buffer"):
                    assert id(base) in written_before, base.op
        written_before |= {id(node) for node in group.outputs}


def test_a_reduction_kernel_writes_no_reordering_view_of_its_result(reference_backend):
    # a reduction's kernel writes its outputs in row order: a reversed view of the sum is
    # written by a kernel that reads the sum from memory (it was written reversed-as-is)
    x = fl.tensor(np.arange(12, dtype=np.float32).reshape(1, 3, 4))
    total = fl.sum(x, 0, keepdim=True) + x.amax() * 0.0
    reversed_rows = total[:, ::-1]
    graph = run_pipeline(Graph((reversed_rows.flatten().node, total.node)))
    for group in graph.groups:
        if group.kind == "reduce":
            assert all(node.op != "slice" for node in group.outputs), group
    expected = np.arange(12, dtype=np.float32).reshape(3, 4)[::-1].reshape(-1)
    np.testing.assert_allclose(reversed_rows.flatten().numpy(), expected)


def test_many_sibling_reductions_are_split_into_kernels_of_bounded_size(cuda_backend):
    # 200 bias gradients of one shape share a row key; one kernel for all of them needed
    # 200 KiB of shared memory and failed in ptxas (a 200-layer model's backward)
    from flame.ir.passes.fuse import MAX_REDUCE_OUTPUTS

    xs = [fl.randn(16, 64, seed=i) for i in range(80)]
    sums = [x.sum(0) for x in xs]
    graph = run_pipeline(Graph(tuple(s.node for s in sums)))
    reduce_groups = [g for g in graph.groups if g.kind == "reduce"]
    assert len(reduce_groups) == 3
    assert all(len(g.outputs) <= MAX_REDUCE_OUTPUTS for g in reduce_groups)
    written = {id(node) for g in reduce_groups for node in g.outputs}
    assert all(id(s.node) in written for s in sums)


@pytest.mark.gpu
def test_many_sibling_reductions_compute_on_gpu():
    with fl.backend("cuda"):
        xs = [fl.randn(16, 64, seed=i) for i in range(80)]
        sums = fl.realize(*[x.sum(0) for x in xs])
        expected = [x.numpy().sum(0) for x in xs]
    for got, want in zip(sums, expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_cyclic_components_are_the_strongly_connected_components(rng):
    import networkx as nx

    from flame.ir.passes.cycles import cyclic_components

    for _ in range(200):
        n = int(rng.integers(2, 30))
        needs = [
            {j for j in range(n) if j != i and rng.random() < 0.08} for i in range(n)
        ]  # fmt: skip
        graph = nx.DiGraph()
        graph.add_nodes_from(range(n))
        graph.add_edges_from((i, j) for i, sources in enumerate(needs) for j in sources)
        expected = sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)
        assert sorted(sorted(c) for c in cyclic_components(needs)) == expected


def test_a_deep_chain_is_split_in_a_few_rounds_not_one_per_layer(cuda_backend, monkeypatch):
    # forward + backward of a 30-layer MLP: fusion merges a value of every layer into one
    # kernel, which waits on itself through the matmuls; peeling one level a round made
    # planning quadratic in the depth (200 layers: a minute). Levels are split at once.
    import flame.ir.passes.fuse as fuse_module
    import flame.nn.functional as F
    from flame.autograd import cotangents

    rounds = []
    original = fuse_module.split_cycles

    def counted(*args, **kwargs):
        rounds.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(fuse_module, "split_cycles", counted)
    from flame.runtime.storage import Storage

    def memory(*shape):  # weights in memory, as a model's are (never computed here)
        host = np.zeros(shape, np.float32)
        node = Node("buffer", (), (("storage", Storage("cuda", fl.float32, host=host)),),
                    fl.float32, shape, None)  # fmt: skip
        return fl.Tensor(node, "cuda")

    weights = [(memory(16, 16).requires_grad_(), memory(16).requires_grad_()) for _ in range(30)]
    h = memory(4, 16)
    for w, b in weights:
        h = F.silu(h @ w.T + b)
    loss = F.mse_loss(h, fl.zeros(4, 16))
    targets = [w.node for w, _ in weights] + [b.node for _, b in weights]
    grads = cotangents([loss], [fl.ones(())], targets, "cuda")
    graph = run_pipeline(Graph(tuple(grads[id(t)].node for t in targets) + (loss.node,)))
    assert graph.groups and len(rounds) <= 10, len(rounds)


def test_simplify_pushes_a_reshape_through_shared_operands_once_each(monkeypatch):
    """``h = h * h + 1`` repeated: every value is read twice, so a push that does not
    remember what it did visits 2^depth values. Counted, not timed."""
    import flame.ir.passes.simplify as simplify_module

    calls = []
    pushed = simplify_module._pushed
    monkeypatch.setattr(simplify_module, "_pushed", lambda *args: calls.append(1) or pushed(*args))
    with fl.backend("cuda"):  # building touches no GPU
        h = fl.tensor(np.ones((4, 6), np.float32))
        for _ in range(24):
            h = h * h + 1
        out = h.reshape(24)
    simplify_module.simplify(Graph((out.node,)))
    assert len(calls) < 200, len(calls)
