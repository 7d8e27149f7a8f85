"""A library call's operand view stops at values the plan writes (flame/ir/passes/
library_views.py ``library_view``'s ``written``; materialize.py, ``materialized_reads`` and
``LibraryCall.plan`` read the same): the attention backward's dq/dk/dv, joined, permuted to
[B, S, 3, H, D] and written, are read by the matmuls as ``reshape(permute)`` of that buffer,
not copied once more into the same layout; the attention output likewise. CPU tier: the
copies are gone from the CUDA plan, and every library call's slot read through its view holds
its operand's value (the reference interpreter, float64); gpu tier: the values."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.runtime.plans import LibraryCall
from flame.runtime.reference import evaluate

F = fl.nn.functional
COPY_OPS = ("permute", "reshape", "slice", "expand")


def _joined_rows(rng, batch=2, heads=2, length=8, width=8, channels=16):
    """The attention backward's shape: three slices of one packed value (dq, dk, dv), each
    scaled, joined as [3, B, H, S, D], permuted to [B, S, 3, H, D] and read as rows of
    3 * H * D by two matmuls (the input's gradient and, transposed, the weight's)."""
    packed = fl.tensor(rng.standard_normal((3 * batch, heads, length, width)).astype(np.float32))
    weight = fl.tensor(rng.standard_normal((3 * heads * width, channels)).astype(np.float32))
    tokens = fl.tensor(rng.standard_normal((batch * length, channels)).astype(np.float32))
    parts = [packed[index * batch : (index + 1) * batch] * (index + 2.0) for index in range(3)]
    joined = fl.stack(parts)
    rows = joined.permute(1, 3, 0, 2, 4).reshape(batch * length, 3 * heads * width)
    return rows @ weight, rows.T @ tokens


def _dit_block(rng, batch=2, length=16, channels=32, heads=2):
    """A DiT block (adaLN-Zero, attention, GELU MLP) under bf16 autocast, loss and backward:
    the gradients of every weight, the tokens and the conditioning."""

    def param(*shape, scale=0.2):
        values = (rng.standard_normal(shape) * scale).astype(np.float32)
        return fl.from_numpy(values).requires_grad_()

    x, c = param(batch, length, channels, scale=1.0), param(batch, channels, scale=1.0)
    w_ada, b_ada = param(6 * channels, channels), param(6 * channels)
    w_qkv, b_qkv = param(3 * channels, channels), param(3 * channels)
    w_proj, b_proj = param(channels, channels), param(channels)
    w_fc1, b_fc1 = param(4 * channels, channels), param(4 * channels)
    w_fc2, b_fc2 = param(channels, 4 * channels), param(channels)
    params = [x, c, w_ada, b_ada, w_qkv, b_qkv, w_proj, b_proj, w_fc1, b_fc1, w_fc2, b_fc2]
    with fl.autocast("cuda", dtype=fl.bfloat16):
        mods = F.linear(F.silu(c), w_ada, b_ada).chunk(6, dim=1)
        h = F.layer_norm(x, (channels,)) * (1 + mods[1][:, None]) + mods[0][:, None]
        qkv = F.linear(h, w_qkv, b_qkv).reshape(batch, length, 3, heads, channels // heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        out = F.linear(out.transpose(1, 2).reshape(batch, length, channels), w_proj, b_proj)
        x = x + mods[2][:, None] * out
        h = F.layer_norm(x, (channels,)) * (1 + mods[4][:, None]) + mods[3][:, None]
        hidden = F.gelu(F.linear(h, w_fc1, b_fc1), approximate="tanh")
        x = x + mods[5][:, None] * F.linear(hidden, w_fc2, b_fc2)
    loss = (x.float() ** 2).mean()
    loss.backward(create_graph=True)  # built, not run
    return (loss, *[p.grad for p in params])


def _plan(outputs):
    """The planned graph and its steps as the executor plans them (no kernel lowered):
    ``(graph, slot_of, steps)``, a step a ``LibraryCall`` or a kernel group."""
    graph = run_pipeline(Graph(tuple(tensor.node for tensor in outputs)))
    slot_of = {id(node): index for index, node in enumerate(graph.inputs)}
    for group in graph.groups:
        for output in group.outputs:
            slot_of[id(output)] = len(slot_of)
    steps = [
        LibraryCall.plan(group.nodes[0], slot_of) if group.kind == "library" else group
        for group in graph.groups
    ]  # fmt: skip
    return graph, slot_of, steps


def _copies(graph) -> list:
    """Kernels that only move data: movement ops (and casts), no arithmetic."""
    return [
        group
        for group in graph.groups
        if group.kind != "library"
        and all(node.op in COPY_OPS or node.op == "cast" for node in group.nodes)
        and any(node.op in COPY_OPS for node in group.nodes)
    ]


def _same_layout_copies(graph) -> list:
    """Copies whose output is only a reshape of another value the plan writes, in its order
    (a contiguous buffer copied into the same layout)."""
    written = {id(node) for group in graph.groups for node in group.outputs}
    found = []
    for group in _copies(graph):
        for output in group.outputs:
            value = output
            while value.op == "reshape" and id(value.inputs[0]) not in written:
                value = value.inputs[0]
            if value is not output and value.op == "reshape" and id(value.inputs[0]) in written:
                found.append(output)
    return found


def _check_library_reads(graph, slot_of, steps) -> int:
    """Every library call's slot, laid out as the plan writes it (contiguous) and read
    through the call's view, holds its operand's value; and the slot is written before the
    call (fusion's ordering read the same value). Returns the calls checked."""
    producer = {}
    for index, step in enumerate(steps):
        outputs = [step.node] if isinstance(step, LibraryCall) else step.outputs
        for node in outputs:
            producer[slot_of[id(node)]] = index
    node_of = {slot: node for node in graph.inputs for slot in [slot_of[id(node)]]}
    for group in graph.groups:
        node_of.update({slot_of[id(node)]: node for node in group.outputs})
    calls = [
        (index, step)
        for index, step in enumerate(steps)
        if isinstance(step, LibraryCall) and step.node.op not in COPY_OPS
    ]  # fmt: skip
    operands = [child for _, step in calls for child in step.node.inputs]
    sources = [node_of[slot] for _, step in calls for slot in step.inputs]
    values = evaluate(operands + sources, precision=np.float64, realized=False)
    wanted, found = values[: len(operands)], values[len(operands) :]
    position = 0
    for index, step in calls:
        for slot, view in zip(step.inputs, step.views):
            assert producer.get(slot, -1) < index, (step.node.op, slot)
            memory = np.ascontiguousarray(found[position]).ravel()
            if view is not None:
                item = memory.itemsize
                read = np.lib.stride_tricks.as_strided(
                    memory[view.offset :], view.shape, [s * item for s in view.strides]
                )
            else:
                read = memory.reshape(wanted[position].shape)
            np.testing.assert_array_equal(read, wanted[position])
            position += 1
    return len(calls)


def test_joined_rows_are_read_through_the_written_permute(rng):
    with fl.backend("cuda"):  # building and planning touch no GPU
        outputs = _joined_rows(rng)
        graph, slot_of, steps = _plan(outputs)
    copies = _copies(graph)
    # the permute [B, S, 3, H, D] is written once; both matmuls read it through views (no
    # same-layout reshape copy, no transposed copy for the weight's gradient)
    assert [[node.op for node in group.nodes] for group in copies] == [["permute"]], copies
    assert not _same_layout_copies(graph)
    calls = [step for step in steps if isinstance(step, LibraryCall)]
    matmuls = [call for call in calls if call.node.op == "matmul"]
    permute_slot = slot_of[id(copies[0].outputs[0])]
    assert [call.inputs[0] for call in matmuls] == [permute_slot, permute_slot]
    assert _check_library_reads(graph, slot_of, steps) == len(calls)


def test_a_dit_block_writes_attention_layouts_once(rng):
    with fl.backend("cuda"):
        graph, slot_of, steps = _plan(_dit_block(rng))
    assert not _same_layout_copies(graph)
    # left: the forward's q/k/v slices (a view of the qkv matmul no library reads as one
    # strided operand) and the backward's [B, S, 3, H, D] join; the weight gradients come out
    # of cuBLAS in the parameters' order (simplify.TRANSPOSED_PRODUCTS), no transposed copies
    reasons = sorted(group.reasons[0] for group in _copies(graph))
    assert reasons.count("graph output") == 0
    assert len(reasons) == 2, reasons
    assert not any("input of matmul" in reason for reason in reasons), reasons
    assert _check_library_reads(graph, slot_of, steps) >= 10


@pytest.mark.parametrize("name", ["dit", "unet"])
def test_library_reads_of_tiny_diffusion_training_steps(name):
    """Every cuBLAS/cuDNN call of a tiny DiT's and UNet's bf16 training step (convolutions,
    attention, matmuls) reads its operand's values from the slot and view the plan gives it.
    Built on the reference backend: the parameters' initialization runs there (the passes
    plan the same graph for either backend)."""
    from examples.diffusion.models import build_model

    with fl.backend("reference"):
        fl.manual_seed(0)
        model = build_model(name, 16, 3, 10, "tiny")
        params = list(model.parameters())
        x = fl.randn(2, 3, 16, 16)
        t, y = fl.randint(0, 1000, (2,)), fl.randint(0, 10, (2,))
        with fl.autocast("cuda", dtype=fl.bfloat16):
            out = model(x, t, y)
        loss = (out.float() - x).square().mean()
        loss.backward(create_graph=True)  # built, not run
        graph, slot_of, steps = _plan([loss] + [p.grad for p in params])
    assert not _same_layout_copies(graph)
    assert _check_library_reads(graph, slot_of, steps) >= 50


def test_values_are_unchanged(rng):
    """The planned graph computes what the graph did (the reads of its library calls through
    their views are checked above, value for value). The DiT block is bf16: the pipeline
    moves a few rounding points (it did before this change too), so it gets bf16's margin."""
    for build, margin in ((_joined_rows, 1e-12), (_dit_block, 1e-2)):
        with fl.backend("cuda"):
            outputs = build(rng)
            nodes = tuple(tensor.node for tensor in outputs)
            planned = run_pipeline(Graph(nodes))
        expected = evaluate(list(nodes), precision=np.float64, realized=False)
        found = evaluate(list(planned.outputs), precision=np.float64, realized=False)
        for a, b in zip(found, expected):
            scale = max(float(np.abs(b).max()), 1.0)
            np.testing.assert_allclose(a, b, rtol=margin, atol=margin * scale)


@pytest.mark.gpu
def test_values_on_the_gpu(rng):
    for build in (_joined_rows, _dit_block):
        outputs = build(rng)
        expected = evaluate([t.node for t in outputs], precision=np.float64, realized=False)
        fl.realize(*outputs)
        for tensor, want in zip(outputs, expected):
            found = tensor.float().numpy() if tensor.dtype.name == "bfloat16" else tensor.numpy()
            scale = max(float(np.abs(want).max()), 1e-3)
            np.testing.assert_allclose(found, want, rtol=5e-2, atol=5e-2 * scale)
