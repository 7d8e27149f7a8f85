"""CUDA graphs over programs with library calls (``cuda_graph=True``): a compiled training step
with cuBLAS products is captured once and replayed, equal to the same program run step by
step; a routine that cannot be captured makes the program fall back to step-by-step runs,
still right; by default such programs are not captured."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
import flame.nn.functional as F
from flame.runtime import library

pytestmark = pytest.mark.gpu


def _loss_and_grads(x, y, w1, w2):
    def loss(w1, w2):
        return F.mse_loss(F.gelu(x @ w1) @ w2, y)

    return fl.value_and_grad(loss, argnums=(0, 1))(w1, w2)


def _tensors(rng, *shapes):
    return [fl.tensor(rng.standard_normal(s).astype(np.float32) * 0.1).realize() for s in shapes]


def test_training_step_with_matmuls_is_captured_and_right(rng):
    graphed = fl.compile(_loss_and_grads, cuda_graph=True)
    stepwise = fl.compile(_loss_and_grads, cuda_graph=False)
    x, y, w1, w2 = _tensors(rng, (64, 32), (64, 16), (32, 48), (48, 16))
    for _ in range(3):
        got_loss, got_grads = graphed(x, y, w1, w2)
        want_loss, want_grads = stepwise(x, y, w1, w2)
        np.testing.assert_allclose(got_loss.numpy(), want_loss.numpy(), rtol=1e-6)
        for got, want in zip(got_grads, want_grads):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-7)
        # weights updated in place keep their addresses: the same graph reads the new values
        w1.copy_(w1.numpy() - 0.1 * want_grads[0].numpy())
        w2.copy_(w2.numpy() - 0.1 * want_grads[1].numpy())
    info = graphed.cache_info()
    assert info.graph_captures == 1 and info.graph_replays == 3 and not info.graph_failures
    assert stepwise.cache_info().graph_replays == 0


def test_held_library_results_survive_the_next_replay(rng):
    compiled = fl.compile(lambda a, b: ((a @ b) * 2, (a @ b).sum()), cuda_graph=True)
    a, b = _tensors(rng, (16, 8), (8, 4))
    first, _ = compiled(a, b)
    kept = first.numpy().copy()
    a.copy_(np.ones((16, 8), np.float32))
    second, total = compiled(a, b)
    np.testing.assert_array_equal(first.numpy(), kept)
    np.testing.assert_allclose(second.numpy(), (np.ones((16, 8)) @ b.numpy()) * 2, rtol=1e-5)
    np.testing.assert_allclose(total.numpy(), (np.ones((16, 8)) @ b.numpy()).sum(), rtol=1e-5)
    assert compiled.cache_info().graph_replays == 2


def test_a_routine_that_cannot_be_captured_falls_back(rng, monkeypatch):
    import cupy

    for module in library.IMPLEMENTATION_MODULES:
        __import__(module)
    original = library.IMPLEMENTATIONS["cat"]

    def synchronizing_cat(node, arrays):
        cupy.cuda.Device().synchronize()  # not allowed while a stream is being captured
        return original(node, arrays)

    monkeypatch.setitem(library.IMPLEMENTATIONS, "cat", synchronizing_cat)
    compiled = fl.compile(lambda a, b: fl.cat([a.exp(), b], dim=0) * 3, cuda_graph=True)
    a, b = _tensors(rng, (4, 3), (2, 3))
    for _ in range(2):
        got = compiled(a, b)
        want = np.concatenate([np.exp(a.numpy()), b.numpy()]) * 3
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    info = compiled.cache_info()
    assert info.graph_replays == 0 and len(info.graph_failures) == 1


def test_library_programs_are_not_captured_by_default(rng):
    compiled = fl.compile(_loss_and_grads)
    x, y, w1, w2 = _tensors(rng, (16, 8), (16, 4), (8, 12), (12, 4))
    for _ in range(2):
        compiled(x, y, w1, w2)
    assert compiled.cache_info().graph_captures == 0
