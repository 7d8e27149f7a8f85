"""Channels-last regions (flame/ir/passes/layouts.py): values computed from a 16-bit
channels-last convolution stay channels-last through bias and embedding adds, GroupNorm,
SiLU and residual adds, so the next convolution reads them without a transpose. CPU tier:
graphs built on the CUDA backend (nothing runs), the planned graph evaluated by the NumPy
reference against the graph as built."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
import flame.nn.functional as F
from flame.ir.graph import Graph
from flame.ir.passes import layouts as layouts_module
from flame.ir.passes import run_pipeline
from flame.ir.passes.layouts import layouts
from flame.ir.passes.library_views import library_view
from flame.ir.passes.simplify import simplify
from flame.runtime.reference import evaluate


@pytest.fixture(autouse=True)
def layout_pass(monkeypatch):
    """The pass and the strip cut of its column sums, switched on for each test here (both
    are off by default: an experiment, notes/performance.md)."""
    from flame.ir.passes import split

    monkeypatch.setattr(layouts_module, "ENABLED", True)
    monkeypatch.setattr(split, "SPLIT_COLUMNS", True)


def _tensor(rng, *shape, scale=1.0):
    array = (rng.standard_normal(shape) * scale).astype(np.float32)
    return fl.tensor(array).to(fl.bfloat16)


def _block(rng, channels=8, size=6, groups=4, residual=True):
    """conv -> + bias + embedding -> GroupNorm -> SiLU -> conv -> + x: a UNet ResBlock's
    shape, with its input and weights as leaves; forward and backward."""
    x = _tensor(rng, 2, channels, size, size)
    w1, w2 = (
        _tensor(rng, channels, channels, 3, 3, scale=0.2),
        _tensor(rng, channels, channels, 3, 3, scale=0.2),
    )
    b1, emb = _tensor(rng, channels), _tensor(rng, 2, channels, 1, 1)
    gamma, beta = _tensor(rng, channels), _tensor(rng, channels)
    out, pullback = fl.vjp(
        lambda x, w1, w2: _forward(x, w1, w2, b1, emb, gamma, beta, groups, residual), x, w1, w2
    )
    grads = pullback(_tensor(rng, *out.shape))
    return [out, *grads]


def _forward(x, w1, w2, b1, emb, gamma, beta, groups, residual):
    h = F.conv2d(x, w1, b1, padding=1) + emb
    h = F.silu(F.group_norm(h, groups, gamma, beta))
    h = F.conv2d(h, w2, padding=1)
    return h + x if residual else h


def _graph(outputs):
    return Graph(tuple(t.node for t in outputs))


def _conv_operands(graph):
    """Per conv/conv_data_grad: whether each activation operand is read as contiguous
    memory (no transpose for cuDNN to make)."""
    found = []
    for node in graph.nodes:
        if node.op not in ("conv", "conv_data_grad"):
            continue
        child = node.inputs[0]
        resolved = library_view(child)
        if resolved is None:
            found.append(True)  # a value of its own, written contiguous by its kernel
            continue
        base, view = resolved
        strides = [int(np.prod(base.shape[i + 1 :])) for i in range(len(base.shape))]
        found.append(tuple(view.strides) == tuple(strides[: len(view.strides)]) and not view.offset)
    return found


@pytest.mark.parametrize("residual", [True, False])
def test_values_are_unchanged(rng, cuda_backend, residual):
    outputs = _block(rng, residual=residual)
    nodes = [t.node for t in outputs]
    planned = run_pipeline(Graph(tuple(nodes)))
    expected = evaluate(nodes, precision=np.float64, realized=False)
    found = evaluate(list(planned.outputs), precision=np.float64, realized=False)
    for got, want in zip(found, expected):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


def test_conv_operands_are_channels_last_memory(rng, cuda_backend):
    """After the pass, each conv's activation operand is a value written channels-last (the
    GroupNorm + SiLU kernel's result), not an NCHW value for cuDNN to transpose."""
    graph = simplify(_graph(_block(rng)))
    after = layouts(graph)
    convs = [n for n in after.nodes if n.op == "conv"]
    assert len(convs) == 2
    second = convs[1].inputs[0]  # GroupNorm + SiLU of the first conv's result
    assert second.op != "permute" and second.shape == (2, 6, 6, 8), second.op
    assert all(_conv_operands(after))


def test_group_norm_statistics_read_channels_last(rng, cuda_backend):
    """The per-channel sums of a GroupNorm over a conv's result reduce the conv's own
    [N, H, W, C] value over H and W (a column sum), not a transposed view."""
    x = _tensor(rng, 2, 8, 6, 6)
    h = F.conv2d(x, _tensor(rng, 8, 8, 3, 3), _tensor(rng, 8), padding=1)
    out = F.group_norm(h, 4)
    graph = layouts(simplify(_graph([out])))
    sums = [n for n in graph.nodes if n.op == "reduce_sum" and n.inputs[0].shape == (2, 6, 6, 8)]
    assert sums and all(n.attr("axes") == (1, 2) for n in sums)


def test_switched_off_keeps_the_nchw_order(rng, cuda_backend, monkeypatch):
    graph = simplify(_graph(_block(rng)))
    monkeypatch.setattr(layouts_module, "ENABLED", False)
    assert layouts(graph) is graph


def test_group_norm_picks_the_formulation_by_its_producer(rng, cuda_backend):
    """GroupNorm after a channels-last conv (through adds) takes the per-channel column-sum
    formulation; on an input of its own the group-major row kernel stays."""
    from flame.nn.functional import _after_channels_last_conv

    x = _tensor(rng, 2, 8, 6, 6)
    h = F.conv2d(x, _tensor(rng, 8, 8, 3, 3), _tensor(rng, 8), padding=1) + _tensor(rng, 2, 8, 1, 1)
    assert _after_channels_last_conv(h)
    assert not _after_channels_last_conv(x * 2)
    assert not _after_channels_last_conv(F.conv2d(x.float(), _tensor(rng, 8, 8, 3, 3).float()))


@pytest.mark.parametrize("groups", [1, 4, 8])
def test_channels_last_group_norm_matches_the_group_major_one(rng, reference_backend, groups):
    """The per-channel column-sum formulation gives the group-major formulation's values and
    gradients (float64 on the reference backend; inputs with a large mean, where E[x^2] -
    E[x]^2 loses the most)."""
    from flame.nn.group_norm_layouts import _group_norm_channels_last

    array = rng.standard_normal((2, 8, 5, 3)) * 0.5 + 3.0
    weight, bias = rng.standard_normal(8), rng.standard_normal(8)
    seed = rng.standard_normal((2, 8, 5, 3))
    results = []
    for function in (_group_norm_channels_last, None):
        x, w, b = (fl.tensor(v) for v in (array, weight, bias))

        def normalized(x, w, b, function=function):
            if function is None:
                return F.group_norm(x, groups, w, b, 1e-5)
            return function(x, groups, w, b, 1e-5)

        out, pullback = fl.vjp(normalized, x, w, b)
        results.append([out.numpy(), *(g.numpy() for g in pullback(fl.tensor(seed)))])
    for got, want in zip(*results):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


def test_group_norm_sees_the_conv_under_inference_mode(rng, cuda_backend):
    """Under ``inference_mode`` every result is marked (a ``detach`` node): the conv is
    still found under it."""
    from flame.nn.group_norm_layouts import _after_channels_last_conv

    x = _tensor(rng, 2, 8, 6, 6)
    with fl.inference_mode():
        h = F.conv2d(x, _tensor(rng, 8, 8, 3, 3), _tensor(rng, 8), padding=1)
        assert _after_channels_last_conv(h + _tensor(rng, 2, 8, 1, 1))
