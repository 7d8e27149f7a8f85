"""``adaptive_max_pool2d(return_indices=True)`` and ``nn.AdaptiveMaxPool2d(return_indices=
True)`` against PyTorch: the maxima, the int64 flat indices into H * W and the gradient
(to the first maximum of a window, ties and NaN included), batched and unbatched, float32
and float64, shrinking and growing sizes; float64 central differences; ``fl.compile``; the
CUDA kernels compile with NVRTC; the errors; the GPU against the reference (gpu tier)."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_against_finite_differences
from opinfo import assert_user_error, compile_plan_kernels

import flame as fl
import flame.nn as nn
import flame.nn.functional as F

POOLS = [
    # (input shape, output_size)
    ((2, 3, 7, 8), (3, 5)), ((3, 7, 8), (2, 4)), ((2, 3, 6, 6), (3, 3)), ((1, 2, 5, 7), (7, 9)),
    ((1, 1, 9, 4), (4, 1)), ((1, 2, 5, 5), 1), ((2, 2, 6, 9), (None, 4)),
]  # fmt: skip
DTYPES = [np.float32, np.float64]


def _torch_pool(torch, x, output_size, seed):
    tensor = torch.from_numpy(x).requires_grad_()
    values, indices = torch.nn.functional.adaptive_max_pool2d(tensor, output_size, True)
    values.backward(torch.from_numpy(seed))
    return values.detach().numpy(), indices.numpy(), tensor.grad.numpy()


def _flame_pool(x, output_size, seed):
    tensor = fl.from_numpy(x).requires_grad_()
    values, indices = F.adaptive_max_pool2d(tensor, output_size, return_indices=True)
    (values * fl.from_numpy(seed)).sum().backward()
    return values.numpy(), indices.numpy(), tensor.grad.numpy()


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: dtype.__name__)
@pytest.mark.parametrize("shape, output_size", POOLS, ids=str)
def test_matches_torch(shape, output_size, dtype, ties, rng, reference_backend):
    """Ties (rounded data): both pick, and pass the gradient to, the first maximum."""
    torch = pytest.importorskip("torch")
    x = rng.standard_normal(shape).astype(dtype)
    x = np.round(x) if ties else x
    with torch.no_grad():
        out_shape = torch.nn.functional.adaptive_max_pool2d(torch.from_numpy(x), output_size)
    seed = rng.standard_normal(out_shape.shape).astype(dtype)
    values, indices, grad = _flame_pool(x, output_size, seed)
    expected_values, expected_indices, expected_grad = _torch_pool(torch, x, output_size, seed)
    np.testing.assert_array_equal(values, expected_values)
    assert indices.dtype == np.int64
    np.testing.assert_array_equal(indices, expected_indices)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-6, atol=1e-6)


def test_nan_wins_and_the_last_nan_is_picked(reference_backend):
    """PyTorch's scan (``val > maxval || isnan(val)``) keeps the last NaN of a window."""
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    x[0, 0, 1, 1] = x[0, 0, 0, 3] = x[0, 0, 1, 2] = x[0, 0, 3, 0] = np.nan
    values, indices = F.adaptive_max_pool2d(fl.from_numpy(x), (2, 2), return_indices=True)
    np.testing.assert_array_equal(indices.numpy().ravel(), [5, 6, 12, 15])
    np.testing.assert_array_equal(np.isnan(values.numpy().ravel()), [True, True, True, False])


def test_indices_point_at_the_maxima(rng, reference_backend):
    """Without PyTorch: each index names its window's maximum in the flattened plane."""
    x = rng.standard_normal((2, 3, 7, 9))
    values, indices = F.adaptive_max_pool2d(fl.from_numpy(x), (3, 4), return_indices=True)
    picked = np.take_along_axis(x.reshape(2, 3, -1), indices.numpy().reshape(2, 3, -1), 2)
    np.testing.assert_array_equal(picked.reshape(values.shape), values.numpy())


@pytest.mark.parametrize("output_size", [(3, 2), (5, 6)])
def test_gradient_matches_central_differences(output_size, rng):
    x = rng.permutation(40).reshape(1, 2, 4, 5).astype(np.float32)  # distinct: no ties
    check_against_finite_differences(
        lambda x: F.adaptive_max_pool2d(x, output_size, return_indices=True)[0], [x], [0], rng
    )


def test_module_returns_indices(rng, reference_backend):
    torch = pytest.importorskip("torch")
    ours = nn.AdaptiveMaxPool2d((2, 3), return_indices=True)
    theirs = torch.nn.AdaptiveMaxPool2d((2, 3), return_indices=True)
    assert repr(ours) == repr(theirs)
    x = rng.standard_normal((2, 3, 5, 7)).astype(np.float32)
    values, indices = ours(fl.from_numpy(x))
    expected_values, expected_indices = theirs(torch.from_numpy(x))
    np.testing.assert_array_equal(values.numpy(), expected_values.numpy())
    np.testing.assert_array_equal(indices.numpy(), expected_indices.numpy())


def test_compiled_matches_lazy_with_gradients(rng, reference_backend):
    x = fl.tensor(rng.standard_normal((2, 3, 7, 8)).astype(np.float32)).requires_grad_()
    seed = fl.tensor(rng.standard_normal((2, 3, 3, 5)).astype(np.float32))

    def step(x):
        values, indices = F.adaptive_max_pool2d(x, (3, 5), return_indices=True)
        (values * seed).sum().backward()
        return values, indices

    compiled = [out.numpy() for out in fl.compile(step)(x)]
    compiled_grad = x.grad.numpy()
    x.grad = None
    lazy = [out.numpy() for out in step(x)]
    for got, expected in zip(compiled, lazy, strict=True):
        np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(compiled_grad, x.grad.numpy())


def test_cuda_kernels_compile_with_nvrtc(cuda_backend, nvrtc, rng):
    x = fl.from_numpy(rng.standard_normal((2, 3, 7, 8)).astype(np.float32))
    (values, indices), pullback = fl.vjp(
        lambda x: F.adaptive_max_pool2d(x, (3, 5), return_indices=True), x
    )
    (grad,) = pullback(fl.ones(values.shape), fl.zeros(indices.shape, dtype=fl.int64))
    for cubin in compile_plan_kernels([values.node, indices.node, grad.node]):
        assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda x: F.adaptive_max_pool2d(x[0, 0], 2, True), fl.ShapeError,
         ["adaptive_max_pool2d", "3-d or 4-d", "[7, 8]"]),
        (lambda x: F.adaptive_max_pool2d(x, (2, 2, 2), True), ValueError,
         ["adaptive_max_pool2d", "output_size", "2 entries", "(2, 2, 2)"]),
    ],
)  # fmt: skip
def test_errors_name_the_op_shape_and_argument(call, error, words, reference_backend):
    x = fl.zeros((2, 3, 7, 8))
    assert_user_error(lambda: call(x), error, words, at="test_adaptive_max_indices.py")


@pytest.mark.gpu
@pytest.mark.parametrize("output_size", [(3, 5), (9, 11)])
def test_gpu_matches_reference(output_size, rng):
    x = np.round(rng.standard_normal((2, 3, 7, 8)) * 2).astype(np.float32)  # with ties
    seed = rng.standard_normal((2, 3, *output_size)).astype(np.float32)
    results = {}
    for backend_name in ("reference", "cuda"):
        with fl.backend(backend_name):
            results[backend_name] = _flame_pool(x, output_size, seed)
    (values, indices, grad), expected = results["cuda"], results["reference"]
    np.testing.assert_array_equal(values, expected[0])
    np.testing.assert_array_equal(indices, expected[1])
    np.testing.assert_allclose(grad, expected[2], rtol=1e-6, atol=1e-6)  # atomic sums
