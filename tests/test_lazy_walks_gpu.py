"""Lazy mode's recorded walks on the GPU (flame/runtime/executor.py, ``_realize_one``): a graph
built at the line of an earlier one runs that one's plan only when it has the same structure;
every other change -- operands swapped or shared, other shapes, layouts and dtypes, values
realized in between -- gives the right values too."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
from flame.runtime.executor import Executor

pytestmark = pytest.mark.gpu


def _tensor(array):
    return fl.tensor(np.ascontiguousarray(array)).realize()


def test_one_line_many_graphs_gives_each_its_values(cuda_backend, rng):
    executor = Executor()
    a_np = rng.standard_normal(64).astype(np.float32)
    b_np = rng.standard_normal(64).astype(np.float32)
    wide_np = rng.standard_normal((8, 64)).astype(np.float32)
    a, b, wide = _tensor(a_np), _tensor(b_np), _tensor(wide_np)
    strided_np = rng.standard_normal(128).astype(np.float32)
    strided = _tensor(strided_np)[::2]
    cases = [
        (a, b, a_np, b_np), (a, b, a_np, b_np), (a, a, a_np, a_np), (b, a, b_np, a_np),
        (wide, a, wide_np, a_np), (strided, b, strided_np[::2], b_np), (a, b, a_np, b_np),
    ]  # fmt: skip
    for left, right, left_np, right_np in cases:
        value = fl.tanh(left * right) + 1.0  # one line: one site for every graph
        executor.realize([value.node])
        got = value.numpy()
        np.testing.assert_allclose(got, np.tanh(left_np * right_np) + 1.0, rtol=1e-5, atol=1e-6)
    # the repeated (a, b) graphs ran the recorded plan; (a, a) reused it with a bound twice
    assert executor.plan_hits >= 3
    assert executor.plan_misses <= 4


def test_values_realized_between_calls(cuda_backend, rng):
    executor = Executor()
    a_np = rng.standard_normal(256).astype(np.float32)
    a = _tensor(a_np)
    for realize_first in (False, True, False, True):
        product = a * 3.0
        if realize_first:
            executor.realize([product.node])
        value = fl.exp(product) - a
        executor.realize([value.node])
        np.testing.assert_allclose(value.numpy(), np.exp(a_np * 3.0) - a_np, rtol=1e-5)


def test_repeated_graph_plans_once(cuda_backend, rng):
    executor = Executor()
    x_np = rng.standard_normal(1000).astype(np.float32)
    x = _tensor(x_np)
    for _ in range(5):
        value = fl.sigmoid(x * 2.0) * x
        executor.realize([value.node])
        np.testing.assert_allclose(value.numpy(), x_np / (1 + np.exp(-2 * x_np)), rtol=1e-5)
    assert (executor.plan_misses, executor.plan_hits) == (1, 4)


def test_nan_constants_do_not_replan(cuda_backend, rng):
    executor = Executor()
    x = _tensor(rng.standard_normal(256).astype(np.float32))
    for _ in range(3):
        value = fl.where(x > 0, x, x * float("nan"))
        executor.realize([value.node])
        assert np.isnan(value.numpy()).sum() == int((x.numpy() <= 0).sum())
    assert executor.plan_misses == 1
