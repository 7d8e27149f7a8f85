"""``F.embedding`` / ``nn.Embedding`` with ``scale_grad_by_freq`` and ``max_norm`` against
PyTorch: the lookup, the weight's gradient and the weight renormalised in place (which rows,
by how much, across calls and optimizer steps), float32 and float64, every ``norm_type``;
float64 central differences; ``fl.compile``; the CUDA kernels compile with NVRTC; the
errors (``sparse=True`` stays refused); the GPU against the reference (gpu tier)."""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
from gradcheck import flame_vjp, float64_values, numeric_gradient
from opinfo import assert_user_error, compile_plan_kernels

import flame as fl
import flame.nn as nn
import flame.nn.functional as F

INDICES = [
    np.array([4, 1, 4, 4, 0]),  # repeats
    np.array([[1, 3, 3, 7], [1, 1, 0, 9]]),  # 2-d, repeats
    np.array([2]),
    np.arange(10).reshape(2, 5),  # every row once
]
OPTIONS = [
    {"scale_grad_by_freq": True},
    {"scale_grad_by_freq": True, "padding_idx": 1},
    {"max_norm": 1.5},
    {"max_norm": 2.0, "norm_type": 1.0},
    {"max_norm": 1.0, "norm_type": 3.0, "padding_idx": 3},
    {"max_norm": 0.5, "norm_type": math.inf, "scale_grad_by_freq": True},
    {"max_norm": 100.0},  # no row exceeds it
]
DTYPES = [np.float32, np.float64]


def _weight(rng, dtype):
    return (rng.standard_normal((10, 4)) * 1.5).astype(dtype)


def _torch_step(torch, weight, index, options, seed):
    """(out, weight.grad, weight after the call) by PyTorch."""
    tensor = torch.from_numpy(weight.copy()).requires_grad_()
    out = torch.nn.functional.embedding(torch.from_numpy(index), tensor, **options)
    out.backward(torch.from_numpy(seed))
    return out.detach().numpy(), tensor.grad.numpy(), tensor.detach().numpy()


def _flame_step(weight, index, options, seed):
    tensor = fl.from_numpy(weight.copy()).requires_grad_()
    out = F.embedding(fl.from_numpy(index), tensor, **options)
    (out * fl.from_numpy(seed)).sum().backward()
    return out.numpy(), tensor.grad.numpy(), tensor.detach().numpy()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: dtype.__name__)
@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("index", INDICES, ids=lambda index: str(index.shape))
def test_functional_matches_torch(index, options, dtype, rng, reference_backend):
    torch = pytest.importorskip("torch")
    weight = _weight(rng, dtype)
    seed = rng.standard_normal(index.shape + (4,)).astype(dtype)
    got = _flame_step(weight, index, options, seed)
    expected = _torch_step(torch, weight, index, options, seed)
    for name, value, reference in zip(("out", "grad", "weight"), got, expected, strict=True):
        np.testing.assert_allclose(value, reference, rtol=1e-6, atol=1e-7, err_msg=name)


def test_renorm_touches_only_the_named_rows_that_exceed_max_norm(rng, reference_backend):
    """Without PyTorch: rows 0 (short) and 5, 9 (unreferenced) keep their bits; row 2 (long,
    referenced twice) is scaled to norm max_norm / (1 + 1e-7 / norm) once."""
    weight = np.zeros((10, 4), np.float64)
    weight[0], weight[2], weight[5], weight[9] = [0.1, 0, 0, 0], [3, 4, 0, 0], [6, 8, 0, 0], 1
    tensor = fl.from_numpy(weight.copy())
    F.embedding(fl.from_numpy(np.array([2, 0, 2])), tensor, max_norm=2.0)
    after = tensor.numpy()
    np.testing.assert_array_equal(np.delete(after, 2, 0), np.delete(weight, 2, 0))
    np.testing.assert_allclose(after[2], weight[2] * 2.0 / (5 + 1e-7), rtol=1e-15)


def test_scale_grad_by_freq_divides_by_the_count(reference_backend):
    weight = fl.zeros((5, 2)).requires_grad_()
    out = F.embedding(fl.from_numpy(np.array([[3, 3], [3, 1]])), weight, scale_grad_by_freq=True)
    out.sum().backward()
    np.testing.assert_array_equal(weight.grad.numpy()[:, 0], [0, 1, 0, 1, 0])


@pytest.mark.parametrize("padding_idx", [None, 1])
def test_frequency_scaled_gradient_is_central_differences_over_counts(padding_idx, rng):
    """scale_grad_by_freq's gradient is not a derivative: it is the lookup's (float64
    central differences) divided, row by row, by the count of that row's index."""
    weight, index = _weight(rng, np.float32), INDICES[1]
    plain = partial(F.embedding, padding_idx=padding_idx)
    scaled = partial(plain, scale_grad_by_freq=True)
    with fl.backend("reference"):
        _, out, projection, (grad,) = flame_vjp(
            lambda w, i: scaled(i, w), [weight, index], [0], rng
        )
        tensor = fl.from_numpy(weight)
        loss = fl.sum(plain(fl.from_numpy(index), tensor) * fl.from_numpy(projection))
        numeric = numeric_gradient(loss, tensor)
    counts = np.maximum(np.bincount(index.ravel(), minlength=10), 1)[:, None]
    if padding_idx is not None:
        numeric[padding_idx] = 0
    (analytic,) = float64_values([grad])
    np.testing.assert_allclose(analytic, numeric / counts, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("compiled", [False, True], ids=["lazy", "compiled"])
def test_module_training_steps_match_torch(compiled, rng, reference_backend):
    """Three SGD steps of an Embedding with both options (the renorm writes the parameter
    each step, before the lookup), eager and under ``fl.compile``."""
    torch = pytest.importorskip("torch")
    options = {"max_norm": 1.2, "scale_grad_by_freq": True, "padding_idx": 0}
    ours, theirs = nn.Embedding(10, 4, **options), torch.nn.Embedding(10, 4, **options)
    assert repr(ours) == repr(theirs)
    with torch.no_grad():
        theirs.weight.copy_(torch.from_numpy(ours.weight.numpy()))
    ours_sgd = fl.optim.SGD(ours.parameters(), lr=0.1)
    theirs_sgd = torch.optim.SGD(theirs.parameters(), lr=0.1)

    def step(index):
        ours_sgd.zero_grad()
        loss = (ours(index) ** 2).sum()
        loss.backward()
        ours_sgd.step()
        return loss

    run = fl.compile(step) if compiled else step
    for _ in range(3):
        index = rng.integers(0, 10, (3, 5))
        loss = run(fl.from_numpy(index))
        theirs_sgd.zero_grad()
        expected = (theirs(torch.from_numpy(index)) ** 2).sum()
        expected.backward()
        theirs_sgd.step()
        np.testing.assert_allclose(loss.numpy(), expected.item(), rtol=1e-5)
        np.testing.assert_allclose(
            ours.weight.numpy(), theirs.weight.detach().numpy(), rtol=1e-5, atol=1e-6
        )


def test_cuda_kernels_compile_with_nvrtc(cuda_backend, nvrtc, rng):
    """The renormalised weight (the in-place write itself needs the GPU's memory) and the
    lookup's frequency-scaled gradient, as one CUDA plan."""
    from flame.nn.embedding import renormed

    weight = fl.from_numpy(_weight(rng, np.float32))
    index = fl.from_numpy(INDICES[1])
    new_weight = renormed(weight, index, 1.0, 2.0)
    out, pullback = fl.vjp(lambda w: F.embedding(index, w, scale_grad_by_freq=True), new_weight)
    (grad,) = pullback(fl.ones(out.shape))
    for cubin in compile_plan_kernels([out.node, grad.node, new_weight.node]):
        assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda w, i: F.embedding(i, w, sparse=True), NotImplementedError,
         ["embedding", "sparse=True"]),
        (lambda w, i: nn.Embedding(10, 4, sparse=True), NotImplementedError,
         ["Embedding", "sparse=True"]),
        (lambda w, i: F.embedding(i, w[0], max_norm=1.0), ValueError,
         ["embedding", "max_norm", "2-d", "[4]"]),
        (lambda w, i: F.embedding(i + 10, w, max_norm=1.0), IndexError,
         ["embedding", "10"]),
        (lambda w, i: F.embedding(i.float(), w, scale_grad_by_freq=True), TypeError,
         ["embedding", "input", "float32"]),
    ],
)  # fmt: skip
def test_errors_name_the_op_and_argument(call, error, words, reference_backend):
    weight, index = fl.zeros((10, 4)), fl.from_numpy(INDICES[1])
    assert_user_error(lambda: call(weight, index).numpy(), error, words)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [OPTIONS[1], OPTIONS[4], OPTIONS[5]], ids=str)
def test_gpu_matches_reference(options, rng):
    weight = _weight(rng, np.float32)
    index = rng.integers(0, 10, (6, 7))
    seed = rng.standard_normal(index.shape + (4,)).astype(np.float32)
    results = {}
    for backend_name in ("reference", "cuda"):
        with fl.backend(backend_name):
            results[backend_name] = _flame_step(weight, index, options, seed)
    for cuda, reference in zip(results["cuda"], results["reference"], strict=True):
        np.testing.assert_allclose(cuda, reference, rtol=1e-5, atol=1e-6)
