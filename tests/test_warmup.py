"""The background cuBLAS start (flame/runtime/warmup.py): off by its switch, finds the library
CuPy mapped, and on a GPU runs its products and leaves matmul correct. Its effect on the first
step's time is measured in bench/training.py, never asserted here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flame.runtime import warmup


def test_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("FLAME_CUBLAS_WARMUP", "0")
    assert warmup.start() is None


def test_library_path_reads_the_process_maps():
    from flame.runtime.cublas import mapped_library

    python_lib = mapped_library("libc.so")  # every Linux CPython maps the C library
    assert python_lib is not None and "libc.so" in python_lib
    assert mapped_library("libflame-no-such-library.so") is None


@pytest.mark.gpu
def test_warm_products_run_and_matmul_stays_right():
    code = (
        "import numpy as np, flame as fl\n"
        "from flame.runtime import warmup\n"
        "assert warmup.warm_now() is True\n"
        "a = np.arange(12, dtype=np.float32).reshape(3, 4)\n"
        "b = np.arange(8, dtype=np.float32).reshape(4, 2)\n"
        "out = (fl.tensor(a) @ fl.tensor(b)).numpy()\n"
        "np.testing.assert_allclose(out, a @ b, rtol=1e-6)\n"
        "print('ok')\n"
    )
    assert _run(code).strip() == "ok"


@pytest.mark.gpu
def test_first_realize_starts_one_thread():
    code = (
        "import threading, numpy as np, flame as fl\n"
        "from flame.runtime import warmup\n"
        "from flame.runtime.executor import default_executor\n"
        "default_executor()\n"
        "before = warmup._started.is_set()\n"
        "(fl.tensor(np.ones(4, np.float32)) * 2).numpy()\n"
        "(fl.tensor(np.ones(4, np.float32)) * 3).numpy()\n"
        "names = [t.name for t in threading.enumerate()]\n"
        "print(before, warmup._started.is_set(), names.count('flame-cublas-warmup') <= 1)\n"
    )
    # not while the first plan loads its kernels: only once its launches are queued
    assert _run(code).split() == ["False", "True", "True"]


def _run(code: str) -> str:
    """``code`` in a new Python process (cuBLAS and the thread are per process): its stdout."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout
