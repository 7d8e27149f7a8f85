"""One prepared kernel launched from several threads at once: each launch fills a parameter
block of its own with its buffers' addresses, so no thread's kernel reads another thread's
inputs or writes another thread's result."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import flame as fl

pytestmark = pytest.mark.gpu

THREADS = 8
CALLS = 200
SIZE = 4096


def _run_threads(work) -> None:
    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _affine(x, y):
    return x * 3.0 + y


def test_threads_replaying_one_kernel_get_their_own_results(cuda_backend):
    compiled = fl.compile(_affine)
    inputs = [
        (
            fl.tensor(np.full(SIZE, float(t), np.float32)).realize(),
            fl.tensor(np.full(SIZE, 1000.0 * t, np.float32)).realize(),
        )
        for t in range(THREADS)
    ]
    compiled(*inputs[0]).realize()
    fl.synchronize()
    assert compiled.cache_info().traces == 1
    wrong: list[str] = []
    start = threading.Barrier(THREADS)

    def work(t: int) -> None:
        start.wait()
        try:  # a thread's first CUDA call here is a launch: its context must be made current
            x, y = inputs[t]
            results = [compiled(x, y) for _ in range(CALLS)]
            fl.synchronize()
        except Exception as error:  # noqa: BLE001  reported by the main thread
            wrong.append(f"thread {t}: {type(error).__name__}: {error}")
            return
        expected = 3.0 * t + 1000.0 * t
        for call, value in enumerate(results):
            array = value.numpy()
            if not np.all(array == expected):
                wrong.append(f"thread {t} call {call}: {np.unique(array)[:4]} != {expected}")
                return

    _run_threads(work)
    assert not wrong, wrong[:4]
    assert compiled.cache_info().traces == 1  # every thread replayed the one program


def test_threads_realizing_one_lazy_expression_get_their_own_results(cuda_backend):
    inputs = [fl.tensor(np.full(SIZE, float(t), np.float32)).realize() for t in range(THREADS)]
    wrong: list[str] = []
    start = threading.Barrier(THREADS)

    def work(t: int) -> None:
        start.wait()
        x = inputs[t]
        try:
            results = [(fl.exp(x * 0.0) * t + x).realize() for _ in range(CALLS // 4)]
            fl.synchronize()
        except Exception as error:  # noqa: BLE001  reported by the main thread
            wrong.append(f"thread {t}: {type(error).__name__}: {error}")
            return
        for call, value in enumerate(results):
            if not np.all(value.numpy() == 2.0 * t):
                wrong.append(f"thread {t} call {call}")
                return

    _run_threads(work)
    assert not wrong, wrong[:4]
