"""Lazy mode's recorded walks on the GPU (flame/runtime/executor.py, ``Executor.realize``): a graph
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
    # the repeated (a, b) graphs and (b, a) ran the recorded plan; (a, a) shares more than the
    # recorded walk and gets a plan of its own, as do the broadcast and strided graphs
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


def test_several_results_at_one_line_run_the_recorded_plan(cuda_backend, rng):
    """``realize(out, grad)``-style schedules: several roots, some reached from others."""
    executor = Executor()
    a_np = rng.standard_normal(128).astype(np.float32)
    b_np = rng.standard_normal(128).astype(np.float32)
    a, b = _tensor(a_np), _tensor(b_np)
    cases = [(a, b, a_np, b_np)] * 3 + [(b, a, b_np, a_np), (a, a, a_np, a_np), (a, b, a_np, b_np)]
    for left, right, left_np, right_np in cases:
        inner = fl.exp(left) * right  # inner is a root and an input of outer
        outer, other = fl.tanh(inner) + left, right * 2.0
        executor.realize([outer.node, inner.node, other.node])
        inner_np = np.exp(left_np) * right_np
        np.testing.assert_allclose(inner.numpy(), inner_np, rtol=1e-5)
        np.testing.assert_allclose(outer.numpy(), np.tanh(inner_np) + left_np, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(other.numpy(), right_np * 2.0, rtol=1e-6)
    assert executor.plan_hits >= 3  # the repeats of (a, b) and (b, a) matched the walk
    assert executor.plan_misses <= 3


def test_several_results_in_another_order_or_structure(cuda_backend, rng):
    executor = Executor()
    x_np = rng.standard_normal(64).astype(np.float32)
    x = _tensor(x_np)
    for step in range(6):
        first = fl.exp(x) + 1.0
        second = first * 2.0 if step % 2 else fl.sin(x)  # reached from first, or not
        roots = [first, second] if step < 4 else [second, first]
        executor.realize([t.node for t in roots])
        np.testing.assert_allclose(first.numpy(), np.exp(x_np) + 1.0, rtol=1e-5)
        expected = (np.exp(x_np) + 1.0) * 2.0 if step % 2 else np.sin(x_np)
        np.testing.assert_allclose(second.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_lazy_gradients_repeat_through_templates_and_walks(cuda_backend, rng):
    """A lazy training step at one line: backward from its template, realize from its walk."""
    w_np = rng.standard_normal((16, 8)).astype(np.float32)
    from flame.runtime.executor import default_executor

    grad = fl.value_and_grad(lambda w, x: fl.sum(fl.tanh(x * w) * x), argnums=0)
    hits = default_executor().plan_hits
    for _ in range(4):
        x_np = rng.standard_normal((16, 8)).astype(np.float32)
        w, x = _tensor(w_np), _tensor(x_np)
        value, g = grad(w, x)
        fl.realize(value, g)
        t = np.tanh(x_np * w_np)
        np.testing.assert_allclose(value.numpy(), (t * x_np).sum(), rtol=1e-4)
        np.testing.assert_allclose(g.numpy(), (1 - t * t) * x_np * x_np, rtol=1e-4, atol=1e-6)
    assert default_executor().plan_hits >= hits + 3  # steps 2-4 ran the first step's plan
