"""flame.nn.utils: gradient clipping, noise, normalisation and statistics over many tensors,
against PyTorch's ``torch.nn.utils`` and NumPy; everything stays lazy until read."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest

import flame as fl
from flame.nn import utils

# the module, not flame.tensor() (the package's function of that name shadows it)
tensor_module = importlib.import_module("flame.tensor")

SHAPES = ((3, 4), (5,), (2, 1, 3))


def parameters_with_grads(rng, scale=3.0, dtype=np.float32):
    """Tensors whose ``.grad`` is a lazy product (as after backward); one has no grad."""
    params = []
    for shape in SHAPES:
        parameter = fl.from_numpy(rng.standard_normal(shape).astype(dtype)).requires_grad_()
        grad = rng.standard_normal(shape).astype(dtype)
        parameter.grad = fl.from_numpy(grad) * scale
        params.append(parameter)
    params.append(fl.from_numpy(np.ones(2, dtype)).requires_grad_())  # .grad is None
    return params


def grads_of(params):
    return [p.grad.numpy() for p in params if p.grad is not None]


def torch_grads(copies):
    return [copy.grad.numpy() for copy in copies if copy.grad is not None]


def torch_copies(params):
    torch = pytest.importorskip("torch")
    copies = []
    for parameter in params:
        copy = torch.from_numpy(parameter.numpy().copy()).requires_grad_()
        if parameter.grad is not None:
            copy.grad = torch.from_numpy(parameter.grad.numpy().copy())
        copies.append(copy)
    return copies


@pytest.fixture
def realize_counter(monkeypatch):
    """Counts schedules run (each ``realize_nodes`` call is one host round trip)."""
    calls = []
    original = tensor_module.realize_nodes

    def counting(backend_name, nodes):
        calls.append(len(nodes))
        return original(backend_name, nodes)

    monkeypatch.setattr(tensor_module, "realize_nodes", counting)
    return calls


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.5, 1e4])
def test_clip_grad_norm_matches_torch(norm_type, max_norm, rng, reference_backend):
    torch = pytest.importorskip("torch")
    params = parameters_with_grads(rng)
    copies = torch_copies(params)
    total = utils.clip_grad_norm_(iter(params), max_norm, norm_type)  # a generator, as PyTorch
    expected = torch.nn.utils.clip_grad_norm_(copies, max_norm, norm_type)
    assert total.dtype is fl.float32 and total.shape == ()
    np.testing.assert_allclose(total.numpy(), expected.numpy(), rtol=1e-5)
    for actual, expected in zip(grads_of(params), torch_grads(copies), strict=True):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-7)
    assert params[-1].grad is None


def test_clip_grad_norm_is_lazy_until_read(rng, reference_backend, realize_counter):
    params = parameters_with_grads(rng)
    total = utils.clip_grad_norm_(params, 1.0)
    assert not realize_counter  # no host round trip: the scale is a lazy tensor
    assert not total.is_realized and not any(p.grad.is_realized for p in params[:-1])
    fl.realize(total, *(p.grad for p in params[:-1]))  # one schedule for norm and grads
    assert len(realize_counter) == 1
    clipped = np.sqrt(sum(np.sum(grad.astype(np.float64) ** 2) for grad in grads_of(params)))
    assert clipped == pytest.approx(1.0, rel=1e-5)
    assert total.item() > 1.0


def test_clip_grad_norm_after_backward_and_hooks(rng, reference_backend):
    weight = fl.from_numpy(rng.standard_normal((4, 3)).astype(np.float32)).requires_grad_()
    bias = fl.from_numpy(np.zeros(3, np.float32)).requires_grad_()
    bias.register_hook(lambda grad: grad * 0.0)  # a frozen bias: its gradient is zeroed
    inputs = fl.from_numpy(rng.standard_normal((8, 4)).astype(np.float32))
    fl.sum((inputs @ weight + bias).tanh() * 10.0).backward()
    unclipped = weight.grad.numpy()
    total = utils.clip_grad_norm_([weight, bias], 0.1)
    assert total.item() == pytest.approx(np.linalg.norm(unclipped), rel=1e-5)
    np.testing.assert_allclose(weight.grad.numpy(), unclipped * 0.1 / total.item(), rtol=1e-4)
    np.testing.assert_array_equal(bias.grad.numpy(), np.zeros(3, np.float32))


def test_clip_grad_norm_keeps_narrow_dtypes(rng, reference_backend):
    params = parameters_with_grads(rng, dtype=np.float16)
    total = utils.clip_grad_norm_(params, 1.0)
    assert all(p.grad.dtype is fl.float16 for p in params[:-1])
    assert total.dtype is fl.float32
    norm = np.sqrt(sum(np.sum(grad.astype(np.float64) ** 2) for grad in grads_of(params)))
    assert norm == pytest.approx(1.0, rel=2e-3)


def test_clip_grad_norm_of_non_finite_gradients(rng, reference_backend):
    torch = pytest.importorskip("torch")
    params = parameters_with_grads(rng)
    params[1].grad = params[1].grad * fl.from_numpy(np.float32([1, np.inf, 1, 1, 1]))
    with pytest.raises(fl.GradError, match="not finite"):
        utils.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    copies = torch_copies(params)
    total = utils.clip_grad_norm_(params, 1.0)  # as PyTorch: inf norm, scale 0, inf * 0 = NaN
    torch.nn.utils.clip_grad_norm_(copies, 1.0)
    assert total.item() == math.inf
    for actual, expected in zip(grads_of(params), torch_grads(copies), strict=True):
        np.testing.assert_array_equal(actual, expected)


def test_clip_grad_norm_without_gradients_is_zero(reference_backend):
    params = [fl.from_numpy(np.ones(3, np.float32)).requires_grad_()]
    assert utils.clip_grad_norm_(params, 1.0).item() == 0.0
    assert params[0].grad is None


def test_clip_grad_value_matches_torch(rng, reference_backend):
    torch = pytest.importorskip("torch")
    params = parameters_with_grads(rng)
    copies = torch_copies(params)
    utils.clip_grad_value_(params, 0.7)
    torch.nn.utils.clip_grad_value_(copies, 0.7)
    for actual, expected in zip(grads_of(params), torch_grads(copies), strict=True):
        np.testing.assert_array_equal(actual, expected)
    assert max(np.abs(grad).max() for grad in grads_of(params)) == pytest.approx(0.7)


def test_add_grad_noise_is_gaussian_and_reproducible(reference_backend):
    def noisy(seed, std=0.5):
        params = [fl.from_numpy(np.zeros(shape, np.float32)) for shape in ((200, 250), (50_000,))]
        for parameter in params:
            parameter.grad = fl.zeros(parameter.shape) + 1.0
        utils.add_grad_noise_(params, std, seed=seed)
        return [p.grad.numpy() - 1.0 for p in params]

    first, again, other = noisy(7), noisy(7), noisy(8)
    for noise, repeated, different in zip(first, again, other, strict=True):
        np.testing.assert_array_equal(noise, repeated)
        assert not np.allclose(noise, different)
        assert abs(noise.mean()) < 0.02 and noise.std() == pytest.approx(0.5, rel=0.03)
    assert not np.allclose(first[0].ravel()[:1000], first[1][:1000])  # tensors differ
    scheduled = noisy(7, std=fl.tensor(np.float32(0.5)))  # a lazy schedule: the same noise
    np.testing.assert_allclose(scheduled[0], first[0], rtol=1e-6)


def test_normalize_grads_gives_unit_norms(rng, reference_backend):
    params = parameters_with_grads(rng)
    before = grads_of(params)
    utils.normalize_grads_(params)
    for grad, original in zip(grads_of(params), before, strict=True):
        assert np.linalg.norm(grad) == pytest.approx(1.0, rel=1e-5)
        np.testing.assert_allclose(grad, original / np.linalg.norm(original), rtol=1e-5)


def test_grad_stats(rng, reference_backend, realize_counter):
    params = parameters_with_grads(rng)
    special = np.float32([np.nan, 1, -np.inf, np.inf, 1])
    params[1].grad = params[1].grad * fl.from_numpy(special)
    stats = utils.grad_stats(params)
    assert not realize_counter and set(stats) == {"norm", "max_abs", "nan_count", "inf_count"}
    fl.realize(*stats.values())
    assert len(realize_counter) == 1
    assert stats["nan_count"].item() == 1 and stats["inf_count"].item() == 2
    assert stats["nan_count"].dtype is fl.int64
    assert math.isnan(stats["norm"].item()) and math.isnan(stats["max_abs"].item())

    finite = parameters_with_grads(rng)
    stats = utils.grad_stats(finite)
    flat = np.concatenate([grad.ravel() for grad in grads_of(finite)]).astype(np.float64)
    assert stats["norm"].item() == pytest.approx(np.linalg.norm(flat), rel=1e-6)
    assert stats["max_abs"].item() == pytest.approx(np.abs(flat).max(), rel=1e-7)
    assert stats["nan_count"].item() == 0 and stats["inf_count"].item() == 0


def test_bad_arguments(rng, reference_backend):
    params = parameters_with_grads(rng)
    with pytest.raises(ValueError, match="norm_type"):
        utils.clip_grad_norm_(params, 1.0, norm_type=-1.0)
    with pytest.raises(ValueError, match="clip_value"):
        utils.clip_grad_value_(params, -1.0)
    with pytest.raises(TypeError, match="seed"):
        utils.add_grad_noise_(params, 0.1, seed=-3)
    with pytest.raises(TypeError, match="flame.Tensor"):
        utils.clip_grad_norm_([np.ones(3)], 1.0)
    assert fl.nn.utils is utils


@pytest.mark.gpu
def test_gpu_clip_and_stats_in_one_schedule(rng):
    arrays = [rng.standard_normal((512, 1024)).astype(np.float32) * 4, rng.standard_normal(4096)]
    with fl.backend("cuda"):
        weight = fl.from_numpy(arrays[0]).requires_grad_()
        scale = fl.from_numpy(arrays[1].astype(np.float32)).requires_grad_()
        loss = fl.sum(fl.reshape(weight, (128, 4096)).tanh() * scale)
        loss.backward()
        before = utils.grad_stats([weight, scale])
        total = utils.clip_grad_norm_([weight, scale], 1.0)
        fl.realize(total, weight.grad, scale.grad, *before.values())
    with fl.backend("reference"):
        weight_ref = fl.from_numpy(arrays[0]).requires_grad_()
        scale_ref = fl.from_numpy(arrays[1].astype(np.float32)).requires_grad_()
        fl.sum(fl.reshape(weight_ref, (128, 4096)).tanh() * scale_ref).backward()
        expected = utils.clip_grad_norm_([weight_ref, scale_ref], 1.0)
    assert total.item() == pytest.approx(expected.item(), rel=1e-5)
    assert before["norm"].item() == pytest.approx(expected.item(), rel=1e-5)
    assert before["nan_count"].item() == 0
    np.testing.assert_allclose(weight.grad.numpy(), weight_ref.grad.numpy(), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(scale.grad.numpy(), scale_ref.grad.numpy(), rtol=1e-4, atol=1e-7)
