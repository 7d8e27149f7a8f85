"""The elementwise ops issue 18 adds, beyond what the registry-driven tests check on random
samples (tests/test_ops.py, tests/test_autograd_ops.py): their spellings (``fl.name``,
``x.name()``, aliases), arguments (``nan_to_num``'s values, ``div``'s ``rounding_mode``,
``lerp``'s weight, ``value=``), dtype rules, and values and gradients at edges. Expected
numbers are written in NumPy; PyTorch is compared where importable. The same bodies run on the
GPU in the ``gpu`` tier.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import flame as fl

NAN, INF = float("nan"), float("inf")
UNARY_MATH = "erfinv exp2 log2 log10 asin acos atan sinh cosh tan asinh acosh atanh".split()


def current_line() -> int:
    return inspect.currentframe().f_back.f_lineno


def assert_same(actual, expected, what="", rtol=1e-6):
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), np.asarray(expected, np.float64), rtol=rtol,
        atol=1e-6, equal_nan=True, err_msg=what,
    )  # fmt: skip


def value_and_grads(function, arrays):
    tensors = [fl.tensor(np.asarray(array, np.float32)) for array in arrays]
    out, pullback = fl.vjp(function, *tensors)
    grads = pullback(fl.ones_like(out))
    return out.numpy(), [grad.numpy() for grad in grads]


def torch_value_and_grads(torch, function, arrays):
    tensors = [torch.tensor(np.asarray(array, np.float32), requires_grad=True) for array in arrays]
    out = function(*tensors)
    out.backward(torch.ones_like(out))
    return out.detach().numpy(), [tensor.grad.numpy() for tensor in tensors]


# --- spellings and dtype rules ------------------------------------------------------------------


@pytest.mark.parametrize("name", UNARY_MATH)
def test_unary_math_promotes_integers_to_float32(name, backend):
    array = np.array([0, 1], np.int64) if name != "acosh" else np.array([1, 2], np.int64)
    function = getattr(fl, name)
    result = function(fl.tensor(array))
    method = getattr(fl.tensor(array), name)()
    assert result.dtype is fl.float32 and method.dtype is fl.float32, name
    np.testing.assert_array_equal(result.numpy(), method.numpy())
    expected = function(fl.tensor(array.astype(np.float32))).numpy()
    assert_same(result.numpy(), expected, name)


def test_trunc_and_fix_keep_the_dtype(backend):
    floats = fl.tensor(np.array([-1.5, -0.5, 0.5, 2.7, -0.0], np.float32))
    np.testing.assert_array_equal(fl.trunc(floats).numpy(), [-1.0, -0.0, 0.0, 2.0, -0.0])
    np.testing.assert_array_equal(fl.fix(floats).numpy(), floats.trunc().numpy())
    integers = fl.tensor(np.array([-3, 4], np.int32))
    assert fl.trunc(integers).dtype is fl.int32
    np.testing.assert_array_equal(integers.fix().numpy(), [-3, 4])
    with pytest.raises(TypeError, match="trunc.*bool"):
        fl.trunc(fl.tensor(np.array([True])))


@pytest.mark.parametrize("dtype", [fl.float32, fl.float16, fl.int32, fl.int64, fl.bool_])
def test_predicates_give_bool(dtype, backend):
    values = np.array([NAN, INF, -INF, 1.0, 0.0]) if dtype.is_float else np.array([1, 0, 1])
    x = fl.tensor(values.astype(dtype.numpy))
    for name, test, integer_answer in (
        ("isnan", np.isnan, False),
        ("isinf", np.isinf, False),
        ("isfinite", np.isfinite, True),
    ):
        result = getattr(fl, name)(x)
        assert result.dtype is fl.bool_ and getattr(x, name)().dtype is fl.bool_, name
        expected = test(values) if dtype.is_float else np.full(values.shape, integer_answer)
        np.testing.assert_array_equal(result.numpy(), expected, err_msg=f"{name} {dtype.name}")


# --- nan_to_num ---------------------------------------------------------------------------------

SPECIALS = np.array([NAN, INF, -INF, 1.5, -0.0])


@pytest.mark.parametrize(
    "dtype, largest",
    [(fl.float32, 3.4028234663852886e38), (fl.float16, 65504.0), (fl.bfloat16, 3.3895e38)],
    ids=lambda value: getattr(value, "name", ""),
)
def test_nan_to_num_defaults_to_the_dtype_s_largest_value(dtype, largest, backend):
    result = fl.nan_to_num(fl.tensor(SPECIALS.astype(dtype.numpy))).numpy().astype(np.float64)
    assert_same(result, [0.0, largest, -largest, 1.5, 0.0], dtype.name, rtol=1e-3)
    assert np.isfinite(result).all()


def test_nan_to_num_takes_the_replacements(backend):
    x = fl.tensor(SPECIALS.astype(np.float32))
    result = x.nan_to_num(nan=7.0, posinf=1e3, neginf=-2.0)
    np.testing.assert_array_equal(result.numpy(), [7.0, 1e3, -2.0, 1.5, 0.0])
    partial = fl.nan_to_num(x, posinf=5.0)
    np.testing.assert_array_equal(partial.numpy()[:2], [0.0, 5.0])
    integers = fl.tensor(np.array([3, -4], np.int64))
    assert fl.nan_to_num(integers, nan=1.0).dtype is fl.int64


def test_nan_to_num_gradient_is_zero_where_not_finite(backend):
    _, (grad,) = value_and_grads(lambda x: fl.nan_to_num(x, nan=1.0), [SPECIALS])
    np.testing.assert_array_equal(grad, [0.0, 0.0, 0.0, 1.0, 1.0])


# --- div's rounding modes -----------------------------------------------------------------------

DIVIDENDS = np.array([-7, 7, -7, 7, -8, 0, 9])
DIVISORS = np.array([2, -2, -2, 2, 3, -3, 4])


@pytest.mark.parametrize("dtype", [fl.int32, fl.int64, fl.float32], ids=lambda d: d.name)
def test_div_rounding_modes(dtype, backend):
    a = fl.tensor(DIVIDENDS.astype(dtype.numpy))
    b = fl.tensor(DIVISORS.astype(dtype.numpy))
    trunc = fl.div(a, b, rounding_mode="trunc")
    floor = a.div(b, rounding_mode="floor")
    assert trunc.dtype is dtype and floor.dtype is dtype
    np.testing.assert_array_equal(trunc.numpy(), np.trunc(DIVIDENDS / DIVISORS))
    np.testing.assert_array_equal(floor.numpy(), np.floor_divide(DIVIDENDS, DIVISORS))
    true = fl.divide(a, b)
    assert true.dtype is fl.float32
    assert_same(true.numpy(), DIVIDENDS / DIVISORS)
    halves = fl.div(a, 2, rounding_mode="trunc").numpy()
    np.testing.assert_array_equal(halves, [-3, 3, -3, 3, -4, 0, 4])


def test_div_rounding_modes_match_torch(backend):
    torch = pytest.importorskip("torch")
    floats = [np.array([-7.5, 1.0, 5.0, -0.0, INF, 3.0]), np.array([2.0, 0.1, -0.0, 3.0, 2.0, 0.0])]
    for mode in ("trunc", "floor", None):
        for dtype in (np.float32, np.int64):
            arrays = floats if dtype == np.float32 else [DIVIDENDS, DIVISORS]
            operands = [torch.tensor(a.astype(dtype)) for a in arrays]
            expected = torch.div(*operands, rounding_mode=mode)
            result = fl.div(*(fl.tensor(a.astype(dtype)) for a in arrays), rounding_mode=mode)
            assert result.dtype.name == str(expected.dtype).removeprefix("torch."), mode
            assert_same(result.numpy(), expected.numpy(), f"div {mode} {dtype.__name__}")


def test_rounded_div_has_a_zero_gradient(backend):
    for mode in ("trunc", "floor"):
        _, grads = value_and_grads(
            lambda a, b, mode=mode: fl.div(a, b, rounding_mode=mode), [[3.0, -3.0], [2.0, 0.5]]
        )
        for grad in grads:
            np.testing.assert_array_equal(grad, [0.0, 0.0], err_msg=mode)


def test_div_with_an_unknown_rounding_mode_names_it(reference_backend):
    x = fl.tensor(np.ones(2, np.float32))
    with pytest.raises(ValueError, match="div: rounding_mode.*'round'") as caught:
        line = current_line() + 1
        fl.div(x, 2.0, rounding_mode="round")
    assert f"[at test_elementwise_more.py:{line}]" in str(caught.value)


# --- shifts -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [fl.int32, fl.int64], ids=lambda d: d.name)
def test_shifts_past_the_width_as_pytorch(dtype, backend):
    bits = 8 * dtype.numpy.itemsize
    a = fl.tensor(np.array([1, -1, 5, 1, 1, -5, 16]).astype(dtype.numpy))
    b = fl.tensor(np.array([2, 3, -1, bits - 1, bits, bits + 3, 2]).astype(dtype.numpy))
    left = fl.bitwise_left_shift(a, b)
    right = a.bitwise_right_shift(b)
    assert left.dtype is dtype and right.dtype is dtype
    lowest = np.iinfo(dtype.numpy).min
    np.testing.assert_array_equal(left.numpy(), [4, -8, 0, lowest, 0, 0, 64])
    np.testing.assert_array_equal(right.numpy(), [0, -1, 0, 0, 0, -1, 4])
    np.testing.assert_array_equal(fl.bitwise_left_shift(a, 1).numpy()[:3], [2, -2, 10])


def test_shifts_match_torch(backend):
    torch = pytest.importorskip("torch")
    for dtype in (np.int32, np.int64):
        a = np.array([1, -1, 5, 1, 1, -5, 16, 7, -9]).astype(dtype)
        b = np.array([2, 3, -1, 31, 32, 33, 63, 64, 1]).astype(dtype)
        for name in ("bitwise_left_shift", "bitwise_right_shift"):
            expected = getattr(torch, name)(torch.tensor(a), torch.tensor(b)).numpy()
            result = getattr(fl, name)(fl.tensor(a), fl.tensor(b)).numpy()
            np.testing.assert_array_equal(result, expected, err_msg=f"{name} {dtype.__name__}")


@pytest.mark.parametrize("dtype", [fl.float32, fl.bool_], ids=lambda d: d.name)
def test_shifts_refuse_floats_and_bools(dtype, reference_backend):
    x = fl.tensor(np.array([1, 0]).astype(dtype.numpy))
    with pytest.raises(TypeError, match=f"bitwise_left_shift.*{dtype.name}"):
        fl.bitwise_left_shift(x, x)


# --- lerp, addcmul, addcdiv ---------------------------------------------------------------------

START, END = np.array([1.0, -2.0, 0.5, 3.0]), np.array([3.0, 2.0, 0.5, -1.0])


@pytest.mark.parametrize("weight", [0.0, 0.25, 0.5, 1.0, 1.5, -0.5])
def test_lerp_with_a_scalar_weight(weight, backend):
    value, (grad_start, grad_end) = value_and_grads(
        lambda a, b: fl.lerp(a, b, weight), [START, END]
    )
    assert_same(value, START + weight * (END - START), f"lerp at {weight}")
    if weight == 1.0:
        np.testing.assert_array_equal(value, END.astype(np.float32))  # exact, as PyTorch
    assert_same(grad_start, np.full(4, 1.0 - weight))
    assert_same(grad_end, np.full(4, weight))


def test_lerp_with_a_tensor_weight_matches_torch(backend):
    weights = np.array([0.0, 0.3, 0.7, 1.0])
    value, grads = value_and_grads(lambda a, b, w: a.lerp(b, w), [START, END, weights])
    assert_same(value, START + weights * (END - START))
    assert_same(grads[2], END - START, "d lerp / d weight")
    torch = pytest.importorskip("torch")
    expected_value, expected_grads = torch_value_and_grads(torch, torch.lerp, [START, END, weights])
    assert_same(value, expected_value)
    for grad, expected in zip(grads, expected_grads, strict=True):
        assert_same(grad, expected)


def test_lerp_refuses_integers(reference_backend):
    integers = fl.tensor(np.array([1, 2], np.int64))
    with pytest.raises(TypeError, match="lerp.*int64"):
        fl.lerp(integers, integers, 0.5)


def test_addcmul_and_addcdiv(backend):
    base, first, second = START, END, np.array([2.0, -4.0, 0.5, 8.0])
    arrays = [base, first, second]
    value, grads = value_and_grads(lambda x, a, b: fl.addcmul(x, a, b, value=0.5), arrays)
    assert_same(value, base + 0.5 * first * second)
    assert_same(grads[1], 0.5 * second)
    assert_same(grads[2], 0.5 * first)
    value, grads = value_and_grads(lambda x, a, b: x.addcdiv(a, b, value=-2.0), arrays)
    assert_same(value, base - 2.0 * first / second)
    assert_same(grads[2], 2.0 * first / second**2)
    integers = fl.tensor(np.array([2, 3], np.int64))
    assert fl.addcmul(integers, integers, integers, value=2).dtype is fl.int64
    with pytest.raises(RuntimeError, match="addcdiv.*integer division"):
        fl.addcdiv(integers, integers, integers)


def test_atan2_gradient_is_zero_at_the_origin(backend):
    _, grads = value_and_grads(fl.atan2, [[0.0, 1.0], [0.0, 1.0]])
    np.testing.assert_array_equal(grads[0], [0.0, 0.5])
    np.testing.assert_array_equal(grads[1], [0.0, -0.5])


# --- values and gradients at edges, against PyTorch ---------------------------------------------

EDGE_CASES = {  # name: (arrays, what the edges are)
    "copysign": ([[0.0, -0.0, 2.0, -3.0, INF], [-1.0, 1.0, -0.0, NAN, -2.0]], "signed zeros"),
    "atan2": ([[0.0, 1.0, -1.0, 0.0, -0.0], [0.0, -1.0, -1.0, -2.0, -1.0]], "origin, quadrants"),
    "logaddexp": ([[-INF, INF, 0.0, -INF, 80.0], [-INF, INF, 0.0, 1.0, -80.0]], "infinities"),
    "fmod": ([[-7.0, 7.0, -0.0, 5.0, -5.0], [2.0, -2.0, 2.0, INF, 3.0]], "negative operands"),
    "remainder": ([[-7.0, 7.0, 5.5, -5.0, 1.0], [2.0, -2.0, -2.0, 3.0, 0.3]], "negative operands"),
    "erfinv": ([[-1.0, 1.0, 0.0, 0.999, -0.5]], "at and near +-1"),
    "atanh": ([[-1.0, 1.0, 0.0, 0.5, -0.99]], "at +-1"),
    "acosh": ([[1.0, 1.5, 10.0, 2.0, 3.0]], "at 1"),
    "asin": ([[-1.0, 1.0, 0.0, 0.5, -0.3]], "at +-1"),
    "exp2": ([[-INF, INF, 0.0, 10.0, -3.5]], "infinities"),
    "log2": ([[0.0, INF, 1.0, 8.0, -1.0]], "0 and negative"),
    "trunc": ([[-1.5, 2.5, -0.0, INF, NAN]], "signed zero, specials"),
}


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_edges_match_torch(name, backend):
    torch = pytest.importorskip("torch")
    arrays, what = EDGE_CASES[name]
    expected_value, expected_grads = torch_value_and_grads(torch, getattr(torch, name), arrays)
    value, grads = value_and_grads(getattr(fl, name), arrays)
    assert_same(value, expected_value, f"{name} ({what})", rtol=1e-5)
    for position, (grad, expected) in enumerate(zip(grads, expected_grads, strict=True)):
        assert_same(grad, expected, f"d {name} / d input {position} ({what})", rtol=1e-5)


def test_shift_operators(backend):
    x = fl.tensor(np.array([1, -8, 5], np.int64))
    np.testing.assert_array_equal((x << 2).numpy(), [4, -32, 20])
    np.testing.assert_array_equal((x >> 1).numpy(), [0, -4, 2])
    np.testing.assert_array_equal((1 << fl.tensor(np.array([0, 3], np.int32))).numpy(), [1, 8])
    np.testing.assert_array_equal((64 >> fl.tensor(np.array([1, 70], np.int64))).numpy(), [32, 0])


def test_square_as_pytorch():
    """``fl.square``, ``x.square()`` and ``x.square_()``: values, gradient, integer dtype kept."""
    with fl.backend("reference"):
        x = fl.tensor(np.array([1.5, -2.0, 0.0], np.float32), requires_grad=True)
        y = fl.square(x)
        np.testing.assert_allclose(y.numpy(), [2.25, 4.0, 0.0])
        np.testing.assert_allclose(x.square().numpy(), y.numpy())
        y.sum().backward()
        np.testing.assert_allclose(x.grad.numpy(), [3.0, -4.0, 0.0])
        z = fl.tensor(np.array([2, -3]))
        z.square_()
        assert z.dtype is fl.int64
        np.testing.assert_array_equal(z.numpy(), [4, 9])
