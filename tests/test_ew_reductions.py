"""Reductions at PyTorch's edges (issue 18): empty axes give the identity or NaN (and the
max-like ones refuse), ``var``/``std`` with ``correction >= n`` give inf or NaN, 0-d tensors
reduce over ``dim`` 0 and -1, ``axis=`` is ``dim=``. Expected numbers are written in NumPy;
PyTorch is compared where importable. The same bodies run on the GPU in the ``gpu`` tier.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import flame as fl

pytestmark = pytest.mark.filterwarnings("ignore:.*degrees of freedom:UserWarning")  # PyTorch
NAN, INF = float("nan"), float("inf")


def current_line() -> int:
    return inspect.currentframe().f_back.f_lineno


def assert_same(actual, expected, what=""):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    np.testing.assert_allclose(
        actual.astype(np.float64), expected.astype(np.float64), rtol=1e-6, atol=1e-6,
        equal_nan=True, err_msg=what,
    )  # fmt: skip


# --- empty axes ---------------------------------------------------------------------------------

# name -> (the value over an empty axis, its dtype name for a float32 input)
EMPTY_IDENTITY = {
    "sum": (0.0, "float32"),
    "prod": (1.0, "float32"),
    "mean": (NAN, "float32"),
    "var": (NAN, "float32"),
    "std": (NAN, "float32"),
    "any": (False, "bool"),
    "all": (True, "bool"),
    "logsumexp": (-INF, "float32"),
}


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("name", sorted(EMPTY_IDENTITY))
def test_reduction_over_an_empty_axis(name, keepdim, backend):
    value, dtype_name = EMPTY_IDENTITY[name]
    x = fl.zeros(0, 3)
    result = getattr(fl, name)(x, 0, keepdim=keepdim)
    assert result.dtype.name == dtype_name
    expected = np.full((1, 3) if keepdim else (3,), value)
    assert_same(result.numpy(), expected, f"{name} over an empty axis")
    if name != "logsumexp":  # PyTorch's logsumexp needs dim
        whole = getattr(fl, name)(x)
        assert_same(whole.numpy(), np.array(value), f"{name} of an empty tensor")


def test_empty_reductions_match_torch(backend):
    torch = pytest.importorskip("torch")
    for name in EMPTY_IDENTITY:
        for shape, dim in (((0, 3), 0), ((2, 0), 1), ((2, 0, 3), (1, 2))):
            if name == "prod" and isinstance(dim, tuple):
                continue  # PyTorch's prod takes one dim
            expected = getattr(torch, name)(torch.zeros(shape), dim)
            result = getattr(fl, name)(fl.zeros(*shape), dim)
            assert str(expected.dtype).removeprefix("torch.") == result.dtype.name, name
            assert_same(result.numpy(), expected.numpy(), f"{name}{list(shape)} over {dim}")


@pytest.mark.parametrize("name", ["amax", "amin", "max", "min", "argmax", "argmin"])
def test_max_like_reductions_over_an_empty_axis_are_refused(name, reference_backend):
    x = fl.zeros(2, 0)
    with pytest.raises(IndexError) as caught:
        line = current_line() + 1
        getattr(fl, name)(x, 1)
    message = str(caught.value)
    for part in (name, "dim 1", "[2, 0]", f"[at test_ew_reductions.py:{line}]"):
        assert part in message, f"{part!r} not in {message!r}"
    with pytest.raises(RuntimeError, match=f"{name}.*empty"):
        getattr(fl, name)(x)
    other_axis = getattr(fl, name)(x, 0)  # over the other axis: nothing to refuse
    other_axis = other_axis.values if name in ("max", "min") else other_axis
    assert other_axis.shape == (0,)


def test_empty_reduction_gradients(reference_backend):
    x = fl.zeros(0, 3)
    for name in ("sum", "prod", "mean"):
        grad = fl.grad(lambda t, name=name: getattr(fl, name)(t, 0).sum())(x)
        assert grad.shape == (0, 3), name


# --- var and std with correction >= n -----------------------------------------------------------

SAMPLES = np.array([[1.0, 2.0, 4.0], [3.0, 3.0, 3.0]], np.float32)


@pytest.mark.parametrize("correction", [3, 4])
def test_var_std_with_correction_at_least_n(correction, backend):
    x = fl.tensor(SAMPLES)
    # the divisor is max(n - correction, 0) = 0: inf where the squares sum to more than 0
    assert_same(fl.var(x, 1, correction=correction).numpy(), [INF, NAN], "var")
    assert_same(fl.std(x, 1, correction=correction).numpy(), [INF, NAN], "std")
    assert_same(fl.var(x, correction=6 + correction).numpy(), np.array(INF), "var of all")
    assert_same(x.var(dim=0, correction=2).numpy(), [INF, INF, INF], "var over 2 rows")
    one = fl.tensor(np.array([5.0], np.float32))
    assert_same(fl.var(one).numpy(), np.array(NAN), "var of one element")


def test_var_std_with_large_correction_match_torch(backend):
    torch = pytest.importorskip("torch")
    for name in ("var", "std"):
        for dim, correction in ((1, 3), (1, 5), (None, 6), (0, 2), (1, 1)):
            expected = getattr(torch, name)(torch.tensor(SAMPLES), dim, correction=correction)
            result = getattr(fl, name)(fl.tensor(SAMPLES), dim, correction=correction)
            assert_same(result.numpy(), expected.numpy(), f"{name} dim={dim} c={correction}")


def test_var_gradient_with_correction_n_matches_torch(backend):
    """Over a dim with correction == n PyTorch's gradient is 2 (x - mean) / 0: signed inf,
    NaN where x is the mean."""
    x = fl.tensor(SAMPLES)
    grad = fl.grad(lambda t: fl.var(t, 1, correction=3).sum())(x)
    expected = np.array([[-INF, -INF, INF], [NAN, NAN, NAN]])
    assert_same(grad.numpy(), expected, "d var / dx")
    torch = pytest.importorskip("torch")
    t = torch.tensor(SAMPLES, requires_grad=True)
    torch.var(t, 1, correction=3).sum().backward()
    assert_same(grad.numpy(), t.grad.numpy(), "d var / dx vs torch")


# --- 0-d tensors over dim 0 and -1 --------------------------------------------------------------

REDUCTIONS = ["sum", "prod", "mean", "amax", "amin", "logsumexp", "any", "all", "var", "std"]


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("dim", [0, -1, (0,), [-1]], ids=str)
@pytest.mark.parametrize("name", REDUCTIONS)
def test_zero_d_reductions(name, dim, keepdim, backend):
    x = fl.tensor(np.float32(3.0))
    result = getattr(fl, name)(x, dim, keepdim=keepdim)
    assert result.shape == ()
    expected = {"any": True, "all": True, "var": NAN, "std": NAN}.get(name, 3.0)
    assert_same(result.numpy(), np.array(expected), f"{name}(0-d, {dim})")


def test_zero_d_indices_and_integers(backend):
    x = fl.tensor(np.float32(-2.0))
    for name in ("argmax", "argmin"):
        result = getattr(fl, name)(x, 0)
        assert (result.shape, result.dtype, int(result.numpy())) == ((), fl.int64, 0), name
    values, indices = fl.max(x, -1)
    assert (float(values.numpy()), int(indices.numpy())) == (-2.0, 0)
    integer = fl.tensor(np.int32(7))
    total = fl.sum(integer, 0)
    assert (total.dtype, int(total.numpy())) == (fl.int64, 7)


def test_zero_d_dim_out_of_range_is_an_index_error(reference_backend):
    x = fl.tensor(np.float32(3.0))
    with pytest.raises(IndexError, match="sum.*dim 1") as caught:
        line = current_line() + 1
        fl.sum(x, 1)
    assert f"[at test_ew_reductions.py:{line}]" in str(caught.value)


def test_zero_d_reductions_match_torch(backend):
    torch = pytest.importorskip("torch")
    for name in REDUCTIONS:
        for dim in (0, -1):
            expected = getattr(torch, name)(torch.tensor(3.0), dim)
            result = getattr(fl, name)(fl.tensor(np.float32(3.0)), dim)
            assert result.shape == tuple(expected.shape), name
            assert_same(result.numpy(), expected.numpy(), f"{name} dim={dim}")


def test_zero_d_gradients(reference_backend):
    x = fl.tensor(np.float32(3.0))
    for name in ("sum", "prod", "mean", "amax", "logsumexp"):
        grad = fl.grad(lambda t, name=name: getattr(fl, name)(t, 0))(x)
        assert (grad.shape, float(grad.numpy())) == ((), 1.0), name


# --- axis= as dim= --------------------------------------------------------------------------------

AXIS_NAMES = REDUCTIONS + ["argmax", "argmin"]


@pytest.mark.parametrize("name", AXIS_NAMES)
def test_axis_is_an_alias_of_dim(name, backend):
    array = np.arange(12, dtype=np.float32).reshape(3, 4) % 5
    x = fl.tensor(array)
    by_dim = getattr(fl, name)(x, dim=1, keepdim=True)
    by_axis = getattr(fl, name)(x, axis=1, keepdim=True)
    method = getattr(x, name)(axis=1, keepdim=True)
    assert by_axis.shape == by_dim.shape == method.shape == (3, 1), name
    np.testing.assert_array_equal(by_axis.numpy(), by_dim.numpy())
    np.testing.assert_array_equal(method.numpy(), by_dim.numpy())


def test_axis_alias_of_max_gives_values_and_indices(reference_backend):
    x = fl.tensor(np.array([[1.0, 5.0, 2.0], [7.0, 0.0, 7.0]], np.float32))
    values, indices = fl.max(x, axis=1)
    np.testing.assert_array_equal(values.numpy(), [5.0, 7.0])
    np.testing.assert_array_equal(indices.numpy(), [1, 0])


def test_dim_and_axis_together_are_refused(reference_backend):
    x = fl.tensor(np.ones((2, 3), np.float32))
    with pytest.raises(TypeError, match="sum.*both dim= and axis=") as caught:
        line = current_line() + 1
        fl.sum(x, 0, axis=1)
    assert f"[at test_ew_reductions.py:{line}]" in str(caught.value)


def test_std_gradient_is_zero_where_the_std_is(backend):
    # rows of 4: the mean (sum * 1/4) of the constant row is exact on every backend, so its
    # variance is exactly 0 (with sum * 1/3 the GPU leaves ~1e-14)
    samples = np.array([[1.0, 2.0, 4.0, 7.0], [3.0, 3.0, 3.0, 3.0]], np.float32)
    grad = fl.grad(lambda t: fl.std(t, 1).sum())(fl.tensor(samples)).numpy()
    np.testing.assert_array_equal(grad[1], [0.0, 0.0, 0.0, 0.0])
    deviation = samples[0] - samples[0].mean()
    expected = deviation / (3.0 * np.std(samples[0], ddof=1))
    assert_same(grad[0], expected, "d std / dx where it is not 0")
    torch = pytest.importorskip("torch")
    t = torch.tensor(samples, requires_grad=True)
    torch.std(t, 1).sum().backward()
    assert_same(grad, t.grad.numpy(), "d std / dx vs torch")
