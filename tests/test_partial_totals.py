"""A column sum split in two stages (flame/ir/passes/split.py: partial sums over parts of
the rows, then their total) runs as one column kernel that adds each part's sums into the
float32 total with ``atomicAdd`` (flame/ir/passes/row_columns.py ``PARTIAL_TOTALS``,
flame/codegen/reduce.py): a bias gradient's partial rows are never written and the one-block
kernel that summed them is gone. Deterministic algorithms keep the two kernels."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
from flame.codegen.lower import lower_group
from flame.codegen.render import render
from flame.ir.graph import Graph
from flame.ir.passes import row_columns, run_pipeline
from flame.runtime.compiler import nvrtc_compile
from flame.runtime.executor import _layout_of


def _column_sum(rows=16384, columns=384, dtype=np.float16, seed=0):
    values = np.random.default_rng(seed).standard_normal((rows, columns)).astype(dtype)
    return values, (fl.from_numpy(values).float() * 2.0).sum(0)


def _planned(out):
    return run_pipeline(Graph((out.node,)), verify_each=True)


def test_one_kernel_adds_the_parts_atomically(cuda_backend, nvrtc):
    _, out = _column_sum()
    (group,) = _planned(out).groups
    lowered = lower_group(group, _layout_of)
    assert lowered.zeroed == (0,)
    source = render(lowered.spec)
    # one column a thread, or a vector of neighbouring columns (column vectors: + v)
    assert ("atomicAdd(out0 + outer % total0_columns" in source
            or "atomicAdd(out0 + (outer + v) % total0_columns" in source)  # fmt: skip
    assert nvrtc_compile(source, lowered.spec.name, "sm_90")[:4] == b"\x7fELF"


def test_switch_off_and_deterministic_mode_keep_two_kernels(cuda_backend, monkeypatch):
    _, out = _column_sum()
    with fl.use_deterministic_algorithms(True):
        assert len(_planned(out).groups) == 2
    monkeypatch.setattr(row_columns, "PARTIAL_TOTALS", False)
    assert len(_planned(out).groups) == 2


def test_a_partial_someone_else_reads_stays_written(cuda_backend):
    """Both the total and another value read the parts: no atomic total."""
    values = np.random.default_rng(1).standard_normal((16384, 384)).astype(np.float32)
    x = fl.from_numpy(values)
    parts = x.reshape(64, 256, 384).sum(1)
    graph = run_pipeline(Graph((parts.sum(0).node, (parts * 3.0).node)), verify_each=True)
    for group in graph.groups:
        assert "atomicAdd" not in render(lower_group(group, _layout_of).spec)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,columns", [(16384, 384), (8192, 1152), (4096, 100), (12288, 7)])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_values_on_the_gpu(rows, columns, dtype):
    values, _ = _column_sum(rows, columns, dtype, seed=rows + columns)
    expected = (values.astype(np.float64) * 2.0).sum(0)
    with fl.backend("cuda"):
        for _ in range(2):  # the total is zeroed before every launch
            got = (fl.from_numpy(values).float() * 2.0).sum(0).numpy()
            np.testing.assert_allclose(got, expected, rtol=2e-5, atol=1e-3)
