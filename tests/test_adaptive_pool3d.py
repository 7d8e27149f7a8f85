"""``adaptive_avg_pool3d``, ``nn.AdaptiveAvgPool3d`` and ``interpolate(mode="area")`` of 5-d
inputs against PyTorch (values and gradients, float32 and float64, even and uneven windows,
growing sizes, unbatched inputs); float64 central differences; ``fl.compile``; the CUDA
kernels compile with NVRTC; the errors; the GPU against the reference (gpu tier)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from gradcheck import check_against_finite_differences, check_against_torch
from opinfo import assert_compiled_matches_lazy, assert_user_error, compile_plan_kernels

import flame as fl
import flame.nn as nn
import flame.nn.functional as F

POOLS = [
    # (input shape, output_size)
    ((2, 3, 7, 8, 9), (3, 4, 5)), ((2, 3, 6, 8, 9), (3, 4, 3)), ((3, 5, 6, 7), (2, None, 4)),
    ((1, 2, 4, 4, 4), 1), ((1, 2, 5, 4, 3), (5, 4, 3)), ((1, 2, 5, 4, 3), (7, 9, 2)),
    ((2, 1, 9, 2, 5), (4, 1, 5)),
]  # fmt: skip
TOLERANCES = {np.float32: (1e-5, 1e-6), np.float64: (1e-12, 1e-14)}
DTYPES = [np.float32, np.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: dtype.__name__)
@pytest.mark.parametrize("shape, output_size", POOLS, ids=str)
def test_pool_matches_torch(shape, output_size, dtype, rng):
    torch = pytest.importorskip("torch")
    rtol, atol = TOLERANCES[dtype]
    check_against_torch(
        lambda x: F.adaptive_avg_pool3d(x, output_size),
        lambda x: torch.nn.functional.adaptive_avg_pool3d(x, output_size),
        [rng.standard_normal(shape).astype(dtype)], [0], rng, rtol=rtol, atol=atol,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: dtype.__name__)
@pytest.mark.parametrize(
    "size, scale_factor, recompute",
    [((3, 4, 5), None, None), (None, 0.6, None), (None, (0.5, 1, 0.34), True), (4, None, None),
     (None, 1.5, None)],
)  # fmt: skip
def test_interpolate_area_matches_torch(size, scale_factor, recompute, dtype, rng):
    torch = pytest.importorskip("torch")
    rtol, atol = TOLERANCES[dtype]
    arguments = (size, scale_factor, "area", None, recompute)
    check_against_torch(
        lambda x: F.interpolate(x, *arguments),
        lambda x: torch.nn.functional.interpolate(x, *arguments),
        [rng.standard_normal((2, 3, 7, 8, 9)).astype(dtype)], [0], rng, rtol=rtol, atol=atol,
    )  # fmt: skip


@pytest.mark.parametrize("output_size", [(2, 3, 2), (3, 1, 4)])
def test_gradient_matches_central_differences(output_size, rng):
    x = rng.standard_normal((1, 2, 5, 4, 3)).astype(np.float32)
    check_against_finite_differences(lambda x: F.adaptive_avg_pool3d(x, output_size), [x], [0], rng)


def test_uneven_windows_without_torch(rng, reference_backend):
    """PyTorch's windows [floor(i*D/out), ceil((i+1)*D/out)): 5 -> 3 overlaps at 1 and 3."""
    x = rng.standard_normal((1, 1, 5, 2, 2))
    out = F.adaptive_avg_pool3d(fl.from_numpy(x), (3, 1, 1)).numpy()[0, 0, :, 0, 0]
    expected = [x[0, 0, a:b].mean() for a, b in ((0, 2), (1, 4), (3, 5))]
    np.testing.assert_allclose(out, expected, rtol=1e-12)


def test_module_matches_torch(rng, reference_backend):
    torch = pytest.importorskip("torch")
    ours, theirs = nn.AdaptiveAvgPool3d((2, None, 3)), torch.nn.AdaptiveAvgPool3d((2, None, 3))
    assert repr(ours) == repr(theirs)
    x = rng.standard_normal((2, 3, 5, 4, 7)).astype(np.float32)
    expected = theirs(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(ours(fl.from_numpy(x)).numpy(), expected, rtol=1e-5, atol=1e-6)


def test_compiled_matches_lazy_with_gradients(rng, reference_backend):
    x = fl.tensor(rng.standard_normal((2, 3, 7, 8, 9)).astype(np.float32)).requires_grad_()
    seed = fl.tensor(rng.standard_normal((2, 3, 3, 4, 5)).astype(np.float32))
    area = functools.partial(F.interpolate, size=(3, 4, 5), mode="area")
    assert_compiled_matches_lazy(area, x, seed, atol=1e-7)


def test_cuda_kernels_compile_with_nvrtc(cuda_backend, nvrtc, rng):
    x = fl.from_numpy(rng.standard_normal((2, 3, 7, 8, 9)).astype(np.float32))
    out, pullback = fl.vjp(lambda x: F.adaptive_avg_pool3d(x, (3, 4, 5)), x)
    (grad,) = pullback(fl.ones(out.shape))
    for cubin in compile_plan_kernels([out.node, grad.node]):
        assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda x: F.adaptive_avg_pool3d(x[0, 0], 2), fl.ShapeError,
         ["adaptive_avg_pool3d", "4-d or 5-d", "[7, 8, 9]"]),
        (lambda x: F.adaptive_avg_pool3d(x, (2, 2)), ValueError,
         ["adaptive_avg_pool3d", "output_size", "3 entries", "(2, 2)"]),
        (lambda x: F.adaptive_avg_pool3d(x, (2, -1, 2)), ValueError,
         ["adaptive_avg_pool3d", "output_size", "non-negative", "[2, -1, 2]"]),
    ],
)  # fmt: skip
def test_errors_name_the_op_shape_and_argument(call, error, words, reference_backend):
    x = fl.zeros((2, 3, 7, 8, 9))
    assert_user_error(lambda: call(x), error, words, at="test_adaptive_pool3d.py")


@pytest.mark.gpu
@pytest.mark.parametrize("output_size", [(3, 4, 5), (2, 2, 3), 1])
def test_gpu_matches_reference(output_size, rng):
    x = rng.standard_normal((2, 3, 7, 8, 9)).astype(np.float32)
    results = {}
    for backend_name in ("reference", "cuda"):
        with fl.backend(backend_name), fl.matmul_precision("highest"):
            tensor = fl.from_numpy(x)
            out, pullback = fl.vjp(lambda x: F.adaptive_avg_pool3d(x, output_size), tensor)
            (grad,) = pullback(fl.from_numpy(np.linspace(-1, 1, out.numel(), dtype=np.float32)
                                             .reshape(out.shape)))  # fmt: skip
            results[backend_name] = (out.numpy(), grad.numpy())
    for cuda, reference in zip(results["cuda"], results["reference"], strict=True):
        np.testing.assert_allclose(cuda, reference, rtol=1e-5, atol=1e-5)
