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
