"""Short rows (up to 32 lanes x reduce.WARP_MAX_ITEMS chunks) run a warp a row, several rows a
block (flame/codegen/reduce.py, ``warp rows``): the choice, one size class for every short
length, the boundary with block rows, NVRTC compiles in the CPU tier; values on both
backends, including a row count that leaves a block's last warps without a row."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
import flame.nn.functional as F
from flame.codegen import reduce
from flame.codegen.lower import lower_group
from flame.codegen.render import render, spec_key
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.runtime.compiler import nvrtc_compile
from flame.runtime.executor import _layout_of


def _row_kernels(*outputs):
    graph = run_pipeline(Graph(tuple(t.node for t in outputs)))
    return [lower_group(g, _layout_of) for g in graph.groups if g.kind == "reduce"]


def _layer_norm(rng, rows, width, dtype=fl.bfloat16):
    x = fl.tensor(rng.standard_normal((rows, width)).astype(np.float32), dtype=dtype)
    w = fl.tensor(rng.standard_normal(width).astype(np.float32))
    b = fl.tensor(rng.standard_normal(width).astype(np.float32))
    return (x, w, b), F.layer_norm(x.float(), (width,), w, b).to(dtype)


def test_short_rows_take_a_warp_each(cuda_backend, nvrtc, rng):
    _, y = _layer_norm(rng, 1000, 384)
    (kernel,) = _row_kernels(y)
    assert "warp rows" in kernel.spec.size_class, kernel.spec.size_class
    assert kernel.spec.extras["warp_rows"] == reduce.WARP_ROWS
    assert kernel.threads == 32 * reduce.WARP_ROWS
    assert kernel.grid_items == -(-1000 // reduce.WARP_ROWS)
    source = render(kernel.spec)
    assert "row_threads = 32" in source and "__syncthreads" not in source
    nvrtc_compile(source, kernel.spec.name, "sm_90")


def test_one_class_for_every_short_length_and_block_rows_past_it(cuda_backend, nvrtc, rng):
    keys = set()
    for width in (96, 384, 512):  # float32 weights: 4 lanes, up to 32 x 4 x 4 = 512 a row
        (kernel,) = _row_kernels(_layer_norm(rng, 64, width)[1])
        assert "warp rows" in kernel.spec.size_class, (width, kernel.spec.size_class)
        keys.add(spec_key(kernel.spec))
    assert len(keys) == 1
    (long_row,) = _row_kernels(_layer_norm(rng, 64, 520)[1])
    assert "warp rows" not in long_row.spec.size_class
    assert not long_row.spec.extras["warp_rows"]
    nvrtc_compile(render(long_row.spec), long_row.spec.name, "sm_90")


def test_the_switch_keeps_a_block_a_row(cuda_backend, rng, monkeypatch):
    monkeypatch.setattr(reduce, "WARP_ROWS", 0)
    (kernel,) = _row_kernels(_layer_norm(rng, 64, 384)[1])
    assert "warp rows" not in kernel.spec.size_class and kernel.grid_items == 64


@pytest.mark.parametrize("rows,width", [(37, 384), (8, 1000), (3, 96), (19, 1032)])
def test_layer_norm_values(backend, rng, rows, width):
    (x, w, b), y = _layer_norm(rng, rows, width, dtype=fl.float32)
    data = x.numpy().astype(np.float64)
    mean = data.mean(-1, keepdims=True)
    normed = (data - mean) / np.sqrt(data.var(-1, keepdims=True) + 1e-5)
    expected = normed * w.numpy() + b.numpy()
    np.testing.assert_allclose(y.numpy(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows,width", [(37, 200), (5, 512)])
def test_softmax_and_log_softmax_values(backend, rng, rows, width):
    data = rng.standard_normal((rows, width)).astype(np.float32) * 4
    x = fl.tensor(data)
    shifted = data.astype(np.float64) - data.max(-1, keepdims=True)
    expected = np.exp(shifted) / np.exp(shifted).sum(-1, keepdims=True)
    np.testing.assert_allclose(F.softmax(x, -1).numpy(), expected, rtol=1e-5, atol=1e-6)
    logs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    np.testing.assert_allclose(F.log_softmax(x, -1).numpy(), logs, rtol=1e-5, atol=1e-5)
