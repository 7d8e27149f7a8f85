"""Column kernels (the innermost axis kept: a bias gradient's sums over rows) can load a
16-byte vector across neighbouring columns a thread where every operand is contiguous across
columns (flame/codegen/reduce_columns.py, ``column vectors``; off by default,
``COLUMN_VECTOR_BYTES``):
the choice and its fallbacks, NVRTC compiles in the CPU tier; values on both backends, with
the vectors on and off."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
from flame.codegen import reduce_columns
from flame.codegen.lower import lower_group
from flame.codegen.render import render
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.runtime.compiler import nvrtc_compile
from flame.runtime.executor import _layout_of


def _column_kernels(*outputs):
    graph = run_pipeline(Graph(tuple(t.node for t in outputs)))
    kernels = [lower_group(g, _layout_of) for g in graph.groups if g.kind == "reduce"]
    return [k for k in kernels if k.spec.extras.get("mode") == "thread"]


@pytest.fixture
def vectors(monkeypatch):
    monkeypatch.setattr(reduce_columns, "COLUMN_VECTOR_BYTES", 16)


def _values(rng, shape, dtype):
    return fl.tensor(rng.standard_normal(shape).astype(np.float32), dtype=dtype)


@pytest.mark.parametrize(
    "dtype,columns,lanes",
    [(fl.bfloat16, 1536, 8), (fl.bfloat16, 100, 4), (fl.float32, 384, 4), (fl.float32, 6, 2)],
)
def test_the_vector_follows_the_columns(cuda_backend, nvrtc, vectors, rng, dtype, columns, lanes):
    x = _values(rng, (4096, columns), dtype)
    (kernel,) = _column_kernels(x.float().sum(0))
    assert kernel.spec.extras["column_lanes"] == lanes, kernel.spec.size_class
    assert f"column vectors of {lanes}" in kernel.spec.size_class
    source = render(kernel.spec)
    assert "FlameVec<" in source and f", {lanes}>" in source
    nvrtc_compile(source, kernel.spec.name, "sm_90")


def test_odd_columns_and_the_default_take_one_column_a_thread(cuda_backend, rng, monkeypatch):
    (off,) = _column_kernels(_values(rng, (4096, 1536), fl.bfloat16).float().sum(0))
    assert reduce_columns.COLUMN_VECTOR_BYTES == 0 and off.spec.extras["column_lanes"] == 1
    monkeypatch.setattr(reduce_columns, "COLUMN_VECTOR_BYTES", 16)
    (odd,) = _column_kernels(_values(rng, (512, 33), fl.bfloat16).float().sum(0))
    assert odd.spec.extras["column_lanes"] == 1 and odd.spec.size_class.startswith("columns")


def test_a_max_over_rows_compiles(cuda_backend, nvrtc, vectors, rng):
    (kernel,) = _column_kernels(_values(rng, (2048, 256), fl.bfloat16).float().amax(0))
    assert kernel.spec.extras["column_lanes"] == 8
    nvrtc_compile(render(kernel.spec), kernel.spec.name, "sm_90")


@pytest.mark.parametrize(
    "shape,axes,dtype",
    [((3000, 264), (0,), fl.bfloat16), ((64, 37, 96), (0, 1), fl.bfloat16),
     ((5, 300, 40), (1,), fl.float32), ((777, 6), (0,), fl.float32),
     ((4096, 1536), (0,), fl.bfloat16)],
)  # fmt: skip
@pytest.mark.parametrize("vector_bytes", [16, 0])
def test_sum_values(backend, rng, monkeypatch, shape, axes, dtype, vector_bytes):
    monkeypatch.setattr(reduce_columns, "COLUMN_VECTOR_BYTES", vector_bytes)
    x = _values(rng, shape, dtype)
    expected = x.float().numpy().astype(np.float64).sum(axes)
    got = x.float().sum(axes).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-3)


def test_max_values(backend, vectors, rng):
    x = _values(rng, (1000, 512), fl.bfloat16)
    np.testing.assert_array_equal(x.float().amax(0).numpy(), x.float().numpy().max(0))
