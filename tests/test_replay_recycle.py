"""A one-kernel compiled program reuses its result's buffer only when the caller dropped the
previous result: results that are held -- as tensors, through DLPack, through the CUDA array
interface -- keep their values across later calls."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl

pytestmark = pytest.mark.gpu


def _program():
    @fl.compile
    def step(x, y):
        return (x * 2 + y).exp() - 1

    return step


def _inputs(value: float):
    x = fl.tensor(np.full(1000, value, dtype=np.float32)).realize()
    y = fl.tensor(np.arange(1000, dtype=np.float32) / 1000).realize()
    return x, y


def _expected(value: float) -> np.ndarray:
    return np.exp(value * 2 + np.arange(1000, dtype=np.float32) / 1000) - 1


def test_dropped_results_recycle_and_stay_right():
    step = _program()
    pointers = set()
    for value in (0.1, 0.2, 0.3, 0.4):
        out = step(*_inputs(value))
        np.testing.assert_allclose(out.numpy(), _expected(value), rtol=1e-5)
        pointers.add(out.data_ptr())
        del out
    assert len(pointers) == 1  # one buffer, reused once each result was dropped


def test_held_results_keep_their_values():
    step = _program()
    held = [step(*_inputs(value)) for value in (0.1, 0.2, 0.3)]
    assert len({t.data_ptr() for t in held}) == 3
    for value, out in zip((0.1, 0.2, 0.3), held):
        np.testing.assert_allclose(out.numpy(), _expected(value), rtol=1e-5)


def test_exported_memory_is_not_reused():
    cupy = pytest.importorskip("cupy")
    step = _program()
    out = step(*_inputs(0.1))
    through_interface = cupy.asarray(out)  # CUDA array interface: holds the tensor
    del out
    out2 = step(*_inputs(0.2))
    capsule_view = cupy.from_dlpack(out2)  # DLPack: holds the array
    del out2
    step(*_inputs(0.3))
    np.testing.assert_allclose(through_interface.get(), _expected(0.1), rtol=1e-5)
    np.testing.assert_allclose(capsule_view.get(), _expected(0.2), rtol=1e-5)


# --- lazy mode: a one-kernel plan's runner recycles small results the same way -------------


def _lazy(x):
    return ((x * 2 + 1).exp() - 1).realize()  # one line: its recorded walk matches next time


def _lazy_expected(values: np.ndarray) -> np.ndarray:
    return np.exp(values * 2 + 1) - 1


class _CountingAllocator:
    """Counts the device allocations made while it is CuPy's allocator (the pool's own reuse
    of a freed block would give the same address, so addresses alone prove nothing)."""

    def __init__(self):
        import cupy

        self.pool, self.calls = cupy.get_default_memory_pool(), 0

    def __call__(self, size: int):
        self.calls += 1
        return self.pool.malloc(size)


def _allocations_of(call, expected, count: int, atol: float = 0.0) -> int:
    """The device allocations made by ``count`` calls of ``call``, each result checked
    against ``expected`` and dropped before the next call."""
    cupy = pytest.importorskip("cupy")
    counter = _CountingAllocator()
    with cupy.cuda.using_allocator(counter):
        for _ in range(count):
            out = call()
            np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=atol)
            del out
    return counter.calls


def test_compiled_dropped_results_allocate_nothing():
    step = _program()
    x, y = _inputs(0.5)
    for _ in range(3):
        step(x, y)
    assert _allocations_of(lambda: step(x, y), _expected(0.5), 5) == 0


def test_lazy_dropped_results_recycle_and_stay_right():
    values = np.linspace(-1, 1, 1000, dtype=np.float32)
    x = fl.tensor(values).realize()
    for _ in range(3):  # plans, then matches the walk and makes the runner
        _lazy(x)
    assert _allocations_of(lambda: _lazy(x), _lazy_expected(values), 5, atol=1e-6) == 0


def test_lazy_results_held_by_graphs_views_or_exports_keep_their_values():
    cupy = pytest.importorskip("cupy")
    inputs = [fl.tensor(np.full(1000, v, dtype=np.float32)).realize() for v in (0.1, 0.2, 0.3)]
    for x in inputs:  # past the walk's first matches: the runner runs
        _lazy(x)
    first = _lazy(inputs[0])
    pending = first + 100  # a lazy graph reading the result: holds its node
    del first
    second = _lazy(inputs[1])
    exported = cupy.from_dlpack(second)  # DLPack: holds the array
    del second
    third = _lazy(inputs[2])
    np.testing.assert_allclose(pending.numpy(), _lazy_expected(np.float32(0.1)) + 100, rtol=1e-5)
    np.testing.assert_allclose(exported.get(), _lazy_expected(np.float32(0.2)), rtol=1e-5)
    np.testing.assert_allclose(third.numpy(), _lazy_expected(np.float32(0.3)), rtol=1e-5)


def test_lazy_results_above_the_bound_get_new_buffers():
    from flame.runtime.executor import RECYCLE_BYTES

    values = np.linspace(-1, 1, RECYCLE_BYTES // 4 + 1024, dtype=np.float32)  # just over
    x = fl.tensor(values).realize()
    for _ in range(3):
        _lazy(x)
    # every result a buffer of its own
    assert _allocations_of(lambda: _lazy(x), _lazy_expected(values), 4, atol=1e-6) == 4
