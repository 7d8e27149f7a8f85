"""Edge values where FLAME must give PyTorch's numbers, forward and backward (issue 18):
``prod`` at zeros, ``clamp`` at its bounds, ``pow`` at zero and negative bases, reductions
over empty axes and of 0-d tensors, ``var``/``std`` with ``correction >= n``, integer tensors
to negative powers, ``axis=``.

Every case states its expected numbers in NumPy (so it runs without PyTorch) and, where
PyTorch is importable, is also compared with PyTorch. The same bodies run on the reference
backend (CPU tier) and on the GPU (``gpu`` tier).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import flame as fl

NAN, INF = float("nan"), float("inf")


def current_line() -> int:
    return inspect.currentframe().f_back.f_lineno


def value_and_grads(function, arrays, cotangent=None):
    """``function`` over tensors of ``arrays`` and its cotangents for every input (for a
    cotangent of ones unless given), as NumPy arrays."""
    tensors = [fl.tensor(np.asarray(array, np.float32)) for array in arrays]
    out, pullback = fl.vjp(function, *tensors)
    seed = np.ones(out.shape, np.float32) if cotangent is None else cotangent
    grads = pullback(fl.tensor(seed))
    return out.numpy(), [grad.numpy() for grad in grads]


def torch_value_and_grads(function, arrays, cotangent=None):
    torch = pytest.importorskip("torch")
    tensors = [torch.tensor(np.asarray(array, np.float32), requires_grad=True) for array in arrays]
    out = function(*tensors)
    seed = torch.ones_like(out) if cotangent is None else torch.tensor(cotangent)
    out.backward(seed)
    return out.detach().numpy(), [tensor.grad.numpy() for tensor in tensors]


def assert_same(actual, expected, what):
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), np.asarray(expected, np.float64), rtol=1e-6, atol=1e-6,
        equal_nan=True, err_msg=what,
    )  # fmt: skip


# --- prod at zeros ------------------------------------------------------------------------------

PROD_INPUT = np.array([[1.0, 0.0, 3.0], [0.0, 0.0, 2.0], [2.0, 3.0, 4.0], [0.0, -2.0, 5.0]])


def prod_of_others(array: np.ndarray, axes) -> np.ndarray:
    """d prod / d x_i = the product of the other elements of x_i's slice (NumPy, by hand)."""
    grad = np.zeros_like(array)
    for index in np.ndindex(array.shape):
        mask = np.ones(array.shape, bool)
        for axis in range(array.ndim):
            if axis not in axes:
                keep = np.zeros(array.shape[axis], bool)
                keep[index[axis]] = True
                shape = [1] * array.ndim
                shape[axis] = -1
                mask &= keep.reshape(shape)
        mask[index] = False
        grad[index] = np.prod(array[mask])
    return grad


@pytest.mark.parametrize("dim", [None, 0, 1, (0, 1), -1], ids=str)
def test_prod_gradient_at_zeros_is_the_product_of_the_others(dim, backend):
    axes = tuple(range(2)) if dim is None else tuple(np.atleast_1d(dim) % 2)
    value, (grad,) = value_and_grads(lambda x: fl.prod(x, dim), [PROD_INPUT])
    np.testing.assert_array_equal(value, np.prod(PROD_INPUT, axis=dim))
    expected = prod_of_others(PROD_INPUT, axes)
    assert_same(grad, expected, f"prod over {dim}")
    assert not np.isnan(grad).any()


def test_prod_gradient_matches_torch(backend):
    torch = pytest.importorskip("torch")
    for dim in (None, 0, 1):
        flame_fn = fl.prod if dim is None else (lambda x, dim=dim: fl.prod(x, dim))
        torch_fn = torch.prod if dim is None else (lambda x, dim=dim: torch.prod(x, dim))
        expected = torch_value_and_grads(torch_fn, [PROD_INPUT])
        actual = value_and_grads(flame_fn, [PROD_INPUT])
        assert_same(actual[0], expected[0], f"prod value over {dim}")
        assert_same(actual[1][0], expected[1][0], f"prod grad over {dim}")


def test_prod_backward_accumulates_into_grad(backend):
    x = fl.tensor(np.array([2.0, 0.0, 5.0], np.float32)).requires_grad_()
    fl.prod(x).backward()
    np.testing.assert_array_equal(x.grad.numpy(), [0.0, 10.0, 0.0])


# --- clamp at its bounds ------------------------------------------------------------------------

CLAMP_X = np.array([1.0, 0.0, 3.0, NAN, -1.0, 4.0])


@pytest.mark.parametrize(
    "spelling",
    [
        lambda x: fl.clamp(x, 0.0, 3.0),
        lambda x: fl.clip(x, 0.0, 3.0),
        lambda x: x.clamp(0.0, 3.0),
        lambda x: x.clip(min=0.0, max=3.0),
    ],
    ids=["fl.clamp", "fl.clip", "Tensor.clamp", "Tensor.clip"],
)
def test_clamp_gradient_passes_at_the_bounds(spelling, backend):
    value, (grad,) = value_and_grads(spelling, [CLAMP_X])
    assert_same(value, [1.0, 0.0, 3.0, NAN, 0.0, 3.0], "clamp value")
    np.testing.assert_array_equal(grad, [1.0, 1.0, 1.0, 0.0, 0.0, 0.0])  # NaN: 0


def test_clamp_with_one_bound_passes_at_the_bound(backend):
    _, (low_grad,) = value_and_grads(lambda x: fl.clamp(x, min=0.0), [CLAMP_X])
    _, (high_grad,) = value_and_grads(lambda x: x.clamp(max=3.0), [CLAMP_X])
    np.testing.assert_array_equal(low_grad, [1.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    np.testing.assert_array_equal(high_grad, [1.0, 1.0, 1.0, 0.0, 1.0, 0.0])


# x, min, max: inside, at min, at max, NaN x, below, above, min > max, NaN min
TENSOR_BOUNDS = [
    [1.0, 0.0, 3.0, NAN, -1.0, 4.0, 2.0, 1.0],
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0, NAN],
    [3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 1.0, 2.0],
]


def test_clamp_with_tensor_bounds_gives_each_its_gradient(backend):
    value, grads = value_and_grads(fl.clamp, TENSOR_BOUNDS)
    assert_same(value, [1.0, 0.0, 3.0, NAN, 0.0, 3.0, 1.0, NAN], "clamp value")
    np.testing.assert_array_equal(grads[0], [1, 1, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(grads[1], [0, 0, 0, 0, 1, 0, 0, 0])
    np.testing.assert_array_equal(grads[2], [0, 0, 0, 0, 0, 1, 1, 0])


def test_clamp_gradients_match_torch(backend):
    torch = pytest.importorskip("torch")
    cases = [
        (fl.clamp, torch.clamp, TENSOR_BOUNDS),
        (fl.clamp_min, torch.clamp_min, TENSOR_BOUNDS[:2]),
        (fl.clamp_max, torch.clamp_max, [TENSOR_BOUNDS[0], TENSOR_BOUNDS[2]]),
        (lambda x: x.clamp(0.0, 3.0), lambda x: x.clamp(0.0, 3.0), [CLAMP_X]),
    ]
    for flame_fn, torch_fn, arrays in cases:
        expected_value, expected_grads = torch_value_and_grads(torch_fn, arrays)
        value, grads = value_and_grads(flame_fn, arrays)
        assert_same(value, expected_value, f"{torch_fn} value")
        for position, (grad, expected) in enumerate(zip(grads, expected_grads, strict=True)):
            assert_same(grad, expected, f"{torch_fn} grad {position}")


def test_clamp_without_bounds_names_the_op_and_line(reference_backend):
    x = fl.tensor(np.ones(3, np.float32))
    with pytest.raises(ValueError, match="clamp") as caught:
        line = current_line() + 1
        fl.clamp(x)
    assert f"[at test_edges.py:{line}]" in str(caught.value)


# --- pow at zero and negative bases -------------------------------------------------------------

BASES = np.array([0.0, -2.0, 2.0, 0.0, -1.0])
INTEGER_EXPONENTS = [0.0, 1.0, 2.0, 3.0, -1.0, -2.0]


def expected_pow_grads(base, exponent):
    """PyTorch's rules, in NumPy: the base's gradient is 0 for a zero exponent, else
    e * x^(e-1); the exponent's is 0 at a zero base with e >= 0, else x^e * log(x)."""
    with np.errstate(all="ignore"):
        out = np.power(base, exponent)
        base_grad = np.where(exponent == 0, 0.0, exponent * np.power(base, exponent - 1))
        exponent_grad = np.where((base == 0) & (exponent >= 0), 0.0, out * np.log(base))
    return out, base_grad, exponent_grad


@pytest.mark.parametrize("exponent", INTEGER_EXPONENTS, ids=str)
def test_pow_tensor_scalar_gradient(exponent, backend):
    value, (grad,) = value_and_grads(lambda x: x**exponent, [BASES])
    out, base_grad, _ = expected_pow_grads(BASES, exponent)
    assert_same(value, out, f"x ** {exponent}")
    assert_same(grad, base_grad, f"d(x ** {exponent})/dx")
    _, (method_grad,) = value_and_grads(lambda x: fl.pow(x, exponent), [BASES])
    assert_same(method_grad, base_grad, f"d fl.pow(x, {exponent})/dx")


@pytest.mark.parametrize("exponent", INTEGER_EXPONENTS, ids=str)
def test_pow_tensor_tensor_gradients(exponent, backend):
    exponents = np.full(BASES.shape, exponent)
    value, (base_grad, exponent_grad) = value_and_grads(lambda x, y: x**y, [BASES, exponents])
    out, expected_base, expected_exponent = expected_pow_grads(BASES, exponents)
    assert_same(value, out, f"x ** {exponent}")
    assert_same(base_grad, expected_base, f"d(x ** y)/dx at y={exponent}")
    assert_same(exponent_grad, expected_exponent, f"d(x ** y)/dy at y={exponent}")


@pytest.mark.parametrize("base", [0.0, -2.0, 2.0, 1.0], ids=str)
def test_pow_scalar_tensor_gradient(base, backend):
    exponents = np.array([0.0, 1.0, -1.0, 2.0, 0.5])
    value, (grad,) = value_and_grads(lambda y: base**y, [exponents])
    out, _, expected = expected_pow_grads(np.full(exponents.shape, base), exponents)
    assert_same(value, out, f"{base} ** y")
    assert_same(grad, expected, f"d({base} ** y)/dy")


def test_pow_gradients_match_torch(backend):
    pytest.importorskip("torch")
    for exponent in INTEGER_EXPONENTS + [0.5]:
        exponents = np.full(BASES.shape, exponent)
        pairs = [
            (lambda x, e=exponent: x**e, [BASES]),
            (lambda x, y: x**y, [BASES, exponents]),
            (lambda y, e=exponent: e**y, [exponents * 0.5 + 1.0]),
            (lambda y: 0.0**y, [np.array([0.0, 1.0, -1.0, 2.0])]),
            (lambda y: (-2.0) ** y, [np.array([0.0, 1.0, -1.0, 2.0])]),
        ]
        for function, arrays in pairs:  # the same lambdas run in both libraries
            expected_value, expected_grads = torch_value_and_grads(function, arrays)
            value, grads = value_and_grads(function, arrays)
            what = f"{inspect.getsource(function).strip()} at exponent {exponent}"
            assert_same(value, expected_value, what)
            for grad, expected in zip(grads, expected_grads, strict=True):
                assert_same(grad, expected, what)


# --- integer tensors to negative integer powers -------------------------------------------------


@pytest.mark.parametrize("dtype", [fl.int32, fl.int64, fl.bool_], ids=lambda d: d.name)
@pytest.mark.parametrize(
    "spelling",
    [lambda x: x**-1, lambda x: fl.pow(x, -2), lambda x: x.pow(-1), lambda x: x ** np.int64(-3)],
    ids=["operator", "fl.pow", "Tensor.pow", "numpy-exponent"],
)
def test_integer_tensor_to_negative_integer_power_is_refused(spelling, dtype, reference_backend):
    x = fl.tensor(np.array([2, 3, 1]).astype(dtype.numpy))
    with pytest.raises(RuntimeError, match="Integers to negative integer powers") as caught:
        spelling(x)
    line = spelling.__code__.co_firstlineno  # the user's line is the one that wrote ``**``
    message = str(caught.value)
    assert "pow" in message and dtype.name in message and "[3]" in message, message
    assert message.endswith(f"[at test_edges.py:{line}]"), message
    np.testing.assert_array_equal(x.numpy(), np.array([2, 3, 1]).astype(dtype.numpy))


def test_integer_powers_that_pytorch_allows(reference_backend):
    x = fl.tensor(np.array([2, 3, -1, 1], np.int64))
    np.testing.assert_array_equal((x**2).numpy(), [4, 9, 1, 1])
    np.testing.assert_allclose((x**-1.0).numpy(), [0.5, 1 / 3, -1.0, 1.0], rtol=1e-6)
    exponent = fl.tensor(np.array([-1, 1, -3, -2], np.int64))  # a tensor exponent: as C
    np.testing.assert_array_equal((x**exponent).numpy(), [0, 3, -1, 1])
    np.testing.assert_array_equal((2**exponent).numpy(), [0, 2, 0, 0])


# --- remainder with negative operands (Python's sign rule, as PyTorch) --------------------------


@pytest.mark.parametrize("dtype", [fl.int32, fl.int64, fl.float32], ids=lambda d: d.name)
def test_remainder_takes_the_divisor_sign(dtype, backend):
    a = np.array([-7, 7, -7, 7, -8, 0]).astype(dtype.numpy)
    b = np.array([2, -2, -2, 2, 3, -3]).astype(dtype.numpy)
    expected = np.array([1, -1, -1, 1, 1, 0])
    result = fl.remainder(fl.tensor(a), fl.tensor(b))
    np.testing.assert_array_equal(result.numpy(), expected)
    np.testing.assert_array_equal((fl.tensor(a) % fl.tensor(b)).numpy(), expected)
    try:
        import torch
    except ImportError:
        return
    np.testing.assert_array_equal(
        result.numpy(), torch.remainder(torch.tensor(a), torch.tensor(b)).numpy()
    )
