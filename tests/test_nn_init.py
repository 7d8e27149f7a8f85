"""flame.nn.init (issue 19): PyTorch's fan rules and gains, the distributions' statistics on
large tensors, reproducibility from a seed or a generator, writes into the tensor's own
memory (views, leaves that require grad), and the same numbers on the GPU as on the
reference backend.

Tests that compare with PyTorch import it themselves; the rest run without it."""

from __future__ import annotations

import math

import numpy as np
import pytest

import flame as fl
from flame.nn import init

SHAPES = [(3, 5), (16, 4, 3), (8, 6, 3, 3), (5, 7, 2, 3, 4), (1, 1)]
NONLINEARITIES = [
    ("linear", None), ("conv1d", None), ("conv2d", None), ("conv3d", None),
    ("conv_transpose1d", None), ("conv_transpose2d", None), ("conv_transpose3d", None),
    ("sigmoid", None), ("tanh", None), ("relu", None), ("leaky_relu", None),
    ("leaky_relu", 0.2), ("leaky_relu", 3), ("leaky_relu", math.sqrt(5)), ("selu", None),
]  # fmt: skip
LARGE = (1000, 1000)


def _weight(*shape):
    """A parameter-like tensor with memory of its own (contents overwritten by the test)."""
    return fl.tensor(np.full(shape, np.nan, dtype=np.float32))


# --- fans and gains ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fans_match_pytorch(shape):
    torch = pytest.importorskip("torch")
    expected = torch.nn.init._calculate_fan_in_and_fan_out(torch.empty(shape))
    with fl.backend("reference"):
        weight = fl.zeros(shape)
    assert init._calculate_fan_in_and_fan_out(weight) == expected
    assert init.calculate_fan_in_and_fan_out(weight) == expected


def test_fans_of_a_conv_weight():
    with fl.backend("reference"):
        assert init.calculate_fan_in_and_fan_out(fl.zeros(8, 6, 3, 3)) == (54, 72)


@pytest.mark.parametrize("shape", [(), (7,)], ids=str)
def test_fans_refuse_fewer_than_two_dims(reference_backend, shape):
    with pytest.raises(ValueError, match="fewer than 2 dimensions"):
        init.calculate_fan_in_and_fan_out(fl.zeros(shape))
    with pytest.raises(ValueError, match="fewer than 2 dimensions"):
        init.xavier_uniform_(_weight(*shape))
    with pytest.raises(ValueError, match="fewer than 2 dimensions"):
        init.kaiming_normal_(_weight(*shape))


@pytest.mark.parametrize(("nonlinearity", "param"), NONLINEARITIES, ids=str)
def test_gains_match_pytorch(nonlinearity, param):
    torch = pytest.importorskip("torch")
    expected = torch.nn.init.calculate_gain(nonlinearity, param)
    assert init.calculate_gain(nonlinearity, param) == expected
    assert type(init.calculate_gain(nonlinearity, param)) is type(expected)


def test_gain_values():
    assert init.calculate_gain("tanh") == 5.0 / 3
    assert init.calculate_gain("relu") == math.sqrt(2.0)
    assert init.calculate_gain("leaky_relu") == math.sqrt(2.0 / (1 + 0.01**2))
    assert init.calculate_gain("leaky_relu", 0.2) == math.sqrt(2.0 / 1.04)


def test_gain_errors_as_pytorch(reference_backend):
    with pytest.raises(ValueError, match="Unsupported nonlinearity gelu"):
        init.calculate_gain("gelu")
    with pytest.raises(ValueError, match="negative_slope True not a valid number"):
        init.calculate_gain("leaky_relu", True)
    with pytest.raises(ValueError, match="negative_slope 0.1 not a valid number"):
        init.calculate_gain("leaky_relu", "0.1")
    with pytest.raises(ValueError, match="Unsupported nonlinearity softmax"):
        init.kaiming_uniform_(_weight(4, 4), nonlinearity="softmax")
    with pytest.raises(ValueError, match=r"Mode fan_avg not supported.*\['fan_in', 'fan_out'\]"):
        init.kaiming_uniform_(_weight(4, 4), mode="fan_avg")
    init.kaiming_uniform_(_weight(4, 4), mode="FAN_OUT")  # PyTorch lowers the mode


# --- statistics --------------------------------------------------------------------------------


def _check_uniform(values, low, high):
    assert values.min() >= low and values.max() < high
    assert values.min() < low + 0.001 * (high - low) and values.max() > high - 0.001 * (high - low)
    width = high - low
    assert abs(values.mean() - (low + high) / 2) < 0.005 * width
    assert abs(values.std() - width / math.sqrt(12)) < 0.005 * width


def _check_normal(values, mean, std):
    """Mean and std within 5 standard errors (5 / sqrt(n): 0.005 std for a million)."""
    tolerance = 5 / math.sqrt(values.size) * std
    assert abs(values.mean() - mean) < tolerance
    assert abs(values.std() - std) < tolerance


def test_uniform_and_normal(reference_backend):
    fl.manual_seed(1)
    _check_uniform(init.uniform_(_weight(*LARGE)).numpy(), 0.0, 1.0)
    _check_uniform(init.uniform_(_weight(*LARGE), -3.0, 5.0).numpy(), -3.0, 5.0)
    _check_normal(init.normal_(_weight(*LARGE)).numpy(), 0.0, 1.0)
    _check_normal(init.normal_(_weight(*LARGE), 2.0, 0.5).numpy(), 2.0, 0.5)


@pytest.mark.parametrize("shape", [(1000, 1000), (250, 40, 10, 10)], ids=str)
@pytest.mark.parametrize("gain", [1.0, 2.5])
def test_xavier(reference_backend, shape, gain):
    fl.manual_seed(2)
    fan_in, fan_out = init.calculate_fan_in_and_fan_out(fl.zeros(shape))
    std = gain * math.sqrt(2.0 / (fan_in + fan_out))
    bound = math.sqrt(3.0) * std
    _check_uniform(init.xavier_uniform_(_weight(*shape), gain=gain).numpy(), -bound, bound)
    _check_normal(init.xavier_normal_(_weight(*shape), gain=gain).numpy(), 0.0, std)


@pytest.mark.parametrize("mode", ["fan_in", "fan_out"])
@pytest.mark.parametrize(
    ("a", "nonlinearity"),
    [(0, "leaky_relu"), (math.sqrt(5), "leaky_relu"), (0, "relu"), (0, "tanh")],
)
def test_kaiming(reference_backend, mode, a, nonlinearity):
    fl.manual_seed(3)
    shape = (400, 50, 7, 7)  # fan_in 2450, fan_out 19600
    fan = 50 * 49 if mode == "fan_in" else 400 * 49
    std = init.calculate_gain(nonlinearity, a) / math.sqrt(fan)
    bound = std * math.sqrt(3.0)  # = gain * sqrt(3 / fan)
    weight = init.kaiming_uniform_(_weight(*shape), a=a, mode=mode, nonlinearity=nonlinearity)
    _check_uniform(weight.numpy(), -bound, bound)
    weight = init.kaiming_normal_(_weight(*shape), a=a, mode=mode, nonlinearity=nonlinearity)
    _check_normal(weight.numpy(), 0.0, std)


def _truncated_moments(mean, std, a, b):
    """Mean and std of N(mean, std^2) restricted to [a, b] (textbook formulas)."""
    alpha, beta = (a - mean) / std, (b - mean) / std

    def pdf(x):
        return 0.0 if math.isinf(x) else math.exp(-x * x / 2) / math.sqrt(2 * math.pi)

    def cdf(x):
        return (1 + math.erf(x / math.sqrt(2))) / 2

    mass = cdf(beta) - cdf(alpha)
    shift = (pdf(alpha) - pdf(beta)) / mass
    alpha_term = 0.0 if math.isinf(alpha) else alpha * pdf(alpha)
    beta_term = 0.0 if math.isinf(beta) else beta * pdf(beta)
    variance = 1 + (alpha_term - beta_term) / mass - shift * shift
    return mean + std * shift, std * math.sqrt(variance)


@pytest.mark.parametrize(
    ("mean", "std", "a", "b"),
    [(0.0, 1.0, -2.0, 2.0), (0.0, 0.02, -0.04, 0.04), (1.0, 2.0, 0.0, 6.0), (0.0, 1.0, -0.5, 3.0),
     (0.0, 1.0, -math.inf, 1.0), (0.0, 1.0, -math.inf, math.inf)],
    ids=str,
)  # fmt: skip
def test_trunc_normal_stays_inside_with_the_truncated_moments(reference_backend, mean, std, a, b):
    fl.manual_seed(4)
    values = init.trunc_normal_(_weight(*LARGE), mean, std, a, b).numpy()
    assert np.isfinite(values).all()
    assert values.min() >= a and values.max() <= b
    expected_mean, expected_std = _truncated_moments(mean, std, a, b)
    assert abs(values.mean() - expected_mean) < 0.005 * std
    assert abs(values.std() - expected_std) < 0.005 * std
    # the shape too: the fraction below the middle of [a, b] (clipped to 4 std)
    middle = (max(a, mean - 4 * std) + min(b, mean + 4 * std)) / 2
    cdf = lambda x: (1 + math.erf((x - mean) / (std * math.sqrt(2)))) / 2  # noqa: E731
    expected = (cdf(middle) - cdf(a)) / (cdf(b) - cdf(a))
    assert abs((values < middle).mean() - expected) < 0.003


def test_trunc_normal_warns_as_pytorch_when_the_mean_is_far_outside(reference_backend):
    with pytest.warns(UserWarning, match="mean is more than 2 std from"):
        values = init.trunc_normal_(_weight(100, 100), mean=10.0, std=1.0, a=-2.0, b=2.0)
    assert (values.numpy() >= -2.0).all() and (values.numpy() <= 2.0).all()


def test_constants_eye_and_dirac(reference_backend):
    np.testing.assert_array_equal(
        init.constant_(_weight(3, 4), 0.25).numpy(), np.full((3, 4), 0.25)
    )
    np.testing.assert_array_equal(init.ones_(_weight(3, 4)).numpy(), np.ones((3, 4)))
    np.testing.assert_array_equal(init.zeros_(_weight(3, 4)).numpy(), np.zeros((3, 4)))
    np.testing.assert_array_equal(init.eye_(_weight(3, 5)).numpy(), np.eye(3, 5))
    np.testing.assert_array_equal(init.eye_(_weight(4, 2)).numpy(), np.eye(4, 2))
    with pytest.raises(ValueError, match="Only tensors with 2 dimensions are supported"):
        init.eye_(_weight(2, 2, 2))
    with pytest.raises(ValueError, match="Only tensors with 3, 4, or 5 dimensions"):
        init.dirac_(_weight(2, 2))
    with pytest.raises(ValueError, match="dim 0 must be divisible by groups"):
        init.dirac_(_weight(5, 2, 3), groups=2)


@pytest.mark.parametrize(
    ("shape", "groups"),
    [((4, 2, 3), 1), ((6, 3, 3, 3), 1), ((6, 2, 3, 4), 2), ((4, 4, 3, 3, 3), 2), ((2, 5, 1, 4), 1)],
    ids=str,
)
def test_dirac_matches_pytorch(reference_backend, shape, groups):
    torch = pytest.importorskip("torch")
    expected = torch.nn.init.dirac_(torch.empty(shape), groups=groups).numpy()
    np.testing.assert_array_equal(init.dirac_(_weight(*shape), groups=groups).numpy(), expected)


@pytest.mark.parametrize("shape", [(64, 64), (100, 30), (30, 100), (16, 8, 3, 3)], ids=str)
@pytest.mark.parametrize("gain", [1, 0.5])
def test_orthogonal_gives_orthonormal_rows_or_columns(reference_backend, shape, gain):
    fl.manual_seed(5)
    values = init.orthogonal_(_weight(*shape), gain=gain).numpy().reshape(shape[0], -1)
    rows, cols = values.shape
    gram = values.T @ values if rows >= cols else values @ values.T
    np.testing.assert_allclose(gram, gain**2 * np.eye(min(rows, cols)), atol=2e-6)


def test_orthogonal_is_haar_distributed_in_sign(reference_backend):
    """With the sign fix Q's diagonal is not biased positive (QR alone makes R's diagonal
    positive, which biases Q)."""
    fl.manual_seed(6)
    diagonals = [np.diag(init.orthogonal_(_weight(8, 8)).numpy()) for _ in range(200)]
    positive = (np.concatenate(diagonals) > 0).mean()
    assert 0.42 < positive < 0.58
    with pytest.raises(ValueError, match="Only tensors with 2 or more dimensions"):
        init.orthogonal_(_weight(5))


def test_sparse_zeros_the_same_number_in_every_column(reference_backend):
    fl.manual_seed(7)
    values = init.sparse_(_weight(200, 300), sparsity=0.3, std=0.5).numpy()
    zeros = (values == 0).sum(axis=0)
    np.testing.assert_array_equal(zeros, np.full(300, 60))
    kept = values[values != 0]
    _check_normal(kept, 0.0, 0.5)
    rows_zeroed = (values == 0).mean(axis=1)  # each row about equally often
    assert abs(rows_zeroed.mean() - 0.3) < 1e-9 and rows_zeroed.std() < 0.06
    with pytest.raises(ValueError, match="Only tensors with 2 dimensions are supported"):
        init.sparse_(_weight(2, 2, 2), 0.5)


def test_zero_element_kaiming_warns_and_does_nothing(reference_backend):
    weight = _weight(0, 4)
    with pytest.warns(UserWarning, match="Initializing zero-element tensors is a no-op"):
        assert init.kaiming_uniform_(weight) is weight
    with pytest.warns(UserWarning, match="zero-element"):
        assert init.kaiming_normal_(weight) is weight
    assert init.orthogonal_(weight) is weight


def test_half_tensors_keep_their_dtype(reference_backend):
    fl.manual_seed(8)
    for dtype in (fl.float16, fl.bfloat16, fl.float64):
        weight = fl.zeros(300, 300, dtype=dtype)
        init.kaiming_normal_(weight, nonlinearity="relu")
        init.trunc_normal_(weight, std=0.02, a=-0.04, b=0.04)
        assert weight.dtype is dtype
        values = weight.numpy().astype(np.float64)
        bound = float(fl.full((), 0.04, dtype=dtype).numpy())  # b as the dtype holds it
        assert abs(values.std() - 0.02 * 0.8796) < 0.002 and np.abs(values).max() <= bound


def test_not_a_tensor_is_refused():
    with pytest.raises(TypeError, match="uniform_: expected a flame.Tensor, got ndarray"):
        init.uniform_(np.zeros((2, 2)))


# --- reproducibility ---------------------------------------------------------------------------

INITIALISERS = {
    "uniform_": lambda w, g: init.uniform_(w, -1.0, 2.0, generator=g),
    "normal_": lambda w, g: init.normal_(w, 0.5, 2.0, generator=g),
    "trunc_normal_": lambda w, g: init.trunc_normal_(w, 0.0, 1.0, -1.0, 2.0, generator=g),
    "xavier_uniform_": lambda w, g: init.xavier_uniform_(w, generator=g),
    "xavier_normal_": lambda w, g: init.xavier_normal_(w, 2.0, generator=g),
    "kaiming_uniform_": lambda w, g: init.kaiming_uniform_(w, math.sqrt(5), generator=g),
    "kaiming_normal_": lambda w, g: init.kaiming_normal_(w, mode="fan_out", generator=g),
    "orthogonal_": lambda w, g: init.orthogonal_(w, 1.5, generator=g),
    "sparse_": lambda w, g: init.sparse_(w, 0.25, generator=g),
}


@pytest.mark.parametrize("name", list(INITIALISERS))
def test_a_seed_reproduces_and_the_generator_advances(backend, name):
    initialise = INITIALISERS[name]
    fl.manual_seed(11)
    first, second = (
        initialise(_weight(12, 9), None).numpy(),
        initialise(_weight(12, 9), None).numpy(),
    )
    assert not np.array_equal(first, second)
    fl.manual_seed(11)
    np.testing.assert_array_equal(initialise(_weight(12, 9), None).numpy(), first)
    generator = fl.Generator().manual_seed(11)
    np.testing.assert_array_equal(initialise(_weight(12, 9), generator).numpy(), first)
    np.testing.assert_array_equal(initialise(_weight(12, 9), generator).numpy(), second)


def test_an_own_generator_leaves_the_default_one_alone(backend):
    fl.manual_seed(12)
    expected = fl.rand(5).numpy()
    fl.manual_seed(12)
    init.kaiming_uniform_(_weight(64, 64), generator=fl.Generator().manual_seed(1))
    init.orthogonal_(_weight(8, 8), generator=fl.Generator().manual_seed(1))
    np.testing.assert_array_equal(fl.rand(5).numpy(), expected)


# --- where the values go -----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(INITIALISERS))
def test_writes_the_tensor_itself_and_through_views(backend, name):
    initialise = INITIALISERS[name]
    weight = _weight(12, 9)
    assert initialise(weight, None) is weight
    base = fl.tensor(np.full((4, 12, 9), 7.0, dtype=np.float32))
    view = base[2]
    assert initialise(view, None) is view
    values = base.numpy()
    np.testing.assert_array_equal(values[2], view.numpy())
    assert np.isfinite(values[2]).all() and not (values[2] == 7.0).all()
    np.testing.assert_array_equal(values[[0, 1, 3]], 7.0)  # the rest of the base untouched


def test_a_transposed_view_is_written_through(backend):
    base = fl.tensor(np.zeros((5, 3), dtype=np.float32))
    init.eye_(base.T)
    np.testing.assert_array_equal(base.numpy(), np.eye(3, 5).T)


@pytest.mark.parametrize(
    "make", [lambda: fl.empty(6, 4), lambda: fl.zeros(6, 4), lambda: fl.randn(6, 4),
             lambda: fl.full((6, 4), 3.0), _weight],
    ids=["empty", "zeros", "lazy-randn", "full", "realized"],
)  # fmt: skip
def test_a_parameter_that_requires_grad_stays_a_trainable_leaf(backend, make):
    weight = make() if make is not _weight else _weight(6, 4)
    weight.requires_grad_()
    assert init.kaiming_uniform_(weight, a=math.sqrt(5)) is weight
    assert weight.requires_grad
    values = weight.numpy()
    assert np.abs(values).max() <= 1 / math.sqrt(4) and len(np.unique(values)) == values.size
    (weight * weight).sum().backward()
    np.testing.assert_allclose(weight.grad.numpy(), 2 * values, rtol=1e-6)
    with pytest.raises(fl.inplace.InplaceError, match="leaf tensor that requires grad"):
        weight.uniform_()  # outside no_grad, still refused as PyTorch refuses it


def test_a_view_of_a_lazy_tensor_is_written_through(backend):
    base = fl.randn(3, 8) * 0 + 1  # lazy: the write gives it memory and writes through
    init.zeros_(base[1])
    np.testing.assert_array_equal(base.numpy(), np.array([[1.0] * 8, [0.0] * 8, [1.0] * 8]))


# --- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(INITIALISERS))
def test_cuda_gives_the_reference_numbers_for_the_same_seed(name):
    initialise = INITIALISERS[name]
    results = {}
    for backend_name in ("reference", "cuda"):
        with fl.backend(backend_name):
            weight = fl.empty(96, 80)
        # called outside the backend's context: the tensor's own backend is used
        fl.manual_seed(21)
        first = initialise(weight, None).numpy().copy()  # numpy() shares the memory
        generator = fl.Generator().manual_seed(22)
        second = initialise(weight, generator).numpy()
        results[backend_name] = (first, second)
        assert weight.backend == backend_name
    for reference, cuda in zip(results["reference"], results["cuda"]):
        np.testing.assert_allclose(cuda, reference, rtol=1e-5, atol=1e-6)
