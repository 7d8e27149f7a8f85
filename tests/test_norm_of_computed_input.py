"""A norm whose input is itself computed (a conv result plus a bias and a time embedding, as
in a UNet ResBlock's second GroupNorm) is one row kernel: its statistics stay in registers
and its normalised output is written by that kernel, not by a second elementwise kernel that
reads the input again (flame/ir/passes/materialize.py, ``BROADCAST_COST_OF_REDUCTIONS``)."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
import flame.nn.functional as F
from flame.ir.graph import Graph
from flame.ir.passes import materialize, run_pipeline


def _resblock_norm(rng, batch=4, channels=64, side=8):
    """GroupNorm + SiLU of a value computed from ``h`` by a chain of per-channel and
    per-sample broadcasts (more than ``RECOMPUTE_LIMIT`` ops under the norm's mean)."""
    h = fl.tensor(rng.standard_normal((batch, channels, side, side)).astype(np.float32))
    bias = fl.tensor(rng.standard_normal(channels).astype(np.float32))
    emb = fl.tensor(rng.standard_normal((batch, channels)).astype(np.float32))
    weight = fl.tensor(rng.standard_normal(channels).astype(np.float32))
    shift = fl.tensor(rng.standard_normal(channels).astype(np.float32))
    x = h
    for _ in range(3):
        x = x * weight.reshape(channels, 1, 1) + bias.reshape(channels, 1, 1)
    x = x + emb.reshape(batch, channels, 1, 1)
    return (h, bias, emb, weight, shift), F.silu(F.group_norm(x, 16, weight, shift))


def _kernels(y):
    graph = run_pipeline(Graph((y.node,)))
    return [group for group in graph.groups if group.kind != "library"]


def test_the_statistics_and_the_output_share_one_row_kernel(cuda_backend, rng):
    _, y = _resblock_norm(rng)
    kernels = _kernels(y)
    reduce = [group for group in kernels if group.kind == "reduce"]
    assert len(reduce) == 1, [group.kind for group in kernels]
    # the row kernel writes the normalised value; no kernel reads the input a second time
    assert any(output.shape == (4, 16, 4, 64) or output.numel == y.numel
               for output in reduce[0].outputs)  # fmt: skip
    assert not [group for group in kernels if group.kind == "elementwise"
                and any(o.numel == y.numel for o in group.outputs)]  # fmt: skip


def test_counting_reductions_splits_the_kernel(cuda_backend, rng, monkeypatch):
    """The old rule (ops under a reduction counted as recomputed per element) wrote the
    statistics and normalised in a separate kernel: what the switch changes."""
    monkeypatch.setattr(materialize, "BROADCAST_COST_OF_REDUCTIONS", True)
    _, y = _resblock_norm(rng)
    kinds = [group.kind for group in _kernels(y)]
    assert kinds.count("elementwise") >= 1 and kinds.count("reduce") == 1


@pytest.mark.parametrize("side", [8, 5])
def test_values(backend, rng, side):
    (h, bias, emb, weight, shift), y = _resblock_norm(rng, side=side)
    w, b = weight.numpy()[:, None, None], bias.numpy()[:, None, None]
    x = h.numpy().astype(np.float64)
    for _ in range(3):
        x = x * w + b
    x = x + emb.numpy()[:, :, None, None]
    grouped = x.reshape(4, 16, -1)
    mean = grouped.mean(-1, keepdims=True)
    var = grouped.var(-1, keepdims=True)
    normed = ((grouped - mean) / np.sqrt(var + 1e-5)).reshape(x.shape)
    affine = normed * w + shift.numpy()[:, None, None]
    expected = affine / (1.0 + np.exp(-affine))
    np.testing.assert_allclose(y.numpy(), expected, rtol=1e-4, atol=1e-4)
