"""Shared fixtures of the test suite, and the ``gpu`` marker.

Nothing here sets process-wide state: the backend is a context variable, set for one test and
reset after it, and every random generator is seeded from the test's own id, so the suite
passes in any order and in parallel (``-p randomly``, ``-n 2``).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import flame as fl


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skips with a reason otherwise)")


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is None:
        return
    from flame.runtime import device

    if not device.gpu_available():
        pytest.skip(f"no usable GPU: {device.gpu_unavailable_reason()}")


@pytest.fixture
def reference_backend():
    """Tensors created in the test live on the NumPy reference backend."""
    with fl.backend("reference"):
        yield "reference"


@pytest.fixture
def cuda_backend():
    """Tensors created in the test live on the CUDA backend. Building graphs there never
    touches the GPU (nothing runs until a value is asked for), so CPU-tier tests that only
    lower and compile kernels use it too."""
    with fl.backend("cuda"):
        yield "cuda"


@pytest.fixture(params=["reference", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request):
    """The test body twice: on the reference backend (CPU tier) and on the GPU (gpu tier,
    skipped with the reason where there is none)."""
    with fl.backend(request.param):
        yield request.param


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the test's id: the same numbers in any order, on any worker."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def nvrtc():
    """NVRTC's version; skips when NVRTC cannot be loaded (no CuPy or no NVRTC library)."""
    from flame.runtime.compiler import nvrtc_version

    try:
        return nvrtc_version()
    except Exception as error:  # ImportError, or CuPy failing to find libnvrtc
        pytest.skip(f"NVRTC is not available: {type(error).__name__}: {error}")
