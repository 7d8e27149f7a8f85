"""Backward graphs made from a recorded template (flame/grad_templates.py) are the graphs the
backward rules build: equal node for node, equal in value, and never used for a forward graph
that differs from the recorded one in ops, attributes, types, sharing, targets or hooks."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
from hypothesis import given, settings

import flame as fl
from flame import autograd, grad_templates
from tests.test_autograd import programs, run_program


@pytest.fixture(autouse=True)
def reference_backend():
    with fl.backend("reference"):
        yield


@pytest.fixture
def sweeps(monkeypatch):
    """Counts the backward sweeps that ran the rules (a template hit runs none)."""
    count = [0]
    sweep = autograd._sweep

    def counted(*args, **kwargs):
        count[0] += 1
        return sweep(*args, **kwargs)

    monkeypatch.setattr(autograd, "_sweep", counted)
    return count


def _array(seed: int, shape) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-2, 2, shape).astype(np.float32)


def _layer_norm_loss(x, w, b, dy):
    return fl.sum(fl.nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5) * dy)


def _rules_gradients(fn, args, argnums):
    """The gradients the backward rules build for ``fn(*args)`` (no template)."""
    value = fn(*args)
    seed = autograd._filled(value, 1)
    total = autograd._sweep([value], [seed], [args[i].node for i in argnums], value.backend)
    return [total.get(id(args[i].node)) for i in argnums]


def test_a_repeated_backward_is_made_from_the_template(sweeps):
    argnums = (0, 1, 2)
    grad = fl.grad(_layer_norm_loss, argnums=argnums)
    results = []
    for step in range(3):
        args = [fl.tensor(_array(step * 4 + i, s)) for i, s in enumerate([(4, 8), (8,), (8,)])]
        args.append(fl.tensor(_array(step * 4 + 3, (4, 8))))
        results.append((args, grad(*args)))
    assert sweeps[0] == 1  # the first call ran the rules; the others replayed them
    for args, grads in results[1:]:
        expected = _rules_gradients(_layer_norm_loss, args, argnums)
        for made, built in zip(grads, expected):
            assert made.node == built.node  # the same graph, node for node
            np.testing.assert_array_equal(made.numpy(), built.numpy())


def test_backward_and_grad_fields_use_templates(sweeps):
    values = []
    for step in range(3):
        x = fl.tensor(_array(step, (3, 5))).requires_grad_()
        w = fl.tensor(_array(10 + step, (5,))).requires_grad_()
        fl.sum(fl.tanh(x * w) + x).backward()
        values.append((x, w))
    assert sweeps[0] == 1
    for x, w in values:
        xs, ws = x.numpy(), w.numpy()
        t = np.tanh(xs * ws)
        np.testing.assert_allclose(x.grad.numpy(), (1 - t * t) * ws + 1, rtol=1e-5)
        np.testing.assert_allclose(w.grad.numpy(), ((1 - t * t) * xs).sum(0), rtol=1e-5)


def test_more_sharing_than_recorded_runs_the_rules(sweeps):
    grad = fl.grad(lambda a, b: fl.sum(a * b), argnums=(0, 1))
    a, b = fl.tensor(_array(0, (4,))), fl.tensor(_array(1, (4,)))
    for args in ((a, b), (a, a)):  # at one line: the second call finds the first's template
        da, db = grad(*args)  # (a, a): one tensor at both positions, its gradients add up
    assert sweeps[0] == 2
    np.testing.assert_allclose(da.numpy(), 2 * a.numpy(), rtol=1e-6)
    np.testing.assert_allclose(db.numpy(), 2 * a.numpy(), rtol=1e-6)


def test_less_sharing_than_recorded_runs_the_rules(sweeps):
    grad = fl.grad(lambda a, b: fl.sum(a * b), argnums=(0, 1))
    a, b = fl.tensor(_array(0, (4,))), fl.tensor(_array(1, (4,)))
    for args in ((a, a), (a, b)):
        da, db = grad(*args)
    assert sweeps[0] == 2
    np.testing.assert_allclose(da.numpy(), b.numpy(), rtol=1e-6)
    np.testing.assert_allclose(db.numpy(), a.numpy(), rtol=1e-6)


@pytest.mark.parametrize(
    "second",
    [
        lambda x: fl.sum(fl.sin(x)),  # another op
        lambda x: fl.sum(fl.exp(x) * 3.0),  # another constant
        lambda x: fl.sum(x.to(fl.float16).to(fl.float32) * 2.0),  # another type on the way
        lambda x: fl.sum(fl.exp(x).reshape(2, 2) * 2.0),  # another shape on the way
    ],
    ids=["op", "constant", "dtype", "shape"],
)
def test_a_different_graph_at_the_same_line_runs_the_rules(sweeps, second):
    x = fl.tensor(_array(0, (4,)))
    for fn in (lambda v: fl.sum(fl.exp(v) * 2.0), second):
        sweeps[0] = 0  # the first graph's template may come from another case of this test
        value, g = fl.value_and_grad(fn)(x)
    assert sweeps[0] == 1  # each case's second graph is new at this line
    expected = _rules_gradients(second, [x], (0,))[0]
    np.testing.assert_allclose(g.numpy(), expected.numpy(), rtol=1e-6)


def test_a_new_shape_runs_the_rules_and_is_recorded_too(sweeps):
    grad = fl.grad(lambda x: fl.sum(fl.tanh(x) * x))
    for shape in [(4,), (6,), (4,), (6,)]:
        x = fl.tensor(_array(len(shape), shape))
        t = np.tanh(x.numpy())
        np.testing.assert_allclose(grad(x).numpy(), (1 - t * t) * x.numpy() + t, rtol=1e-5)
    assert sweeps[0] == 2  # one per shape; the repeats replay


def test_another_target_runs_the_rules(sweeps):
    fn = lambda a, b: fl.sum(a * fl.exp(b))  # noqa: E731
    a, b = fl.tensor(_array(0, (4,))), fl.tensor(_array(1, (4,)))
    for argnums in (0, 1):
        g = fl.grad(fn, argnums=argnums)(a, b)
    assert sweeps[0] == 2
    np.testing.assert_allclose(g.numpy(), a.numpy() * np.exp(b.numpy()), rtol=1e-6)


def test_a_hook_registered_later_runs(sweeps):
    seen = []
    for step in range(3):
        x = fl.tensor(_array(step, (4,))).requires_grad_()
        y = fl.exp(x)
        if step == 2:
            y.register_hook(lambda g: seen.append(g.shape) or g * 0.0)
        fl.sum(y * 2.0).backward()
    assert seen == [(4,)]
    assert sweeps[0] == 2  # the first call, and the one with a hook
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros(4, np.float32))


def test_templates_keep_no_memory_alive():
    grad = fl.grad(lambda x: fl.sum(fl.exp(x) * 2.0))
    for step in range(2):
        x = fl.tensor(_array(step, (1024,)))
        g = grad(x)
        g.numpy()
    memory = weakref.ref(x.node.attr("storage"))
    del x, g
    gc.collect()
    assert memory() is None


def test_checkpoint_regions_run_the_rules(sweeps):
    for step in range(2):
        x = fl.tensor(_array(step, (4,)))
        g = fl.grad(lambda v: fl.sum(fl.checkpoint(lambda u: fl.exp(u) * u, v)))(x)
        xs = x.numpy()
        np.testing.assert_allclose(g.numpy(), np.exp(xs) * (xs + 1), rtol=1e-5)
    assert sweeps[0] == 4  # outer and inner sweep each call: never recorded


def test_a_site_whose_graphs_keep_changing_stops_recording(sweeps, monkeypatch):
    recorded = [0]
    record = grad_templates.record

    def counted(*args):
        recorded[0] += 1
        return record(*args)

    monkeypatch.setattr(grad_templates, "record", counted)
    for step in range(grad_templates.RECORDS_PER_SITE + 5):
        x = fl.tensor(_array(step, (step + 1,)))  # a new shape every call
        fl.grad(lambda v: fl.sum(v * v))(x)
    assert recorded[0] == grad_templates.RECORDS_PER_SITE
    assert sweeps[0] == grad_templates.RECORDS_PER_SITE + 5


@settings(max_examples=30, deadline=None, database=None)
@given(programs())
def test_random_graphs_made_from_templates_equal_the_rules(program):
    shapes, steps, seed = program
    rng = np.random.default_rng(seed)
    argnums = tuple(range(len(shapes)))
    fn = lambda *inputs: fl.sum(run_program(steps, inputs))  # noqa: E731
    with fl.backend("reference"):  # Hypothesis reuses the test's context across examples
        grads = []
        for _ in range(2):  # recorded (or not), then made from the template when it matches
            args = [fl.tensor(rng.uniform(-2, 2, s).astype(np.float32)) for s in shapes]
            _, made = fl.value_and_grad(fn, argnums=argnums, allow_unused=True)(*args)
            grads.append((args, made))
        args, made = grads[1]
        expected = _rules_gradients(fn, args, argnums)
        for got, built, arg in zip(made, expected, args):
            if built is None:  # unused input: zeros
                np.testing.assert_array_equal(got.numpy(), np.zeros(arg.shape, np.float32))
                continue
            assert got.node == built.node
            np.testing.assert_array_equal(got.numpy(), built.numpy())
