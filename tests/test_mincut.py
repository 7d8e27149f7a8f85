"""Save or recompute (flame/ir/passes/remat.py): a min-cut over the values more than one
kernel computes chooses which are written once and which each later kernel recomputes.

CPU tier, reference backend: the plans' shapes and planned bytes, the plans run kernel by
kernel on the CPU (each kernel from what it reads only), the dump's account of the decision,
and compiled == lazy == a NumPy reference for a training step whose activation is saved."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pytest

import flame as fl
import flame.nn.functional as F
from bench import expressions
from flame.ir.graph import Graph, Remat, is_input
from flame.ir.passes import pipeline, run_pipeline
from flame.ir.passes.remat import Shared, decide, planned_bytes, remat
from flame.runtime.reference import evaluate
from flame.tools.analysis import remat_lines
from flame.tools.check import reference_outputs


@pytest.fixture(autouse=True)
def wide_sources_four(monkeypatch):
    """These tests pin the save-or-recompute min-cut's choices with
    ``materialize.WIDE_SOURCES`` at 4, its value until session 19. At the default (1) a shared
    value whose recomputation reads two values of its size is written by the fusion pass before
    the min-cut sees it (materialize.py; measured faster on the DiT and UNet steps,
    notes/performance-session19.md)."""
    from flame.ir.passes import materialize

    monkeypatch.setattr(materialize, "WIDE_SOURCES", 4)


N = 256
F32 = 4


def _t(rng, *shape):
    return fl.tensor(rng.standard_normal(shape).astype(np.float32))


def _plans(outputs) -> tuple[Graph, Graph]:
    """(the plan fusion alone makes, the plan after the save-or-recompute pass)."""
    graph = Graph(tuple(t.node for t in outputs))
    for step in pipeline.PIPELINE:
        if step is remat:
            return graph, remat(graph)
        graph = step(graph)
    raise AssertionError("remat is not in the pipeline")


def _run_kernel_by_kernel(graph: Graph) -> dict[int, np.ndarray]:
    """Every kernel's outputs computed on the CPU from what that kernel reads: graph inputs
    and earlier kernels' outputs (a kernel that needed anything else fails here)."""
    known: dict[int, np.ndarray] = {}
    for group in graph.groups:
        if group.kind == "library":  # it reads its inputs through views of known values
            outputs = evaluate(list(group.outputs), inputs=known)
        else:
            outputs, _ = reference_outputs(group, known)
        for node, value in zip(group.outputs, outputs):
            known[id(node)] = value
    return known


def _reads(group) -> set[int]:
    members = {id(node) for node in group.nodes}
    return {id(c) for node in group.nodes for c in node.inputs if id(c) not in members}


# -- saving wins: v = a * b + c, needed again after a matmul ---------------------------------


def _saved_activation(rng):
    a, b, c, w = (_t(rng, N, N) for _ in range(4))
    v = a * b + c
    z = fl.sin(v) @ w  # sin(v) is written for the matmul; v itself is not
    return (a, b, c, v), [z * fl.cos(v)]  # the kernel after the matmul reads none of a, b, c


def test_a_value_recomputed_from_three_inputs_is_saved(reference_backend, rng):
    (a, b, c, v), outputs = _saved_activation(rng)
    fused, graph = _plans(outputs)
    decision = graph.remat
    assert [entry[0] for entry in decision.saved] == [v.node]
    tensor = N * N * F32
    # without: sin(v) reads a, b, c and writes (4), the matmul 3, the last kernel reads z,
    # a, b, c and writes (5); with: the first kernel also writes v (5), the last reads z, v (3)
    assert decision.without == (planned_bytes(fused), len(fused.groups)) == (12 * tensor, 3)
    assert decision.with_saves == (planned_bytes(graph), len(graph.groups)) == (11 * tensor, 3)
    assert decision.kept
    _, save, again, common = decision.saved[0]
    assert (save, again, common) == (2 * tensor, 3 * tensor, 0)
    writer = next(g for g in graph.groups if v.node in g.outputs)
    reason = writer.reasons[writer.outputs.index(v.node)]
    assert reason == (
        "saved for later kernels (min-cut: 524.3 KB written+read instead of 786.4 KB to recompute)"
    )
    last = graph.groups[-1]
    assert id(v.node) in _reads(last)
    assert not {id(a.node), id(b.node), id(c.node)} & _reads(last)
    # the plan, run kernel by kernel, computes what the lazy graph computes
    known = _run_kernel_by_kernel(graph)
    np.testing.assert_allclose(known[id(outputs[0].node)], outputs[0].numpy(), rtol=1e-5, atol=1e-5)


def test_fusion_alone_recomputes_it(reference_backend, rng):
    """The same graph without the pass: the kernel after the matmul reads a, b and c."""
    (a, b, c, v), outputs = _saved_activation(rng)
    fused, _ = _plans(outputs)
    assert not any(v.node in group.outputs for group in fused.groups)
    assert {id(a.node), id(b.node), id(c.node)} <= _reads(fused.groups[-1])


# -- recomputing wins: GELU's backward reads its input again ---------------------------------


def _gelu_mlp_step(rng):
    x, y = _t(rng, 64, 32), _t(rng, 64, 32)
    w1, b1, w2 = _t(rng, 32, 128), _t(rng, 128), _t(rng, 128, 32)

    def loss(w1, b1, w2):
        return F.mse_loss(fl.gelu(x @ w1 + b1) @ w2, y)

    value, grads = fl.value_and_grad(loss, argnums=(0, 1, 2))(w1, b1, w2)
    return [value, *grads]


def test_gelu_backward_recomputes_its_input(reference_backend, rng):
    fused, graph = _plans(_gelu_mlp_step(rng))
    decision = graph.remat
    assert decision.saved == () and decision.with_saves is None
    assert graph.groups == fused.groups  # nothing changed
    h = next(entry for entry in decision.recomputed if entry[0].shape == (64, 128))
    node, save, again, common = h
    assert node.op == "add"  # x @ w1 + b1, gelu's input
    # gelu's backward kernel reads x @ w1 and b1 to recompute it: less than writing h and
    # reading it there
    assert again == 64 * 128 * F32 + 128 * F32 and save == 2 * 64 * 128 * F32
    kernels = [i for i, g in enumerate(graph.groups) if node in g.nodes]
    assert len(kernels) == 2 and all(node not in graph.groups[i].outputs for i in kernels)
    # on a tie (the residual y_hat - y: as much to save as to recompute) it recomputes
    assert all(save >= again for _, save, again, _ in decision.recomputed)


# -- the guard: saves that move more bytes once fused are not kept ----------------------------


def test_saves_that_move_more_bytes_are_refused(reference_backend, rng):
    """Forcing the save the cut refused (gelu's input): fused, it moves more bytes, so the
    plan that recomputes it stays, with both numbers recorded and shown."""
    fused, graph = _plans(_gelu_mlp_step(rng))
    h = next(entry[0] for entry in graph.remat.recomputed if entry[0].shape == (64, 128))
    forced = decide(fused, Shared(fused), {id(h): h})
    decision = forced.remat
    assert not decision.kept and forced.groups == fused.groups
    assert decision.without == (planned_bytes(fused), len(fused.groups))
    assert decision.with_saves[0] == decision.without[0] + 64 * 128 * F32 - 128 * F32
    assert [entry[0] for entry in decision.recomputed if entry[0] is h] == [h]
    lines = remat_lines(forced)
    assert lines[0].startswith("save/recompute (min-cut): the cut's saves were not kept")
    assert any(line.startswith("not saved %") for line in lines)


def test_nothing_shared_skips_the_cut(monkeypatch):
    """No value computed by two kernels: the cut is never run."""
    from flame.ir.passes import maxflow

    def refuse(*args):
        raise AssertionError("the cut ran although nothing was shared")

    monkeypatch.setattr(maxflow, "minimum_cut", refuse)
    with fl.backend("reference"):
        x = fl.tensor(np.ones((8, 16), np.float32))
        z = fl.tensor(np.ones((4,), np.float32))
        graph = run_pipeline(Graph(((x * 2.0).sum(0).node, fl.exp(z).node)))
    assert len(graph.groups) == 2 and graph.remat == Remat(), graph.remat


def test_the_pass_never_imports_networkx():
    """networkx's import costs a new process 0.15-0.6 s: the pass has its own cut."""
    code = (
        "import sys, numpy as np, flame as fl\n"
        "from flame.ir.graph import Graph\n"
        "from flame.ir.passes import run_pipeline\n"
        "with fl.backend('reference'):\n"
        "    a, b, w = (fl.tensor(np.ones((64, 64), np.float32)) for _ in range(3))\n"
        "    v = a * b + 1\n"
        "    graph = run_pipeline(Graph(((v @ w).node, (fl.tanh(v) * 3).node)))\n"
        "assert 'networkx' not in sys.modules\n"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr


# -- row kernels keep their shape -------------------------------------------------------------


def _layer_norm_fwd_bwd(rng, shape):
    ops = expressions.flame_ops(fl)
    cols = shape[-1]
    return expressions.layer_norm_fwd_bwd(
        ops, _t(rng, *shape), _t(rng, cols), _t(rng, cols), _t(rng, *shape)
    )


def _cross_entropy_fwd_bwd(rng, shape):
    ops = expressions.flame_ops(fl)
    target = fl.tensor(rng.integers(0, shape[-1], shape[0]))
    return expressions.cross_entropy_fwd_bwd(ops, _t(rng, *shape), target)


ROW_CASES = [
    # one row kernel (dw, db added with atomics) or two (the strip partials summed apart)
    ("layer_norm_16384x4096", _layer_norm_fwd_bwd, (16384, 4096), 2),
    ("layer_norm_64x256", _layer_norm_fwd_bwd, (64, 256), 2),
    ("layer_norm_4x2048x512", _layer_norm_fwd_bwd, (4, 2048, 512), 2),
    # cross-entropy: 6, and the targets' bounds check (check_index, a library op)
    ("cross_entropy_8192x32000", _cross_entropy_fwd_bwd, (8192, 32000), 7),
    ("cross_entropy_256x512", _cross_entropy_fwd_bwd, (256, 512), 7),
]


@pytest.mark.parametrize("name,build,shape,kernels", ROW_CASES, ids=[c[0] for c in ROW_CASES])
def test_row_workloads_keep_their_kernels(name, build, shape, kernels, reference_backend, rng):
    """Layer norm and cross-entropy, forward and backward: as many kernels as fusion alone
    makes (and as before the pass), and never more bytes."""
    fused, graph = _plans(build(rng, shape))
    assert len(graph.groups) == len(fused.groups)
    if name.startswith("layer_norm"):
        assert len(graph.groups) <= kernels
    else:
        assert len(graph.groups) == kernels
    assert planned_bytes(graph) <= planned_bytes(fused)
    if name.startswith("layer_norm"):  # x - mean is recomputed from x, read anyway
        assert graph.remat is None or graph.remat.saved == ()


def test_cross_entropy_saves_its_mask_in_the_row_kernel(reference_backend, rng):
    """target != ignore_index, a per-row flag two later kernels recompute from the targets:
    the kernel that computes it anyway writes it (no kernel added)."""
    fused, graph = _plans(_cross_entropy_fwd_bwd(rng, (256, 512)))
    decision = graph.remat
    ((mask, save, again, _),) = decision.saved
    assert mask.op == "ne" and mask.shape == (256, 1) and save < again
    assert decision.kept and decision.with_saves[0] < decision.without[0]
    writer = next(g for g in graph.groups if mask in g.outputs)
    assert writer.kind == "reduce"


# -- a compiled training step: the decision, the dump, the numbers ---------------------------


def _step_reference(a, b, c, w):
    v = a.astype(np.float64) * b + c
    s = np.tanh(np.sin(v) @ w + v)
    return s.sum(), np.sin(v).T @ (1 - s * s)


def test_compiled_training_step_saves_and_dumps_it(reference_backend, rng, tmp_path):
    a, b, c = (_t(rng, 64, 32) for _ in range(3))
    w = _t(rng, 32, 32).requires_grad_()

    @fl.compile
    def step(a, b, c):
        v = a * b + c  # read again after the matmul, by the loss and by its gradient
        loss = fl.tanh(fl.sin(v) @ w + v).sum()
        loss.backward()
        return loss

    text = io.StringIO()
    loss = fl.dump(step, a, b, c, out=tmp_path / "dump", file=text)
    compiled = (loss.numpy(), w.grad.numpy())
    w.grad = None
    lazy_v = a * b + c
    lazy_loss = fl.tanh(fl.sin(lazy_v) @ w + lazy_v).sum()
    lazy_loss.backward()
    expected = _step_reference(a.numpy(), b.numpy(), c.numpy(), w.numpy())
    for got, lazy, want in zip(compiled, (lazy_loss.numpy(), w.grad.numpy()), expected):
        np.testing.assert_allclose(got, lazy, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

    out = text.getvalue()
    assert "# save/recompute (min-cut): saves kept" in out
    saved = [line for line in out.splitlines() if line.startswith("# saved %")]
    assert len(saved) == 1 and "written+read instead of" in saved[0], out
    assert "saved for later kernels (min-cut:" in out  # the kernel's boundary reason
    folder = tmp_path / "dump"
    manifest = json.loads((folder / "manifest.json").read_text())
    step_graph = next(g for g in manifest["graphs"] if g["save_recompute"])
    assert step_graph["save_recompute"][0].startswith("save/recompute (min-cut): saves kept")
    fusion = (folder / step_graph["folder"] / "fusion.txt").read_text()
    assert saved[0][2:] in fusion
    assert saved[0][2:] in (folder / "summary.txt").read_text()
    # the step's plan, kernel by kernel: the saved activation is read, not recomputed
    with fl.backend("reference"):
        lazy_v = a * b + c
        value = fl.tanh(fl.sin(lazy_v) @ w + lazy_v).sum()
        graph = run_pipeline(Graph((value.node,)))
    assert graph.remat.kept
    known = _run_kernel_by_kernel(graph)
    np.testing.assert_allclose(known[id(value.node)], expected[0], rtol=1e-4)


def test_every_input_is_read_by_some_kernel(reference_backend, rng):
    """Sanity of the planned plans: nothing the saves replaced is left dangling."""
    _, outputs = _saved_activation(rng)
    _, graph = _plans(outputs)
    read = set().union(*(_reads(group) for group in graph.groups))
    assert all(id(node) in read for node in graph.nodes if is_input(node))
    assert isinstance(graph.remat, Remat)


def _step_graph(rng):
    a, b, c, w = _t(rng, 64, 32), _t(rng, 64, 32), _t(rng, 64, 32), _t(rng, 32, 32)

    def loss(w):
        v = a * b + c
        return fl.tanh(fl.sin(v) @ w + v).sum()

    value, (grad,) = fl.value_and_grad(loss, argnums=(0,))(w)
    return [value, grad]


KEPT = [
    ("saved_activation", lambda rng: _saved_activation(rng)[1]),
    ("training_step", _step_graph),
    ("cross_entropy", lambda rng: _cross_entropy_fwd_bwd(rng, (256, 512))),
]


@pytest.mark.parametrize("name,build", KEPT, ids=[case[0] for case in KEPT])
def test_plans_with_saves_lower_and_compile(name, build, reference_backend, rng, nvrtc):
    """The kernels of plans that keep the cut's saves (a row kernel writing a saved value
    among them) lower, render and compile with NVRTC, and run kernel by kernel on the CPU."""
    from flame.codegen.lower import lower_group
    from flame.codegen.render import render
    from flame.runtime.compiler import nvrtc_compile
    from flame.runtime.executor import _layout_of

    outputs = build(rng)
    _, graph = _plans(outputs)
    assert graph.remat.kept
    for group in graph.groups:
        if group.kind != "library":
            spec = lower_group(group, _layout_of).spec
            assert nvrtc_compile(render(spec), spec.name, "sm_90")[:4] == b"\x7fELF"
    known = _run_kernel_by_kernel(graph)
    for tensor, node in zip(outputs, graph.outputs):
        want = tensor.numpy()
        got = known[id(node)].reshape(want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
