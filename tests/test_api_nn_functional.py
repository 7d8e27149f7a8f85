"""The nn.functional additions of issue 18 (flame/nn/activations.py, flame/nn/losses.py,
cross_entropy's new targets): values against NumPy formulas (runs without PyTorch), values
and gradients against PyTorch where importable, gradients against float64 central
differences, and PyTorch's gradients at the kinks of the piecewise activations."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_against_finite_differences, check_against_torch

import flame as fl

F = fl.nn.functional


def torch_module():
    return pytest.importorskip("torch", reason="PyTorch is the reference for these checks")


def _softplus(a):
    return np.logaddexp(0.0, a)


SELU = (1.6732632423543772848170429916717, 1.0507009873554804934193349852946)
# (name, keyword arguments, NumPy formula)
ACTIVATIONS = [
    ("elu", {}, lambda a: np.where(a > 0, a, np.expm1(a))),
    ("elu", {"alpha": 0.5}, lambda a: np.where(a > 0, a, 0.5 * np.expm1(a))),
    ("celu", {"alpha": 2.0}, lambda a: np.where(a > 0, a, 2.0 * np.expm1(a / 2.0))),
    ("selu", {}, lambda a: SELU[1] * np.where(a > 0, a, SELU[0] * np.expm1(a))),
    ("relu6", {}, lambda a: np.clip(a, 0, 6)),
    ("hardtanh", {}, lambda a: np.clip(a, -1, 1)),
    ("hardtanh", {"min_val": -2.0, "max_val": 0.5}, lambda a: np.clip(a, -2, 0.5)),
    ("hardswish", {}, lambda a: a * np.clip(a + 3, 0, 6) / 6),
    ("hardsigmoid", {}, lambda a: np.clip(a + 3, 0, 6) / 6),
    ("logsigmoid", {}, lambda a: -_softplus(-a)),
    ("mish", {}, lambda a: a * np.tanh(_softplus(a))),
    ("softsign", {}, lambda a: a / (1 + np.abs(a))),
]
ACTIVATION_IDS = [f"{name}-{index}" for index, (name, _, _) in enumerate(ACTIVATIONS)]


def smooth_inputs(rng, shape=(4, 8)):
    """Values in [-7, 7] at least 0.05 from the kinks at 0, +-1, +-3, 6 and the bounds."""
    values = rng.uniform(-7, 7, shape)
    kinks = np.array([-3.0, -2.0, -1.0, 0.0, 0.5, 1.0, 3.0, 6.0])
    near = np.abs(values[..., None] - kinks).min(-1) < 0.05
    return np.where(near, values + 0.1, values).astype(np.float32)


@pytest.mark.parametrize("case", ACTIVATIONS, ids=ACTIVATION_IDS)
def test_activation_value_matches_numpy(case, rng, reference_backend):
    name, keywords, formula = case
    array = smooth_inputs(rng)
    result = getattr(F, name)(fl.from_numpy(array), **keywords).numpy()
    np.testing.assert_allclose(result, formula(array.astype(np.float64)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ACTIVATIONS, ids=ACTIVATION_IDS)
def test_activation_gradient_matches_finite_differences(case, rng):
    name, keywords, _ = case
    function = getattr(F, name)
    check_against_finite_differences(lambda x: function(x, **keywords), [smooth_inputs(rng)],
                                     [0], rng)  # fmt: skip


@pytest.mark.parametrize("case", ACTIVATIONS, ids=ACTIVATION_IDS)
def test_activation_matches_torch_at_kinks_too(case, rng):
    torch = torch_module()
    name, keywords, _ = case
    array = smooth_inputs(rng)
    array[0, :8] = [-3.0, 3.0, 0.0, 6.0, -1.0, 1.0, -2.0, 0.5]  # PyTorch's choice at each kink
    ours, theirs = getattr(F, name), getattr(torch.nn.functional, name)
    check_against_torch(lambda x: ours(x, **keywords), lambda x: theirs(x, **keywords), [array],
                        [0], rng)  # fmt: skip


def test_softmin_matches_numpy_and_torch(rng, reference_backend):
    array = rng.standard_normal((3, 5)).astype(np.float32)
    exponent = np.exp(-array - (-array).max(1, keepdims=True))
    expected = exponent / exponent.sum(1, keepdims=True)
    np.testing.assert_allclose(F.softmin(fl.from_numpy(array), 1).numpy(), expected, rtol=1e-6)
    torch = torch_module()
    check_against_torch(lambda x: F.softmin(x, 0), lambda x: torch.nn.functional.softmin(x, 0),
                        [array], [0], rng)  # fmt: skip


# --- losses ------------------------------------------------------------------------------------

REDUCTIONS = ("mean", "sum", "none")


def _reduce(loss, reduction):
    return {"mean": loss.mean(), "sum": loss.sum(), "none": loss}[reduction]


def _loss_inputs(rng):
    probability = rng.uniform(0.05, 0.95, (4, 6)).astype(np.float32)
    labels = (rng.random((4, 6)) < 0.5).astype(np.float32)
    return probability, labels, rng.standard_normal((4, 6)).astype(np.float32) * 2


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_elementwise_losses_match_numpy(reduction, rng, reference_backend):
    probability, labels, scores = _loss_inputs(rng)
    p, y, x = (fl.from_numpy(array) for array in (probability, labels, scores))
    weight = np.linspace(0.5, 2.0, 6).astype(np.float32)
    bce = -weight * (labels * np.log(probability) + (1 - labels) * np.log(1 - probability))
    logits_bce = (1 - labels) * scores + (1 + (weight - 1) * labels) * _softplus(-scores)
    difference = np.abs(scores - labels)
    expected = {
        "bce": (F.binary_cross_entropy(p, y, fl.from_numpy(weight), reduction=reduction), bce),
        "bce_logits": (F.binary_cross_entropy_with_logits(
            x, y, reduction=reduction, pos_weight=fl.from_numpy(weight)), logits_bce),
        "l1": (F.l1_loss(x, y, reduction=reduction), difference),
        "smooth_l1": (F.smooth_l1_loss(x, y, reduction=reduction, beta=0.5),
                      np.where(difference < 0.5, difference**2, difference - 0.25)),
        "huber": (F.huber_loss(x, y, reduction=reduction, delta=2.0),
                  np.where(difference < 2, 0.5 * difference**2, 2 * (difference - 1))),
    }  # fmt: skip
    for name, (ours, formula) in expected.items():
        np.testing.assert_allclose(
            ours.numpy(), _reduce(formula, reduction), rtol=1e-5, atol=1e-6, err_msg=name
        )


# (name, reduction -> FLAME loss, reduction -> PyTorch loss (of torch.nn.functional first),
# differentiated inputs among (probability, labels, scores, weight))
LOSSES = [
    ("bce", lambda r: lambda p, y, x, w: F.binary_cross_entropy(p, y, w, reduction=r),
     lambda r: lambda t, p, y, x, w: t.binary_cross_entropy(p, y, w, reduction=r), [0, 1]),
    ("bce_logits", lambda r: lambda p, y, x, w: F.binary_cross_entropy_with_logits(
        x, y, w, reduction=r, pos_weight=w[0]),
     lambda r: lambda t, p, y, x, w: t.binary_cross_entropy_with_logits(
        x, y, w, reduction=r, pos_weight=w[0]), [1, 2]),
    ("l1", lambda r: lambda p, y, x, w: F.l1_loss(x, y, reduction=r),
     lambda r: lambda t, p, y, x, w: t.l1_loss(x, y, reduction=r), [1, 2]),
    ("smooth_l1", lambda r: lambda p, y, x, w: F.smooth_l1_loss(x, y, reduction=r, beta=0.7),
     lambda r: lambda t, p, y, x, w: t.smooth_l1_loss(x, y, reduction=r, beta=0.7), [1, 2]),
    ("huber", lambda r: lambda p, y, x, w: F.huber_loss(x, y, reduction=r, delta=1.5),
     lambda r: lambda t, p, y, x, w: t.huber_loss(x, y, reduction=r, delta=1.5), [1, 2]),
    ("kl_div", lambda r: lambda p, y, x, w: F.kl_div(p.log(), y * 0.5 + 0.25, reduction=r),
     lambda r: lambda t, p, y, x, w: t.kl_div(p.log(), y * 0.5 + 0.25, reduction=r), [0, 1]),
    ("kl_div_log_target", lambda r: lambda p, y, x, w: F.kl_div(
        p.log(), x * 0.1, reduction=r, log_target=True),
     lambda r: lambda t, p, y, x, w: t.kl_div(p.log(), x * 0.1, reduction=r, log_target=True),
     [0, 2]),
]  # fmt: skip


LOSS_PARAMS = [
    pytest.param(case, reduction, id=f"{case[0]}-{reduction}")
    for case in LOSSES
    for reduction in REDUCTIONS + (("batchmean",) if case[0].startswith("kl_div") else ())
]


@pytest.mark.parametrize("case, reduction", LOSS_PARAMS)
def test_losses_match_torch(case, reduction, rng):
    torch = torch_module()
    _, ours_for, theirs_for, positions = case
    ours, theirs = ours_for(reduction), theirs_for(reduction)
    probability, labels, scores = _loss_inputs(rng)
    weight = rng.uniform(0.5, 2.0, (4, 6)).astype(np.float32)
    check_against_torch(
        ours, lambda *tensors: theirs(torch.nn.functional, *tensors),
        [probability, labels, scores, weight], positions, rng,
    )  # fmt: skip
    check_against_finite_differences(ours, [probability, labels, scores, weight], positions, rng,
                                     rtol=1e-5, atol=1e-6)  # fmt: skip


def test_kl_div_with_zero_target_is_finite(reference_backend):
    log_probabilities = fl.from_numpy(np.log(np.array([0.5, 0.25, 0.25], np.float32)))
    target = fl.from_numpy(np.array([1.0, 0.0, 0.0], np.float32))
    np.testing.assert_allclose(F.kl_div(log_probabilities, target, reduction="sum").numpy(),
                               np.log(2.0), rtol=1e-6)  # fmt: skip


def test_binary_cross_entropy_clamps_logs_at_minus_100(reference_backend):
    probability = fl.from_numpy(np.array([0.0, 1.0], np.float32))
    labels = fl.from_numpy(np.array([1.0, 0.0], np.float32))
    np.testing.assert_allclose(
        F.binary_cross_entropy(probability, labels, reduction="none").numpy(), [100.0, 100.0]
    )


def _class_inputs(rng):
    logits = rng.standard_normal((3, 5, 2, 2)).astype(np.float32)
    target = rng.integers(0, 5, (3, 2, 2))
    target[0, 0, 0] = 1  # one ignored entry
    probabilities = rng.random((3, 5, 2, 2)).astype(np.float32)
    probabilities /= probabilities.sum(1, keepdims=True)
    return logits, target, probabilities, rng.uniform(0.5, 2.0, 5).astype(np.float32)


def test_class_losses_match_numpy(rng, reference_backend):
    logits, target, probabilities, weight = _class_inputs(rng)
    shifted = logits - logits.max(1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
    picked = np.take_along_axis(log_p, target[:, None], 1)[:, 0]
    picked_weight = weight[target]
    valid = target != 1
    expected = -(picked * picked_weight * valid).sum() / (picked_weight * valid).sum()
    x, t, w = fl.from_numpy(logits), fl.tensor(target), fl.from_numpy(weight)
    np.testing.assert_allclose(F.cross_entropy(x, t, w, ignore_index=1).numpy(), expected, 1e-5)
    nll = F.nll_loss(fl.from_numpy(log_p), t, w, ignore_index=1, reduction="none").numpy()
    np.testing.assert_allclose(nll, -picked * picked_weight * valid, rtol=1e-5, atol=1e-7)
    soft = -(probabilities * log_p * weight[:, None, None]).sum(1).mean()
    np.testing.assert_allclose(
        F.cross_entropy(x, fl.from_numpy(probabilities), w).numpy(), soft, rtol=1e-5
    )


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_cross_entropy_targets_match_torch(reduction, smoothing, rng):
    torch = torch_module()
    tf = torch.nn.functional
    logits, target, probabilities, weight = _class_inputs(rng)
    t_target = torch.from_numpy(target)
    keywords = {"reduction": reduction, "label_smoothing": smoothing}
    check_against_torch(
        lambda x, w: F.cross_entropy(x, fl.tensor(target), w, ignore_index=1, **keywords),
        lambda x, w: tf.cross_entropy(x, t_target, w, ignore_index=1, **keywords),
        [logits, weight], [0], rng,
    )  # fmt: skip
    check_against_torch(
        lambda x, p, w: F.cross_entropy(x, p, w, **keywords),
        lambda x, p, w: tf.cross_entropy(x, p, w, **keywords),
        [logits, probabilities, weight], [0, 1], rng,
    )  # fmt: skip
    check_against_torch(
        lambda x, w: F.nll_loss(x, fl.tensor(target), w, ignore_index=2, reduction=reduction),
        lambda x, w: tf.nll_loss(x, t_target, w, ignore_index=2, reduction=reduction),
        [logits, weight], [0], rng,
    )  # fmt: skip


def test_unbatched_class_losses_match_torch(rng):
    torch = torch_module()
    row = rng.standard_normal(5).astype(np.float32)
    check_against_torch(lambda x: F.cross_entropy(x, fl.tensor(3)),
                        lambda x: torch.nn.functional.cross_entropy(x, torch.tensor(3)),
                        [row], [0], rng)  # fmt: skip


@pytest.mark.parametrize("order, dim", [(2, 1), (1, 0), (3, -1), (float("inf"), 1)])
def test_normalize_matches_torch(order, dim, rng):
    torch = torch_module()
    array = rng.standard_normal((3, 4)).astype(np.float32)
    check_against_torch(lambda x: F.normalize(x, order, dim),
                        lambda x: torch.nn.functional.normalize(x, order, dim), [array], [0],
                        rng)  # fmt: skip


BAD_INPUT = [
    (lambda x: F.cross_entropy(x, fl.zeros(3, dtype=fl.int64)), fl.ShapeError,
     r"cross_entropy: target int64\[3\] must hold class indices \[4\]"),
    (lambda x: F.cross_entropy(x, fl.zeros(4, 6)), fl.ShapeError,
     "must hold probabilities shaped like input"),
    (lambda x: F.nll_loss(x, fl.zeros(4, dtype=fl.int64), fl.ones(3)), fl.ShapeError,
     r"nll_loss: weight float32\[3\] must hold one value per class \(5\)"),
    (lambda x: F.l1_loss(x, x, reduction="average"), ValueError, "l1_loss: reduction must be"),
    (lambda x: F.binary_cross_entropy(x, x[0]), fl.ShapeError, "differ in shape"),
    (lambda x: F.smooth_l1_loss(x, x, beta=-1.0), ValueError, "beta must be >= 0"),
]  # fmt: skip


@pytest.mark.parametrize("index", range(len(BAD_INPUT)))
def test_bad_input_raises_at_the_users_line(index, reference_backend):
    build, error, pattern = BAD_INPUT[index]
    with pytest.raises(error, match=pattern) as raised:
        build(fl.zeros(4, 5))
    assert "[at test_api_nn_functional.py:" in str(raised.value)


# --- gpu tier: activations and losses lowered to kernels, against the reference -----------------

GPU_CASES = [
    *[(f"{name}-{index}", lambda x, name=name, keywords=keywords: getattr(F, name)(x, **keywords))
      for index, (name, keywords, _) in enumerate(ACTIVATIONS)],
    ("cross_entropy_soft", lambda x: F.cross_entropy(x, F.softmax(x * 0.5, 1))),
    ("cross_entropy_weighted", lambda x: F.cross_entropy(
        x, fl.tensor(np.arange(4) % 8), x[0].abs() + 0.5, label_smoothing=0.1)),
    ("bce_logits", lambda x: F.binary_cross_entropy_with_logits(x, (x > 0).float())),
    ("huber", lambda x: F.huber_loss(x, x * 0.5, delta=0.7)),
    ("normalize", lambda x: F.normalize(x, dim=1)),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[case[0] for case in GPU_CASES])
def test_gpu_value_and_gradient_match_reference(case, rng):
    _, build = case
    array = smooth_inputs(rng)
    results = {}
    for backend in ("reference", "cuda"):
        with fl.backend(backend):
            x = fl.from_numpy(array)
            x.requires_grad_()
            out = build(x)
            (out * out).sum().backward()
            results[backend] = [out.numpy(), x.grad.numpy()]
    for actual, expected in zip(results["cuda"], results["reference"], strict=True):
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
