"""Plans outlive the calls that made them -- the executor's cache, lazy mode's recorded walks,
compiled programs, their CUDA graphs -- but none of them keeps a caller's array alive: deleting
a tensor frees its memory (plans hold stand-ins with the inputs' type and layout only)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import flame as fl

pytestmark = pytest.mark.gpu

SIZE = 1 << 16


def _device_tensor(seed: int):
    value = (fl.randn(SIZE, seed=seed) + 0.0).realize()
    assert value.node.buffer is not None and value.node.buffer.array is not None
    return value


def _gone(reference) -> bool:
    gc.collect()
    return reference() is None


def test_lazy_results_keep_no_input_alive(cuda_backend):
    x = _device_tensor(0)
    memory = weakref.ref(x.node.buffer)
    expected = np.exp(x.numpy()) * 2.0
    for _ in range(2):  # planned, then run from the recorded walk
        y = fl.exp(x) * 2.0
        np.testing.assert_allclose(y.numpy(), expected, rtol=1e-6)
    del x, y
    assert _gone(memory)


def test_realized_intermediates_are_released_too(cuda_backend):
    x = _device_tensor(1)
    middle = (x * 3.0).realize()
    memory = weakref.ref(middle.node.buffer)
    result = (fl.tanh(middle) + 1.0).numpy()
    np.testing.assert_allclose(result, np.tanh(x.numpy() * 3.0) + 1.0, rtol=1e-5, atol=1e-6)
    del middle
    assert _gone(memory)


@pytest.mark.parametrize("cuda_graph", [None, True])
def test_compiled_programs_keep_no_argument_alive(cuda_graph, cuda_backend):
    @fl.compile(cuda_graph=cuda_graph)
    def centred(a):
        return fl.exp(a - a.mean()) * 2.0  # two kernels: captured by default

    a = _device_tensor(2)
    memory = weakref.ref(a.node.buffer)
    values = a.numpy()
    for _ in range(2):
        np.testing.assert_allclose(
            centred(a).numpy(), np.exp(values - values.mean()) * 2.0, rtol=1e-5
        )
    del a
    assert _gone(memory)
    b = _device_tensor(3)  # often at the freed address: the graph must read b, not a copy
    other = b.numpy()
    np.testing.assert_allclose(centred(b).numpy(), np.exp(other - other.mean()) * 2.0, rtol=1e-5)
    assert centred.cache_info().traces == 1
