"""PyTorch tensor methods and functions FLAME lacked (flame/rearranging.py, and additions to
flame/functional.py, flame/reductions.py, flame/linalg.py, flame/indexing.py): values
against NumPy and gradients against float64 central differences (both run without
PyTorch), values, dtypes and gradients against PyTorch where it is importable, the errors
bad input raises when the op is built, and a few of them under ``fl.compile``."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from gradcheck import check_against_finite_differences, check_against_torch
from opinfo import assert_compiled_matches_lazy, assert_user_error, compile_plan_kernels

import flame as fl

HERE = "test_tensor_api_gaps.py"


def torch_module():
    return pytest.importorskip("torch", reason="PyTorch is the reference for these checks")


# --- inputs ---------------------------------------------------------------------------------


def normal(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def unit(rng, shape):
    """Inside (0, 1), away from the ends: logit's domain."""
    return rng.uniform(0.04, 0.96, shape).astype(np.float32)


def spread(rng, shape):
    """Away from integers (frac's jumps): k + u with u in [0.1, 0.9]."""
    whole = rng.integers(-3, 3, shape)
    return (whole + rng.uniform(0.1, 0.9, shape)).astype(np.float32)


def indices(values):
    return lambda rng, shape: np.asarray(values, dtype=np.int64)


def _np_cross(a, b, axis):
    return np.cross(a, b, axis=axis)


def _np_std_mean(a, axis=None, ddof=1, keepdims=False):
    return a.std(axis=axis, ddof=ddof, keepdims=keepdims), a.mean(axis=axis, keepdims=keepdims)


def _np_index_add(target, axis, index, source, alpha=1):
    out = target.astype(np.float64).copy()
    moved, source = np.moveaxis(out, axis, 0), np.moveaxis(source, axis, 0)
    for position, row in zip(index, source):
        moved[position] += alpha * row
    return out


# (id, flame builder, NumPy reference (None: PyTorch only), PyTorch spelling, inputs as
# (shape, sampler), the positions differentiated). Each builder returns one tensor.
CASES = [
    ("t", lambda x: x.t(), lambda a: a.T, lambda x: x.t(), [((3, 4), normal)], [0]),
    ("t_fn_1d", lambda x: fl.t(x) * 2, lambda a: a * 2, lambda x: x.t() * 2,
     [((5,), normal)], [0]),
    ("swapaxes", lambda x: x.swapaxes(0, -1), lambda a: np.swapaxes(a, 0, -1),
     lambda x: x.swapaxes(0, -1), [((2, 3, 4), normal)], [0]),
    ("swapaxes_fn", lambda x: fl.swapaxes(x, axis0=2, axis1=1), lambda a: np.swapaxes(a, 2, 1),
     lambda x: x.swapaxes(2, 1), [((2, 3, 4), normal)], [0]),
    ("swapdims", lambda x: x.swapdims(-3, 1), lambda a: np.swapaxes(a, 0, 1),
     lambda x: x.swapdims(-3, 1), [((2, 3, 4), normal)], [0]),
    ("swapdims_fn", lambda x: fl.swapdims(x, dim0=0, dim1=2), lambda a: np.swapaxes(a, 0, 2),
     lambda x: x.swapdims(0, 2), [((2, 3, 4), normal)], [0]),
    ("adjoint", lambda x: x.adjoint(), lambda a: np.swapaxes(a, -1, -2),
     lambda x: x.adjoint(), [((2, 3, 4), normal)], [0]),
    ("adjoint_fn", lambda x: fl.adjoint(x) * 2, lambda a: a.T * 2, lambda x: x.adjoint() * 2,
     [((3, 5), normal)], [0]),
    ("ravel_of_view", lambda x: x.mT.ravel(), lambda a: a.T.ravel(), lambda x: x.mT.ravel(),
     [((3, 4), normal)], [0]),
    ("view_as", lambda x: x.view_as(fl.zeros(6, 2)), lambda a: a.reshape(6, 2),
     lambda x: x.view_as(x.new_zeros(6, 2)), [((3, 4), normal)], [0]),
    ("expand_as", lambda x: x.expand_as(fl.zeros(2, 3, 4)),
     lambda a: np.broadcast_to(a, (2, 3, 4)), lambda x: x.expand_as(x.new_zeros(2, 3, 4)),
     [((3, 1), normal)], [0]),
    ("reshape_as", lambda x: x.mT.reshape_as(fl.zeros(12)), lambda a: a.T.reshape(12),
     lambda x: x.mT.reshape_as(x.new_zeros(12)), [((3, 4), normal)], [0]),
    ("tile", lambda x: x.tile(2, 1, 3), lambda a: np.tile(a, (2, 1, 3)),
     lambda x: x.tile(2, 1, 3), [((2, 3), normal)], [0]),
    ("tile_fewer_dims", lambda x: fl.tile(x, (2,)), lambda a: np.tile(a, (1, 2)),
     lambda x: x.tile((2,)), [((2, 3), normal)], [0]),
    ("tile_tuple", lambda x: x.tile((2, 2)), lambda a: np.tile(a, (2, 2)),
     lambda x: x.tile((2, 2)), [((3,), normal)], [0]),
    ("addmm", lambda i, a, b: fl.addmm(i, a, b), lambda i, a, b: i + a @ b,
     lambda i, a, b: i.addmm(a, b), [((4, 5), normal), ((4, 3), normal), ((3, 5), normal)],
     [0, 1, 2]),
    ("addmm_scaled_broadcast", lambda i, a, b: fl.addmm(i, a, b, beta=0.5, alpha=-2),
     lambda i, a, b: 0.5 * i - 2 * (a @ b), lambda i, a, b: i.addmm(a, b, beta=0.5, alpha=-2),
     [((5,), normal), ((4, 3), normal), ((3, 5), normal)], [0, 1, 2]),
    ("addmm_method", lambda i, a, b: i.addmm(a, b, alpha=3), lambda i, a, b: i + 3 * (a @ b),
     lambda i, a, b: i.addmm(a, b, alpha=3),
     [((4, 1), normal), ((4, 2), normal), ((2, 3), normal)], [0, 1, 2]),
    ("baddbmm", lambda i, a, b: fl.baddbmm(i, a, b, beta=0.25, alpha=1.5),
     lambda i, a, b: 0.25 * i + 1.5 * (a @ b),
     lambda i, a, b: i.baddbmm(a, b, beta=0.25, alpha=1.5),
     [((2, 4, 5), normal), ((2, 4, 3), normal), ((2, 3, 5), normal)], [0, 1, 2]),
    ("baddbmm_broadcast", lambda i, a, b: i.baddbmm(a, b), lambda i, a, b: i + a @ b,
     lambda i, a, b: i.baddbmm(a, b),
     [((4, 1), normal), ((3, 4, 2), normal), ((3, 2, 5), normal)], [0, 1, 2]),
    ("hypot", lambda a, b: fl.hypot(a, b), np.hypot, lambda a, b: a.hypot(b),
     [((3, 4), normal), ((3, 4), normal)], [0, 1]),
    ("hypot_broadcast", lambda a, b: a.hypot(b), np.hypot, lambda a, b: a.hypot(b),
     [((3, 4), normal), ((4,), normal)], [0, 1]),
    ("logit", lambda x: fl.logit(x), lambda a: np.log(a / (1 - a)), lambda x: x.logit(),
     [((3, 4), unit)], [0]),
    ("logit_eps", lambda x: x.logit(eps=0.2),
     lambda a: np.log(np.clip(a, 0.2, 0.8) / (1 - np.clip(a, 0.2, 0.8))),
     lambda x: x.logit(eps=0.2), [((4, 5), unit)], [0]),
    ("frac", lambda x: fl.frac(x), lambda a: a - np.trunc(a), lambda x: x.frac(),
     [((3, 4), spread)], [0]),
    ("sgn_times", lambda x: x.sgn() * x, lambda a: np.sign(a) * a, lambda x: x.sgn() * x,
     [((3, 4), normal)], [0]),
    ("aminmax", lambda x: _joined(fl.aminmax(x)), lambda a: a.min() * 2 + a.max(),
     lambda x: _joined(x.aminmax()), [((3, 4), normal)], [0]),
    ("aminmax_dim_keepdim", lambda x: _joined(x.aminmax(dim=-1, keepdim=True)),
     lambda a: a.min(-1, keepdims=True) * 2 + a.max(-1, keepdims=True),
     lambda x: _joined(x.aminmax(dim=-1, keepdim=True)), [((3, 4), normal)], [0]),
    ("std_mean", lambda x: _joined(fl.std_mean(x, 1)),
     lambda a: _joined(_np_std_mean(a, 1)), lambda x: _joined(_torch().std_mean(x, 1)),
     [((3, 4), normal)], [0]),
    ("std_mean_correction", lambda x: _joined(fl.std_mean(x, (0, 2), correction=0, keepdim=True)),
     lambda a: _joined(_np_std_mean(a, (0, 2), 0, True)),
     lambda x: _joined(_torch().std_mean(x, (0, 2), correction=0, keepdim=True)),
     [((2, 3, 4), normal)], [0]),
    ("std_mean_unbiased_args", lambda x: _joined(fl.std_mean(x, -1, False, True)),
     lambda a: _joined(_np_std_mean(a, -1, 0, True)),
     lambda x: _joined(_torch().std_mean(x, -1, False, True)), [((3, 4), normal)], [0]),
    ("std_mean_all", lambda x: _joined(fl.std_mean(x)), lambda a: _joined(_np_std_mean(a)),
     lambda x: _joined(_torch().std_mean(x)), [((3, 4), normal)], [0]),
    ("var_mean", lambda x: _joined(fl.var_mean(x, 0)),
     lambda a: a.var(0, ddof=1) * 2 + a.mean(0), lambda x: _joined(_torch().var_mean(x, 0)),
     [((4, 3), normal)], [0]),
    ("var_mean_correction", lambda x: _joined(fl.var_mean(x, dim=1, correction=2)),
     lambda a: a.var(1, ddof=2) * 2 + a.mean(1),
     lambda x: _joined(_torch().var_mean(x, dim=1, correction=2)), [((3, 5), normal)], [0]),
    ("var_mean_unbiased_only", lambda x: _joined(fl.var_mean(x, False)),
     lambda a: a.var() * 2 + a.mean(), lambda x: _joined(_torch().var_mean(x, False)),
     [((3, 5), normal)], [0]),
    ("diff", lambda x: fl.diff(x), lambda a: np.diff(a), lambda x: x.diff(),
     [((3, 5), normal)], [0]),
    ("diff_n2_dim0", lambda x: x.diff(2, 0), lambda a: np.diff(a, 2, 0),
     lambda x: x.diff(2, 0), [((5, 3), normal)], [0]),
    ("diff_prepend_append", lambda x, p, q: fl.diff(x, dim=-1, prepend=p, append=q),
     lambda a, p, q: np.diff(a, axis=-1, prepend=p, append=q),
     lambda x, p, q: x.diff(dim=-1, prepend=p, append=q),
     [((3, 4), normal), ((3, 2), normal), ((3, 1), normal)], [0, 1, 2]),
    ("diff_n3_append", lambda x, q: x.diff(n=3, dim=0, append=q),
     lambda a, q: np.diff(a, 3, 0, append=q), lambda x, q: x.diff(n=3, dim=0, append=q),
     [((3, 2), normal), ((2, 2), normal)], [0, 1]),
    ("rot90", lambda x: x.rot90(), lambda a: np.rot90(a), lambda x: x.rot90(),
     [((3, 4), normal)], [0]),
    ("rot90_negative", lambda x: fl.rot90(x, -1, (1, 2)), lambda a: np.rot90(a, -1, (1, 2)),
     lambda x: x.rot90(-1, (1, 2)), [((2, 3, 4), normal)], [0]),
    ("rot90_k2_negative_dim", lambda x: x.rot90(2, [-1, 0]), lambda a: np.rot90(a, 2, (-1, 0)),
     lambda x: x.rot90(2, [-1, 0]), [((3, 4), normal)], [0]),
    ("rot90_k3", lambda x: x.rot90(3), lambda a: np.rot90(a, 3), lambda x: x.rot90(3),
     [((3, 4), normal)], [0]),
    ("rot90_k_minus_6", lambda x: x.rot90(-6, (0, 2)), lambda a: np.rot90(a, -6, (0, 2)),
     lambda x: x.rot90(-6, (0, 2)), [((2, 3, 4), normal)], [0]),
    ("rot90_k4", lambda x: x.rot90(4), lambda a: a.copy(), lambda x: x.rot90(4),
     [((3, 4), normal)], [0]),
    ("cross", lambda a, b: fl.cross(a, b, dim=1), lambda a, b: _np_cross(a, b, 1),
     lambda a, b: a.cross(b, dim=1), [((4, 3), normal), ((4, 3), normal)], [0, 1]),
    ("cross_broadcast_negative_dim", lambda a, b: a.cross(b, dim=-2),
     lambda a, b: _np_cross(a, b, -2), lambda a, b: a.cross(b, dim=-2),
     [((2, 3, 5), normal), ((1, 3, 5), normal)], [0, 1]),
    ("index_add", lambda x, i, s: fl.index_add(x, 0, i, s, alpha=2),
     lambda x, i, s: _np_index_add(x, 0, i, s, 2),
     lambda x, i, s: x.index_add(0, i, s, alpha=2),
     [((4, 3), normal), ((5,), indices([0, 3, 0, 2, 3])), ((5, 3), normal)], [0, 2]),
    ("index_add_negative_dim", lambda x, i, s: x.index_add(-1, i, s),
     lambda x, i, s: _np_index_add(x, -1, i, s),
     lambda x, i, s: x.index_add(-1, i, s),
     [((2, 3, 4), normal), ((2,), indices([3, 3])), ((2, 3, 2), normal)], [0, 2]),
]  # fmt: skip
IDS = [case[0] for case in CASES]


def _joined(pair):
    """One output from a pair (min, max), (std, mean): ``first * 2 + second``."""
    first, second = pair
    return first * 2 + second


def _torch():
    import torch

    return torch


def _arrays(case, rng):
    return [sampler(rng, shape) for shape, sampler in case[4]]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_value_matches_numpy(case, rng, reference_backend):
    _, build, reference, _, _, _ = case
    arrays = _arrays(case, rng)
    out = build(*(fl.from_numpy(np.ascontiguousarray(array)) for array in arrays))
    expected = np.asarray(reference(*arrays))
    assert out.shape == expected.shape
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradient_matches_finite_differences(case, rng):
    _, build, _, _, _, positions = case
    check_against_finite_differences(build, _arrays(case, rng), positions, rng)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_value_and_gradient_match_torch(case, rng):
    torch_module()
    _, build, _, spelling, _, positions = case
    check_against_torch(build, spelling, _arrays(case, rng), positions, rng)


def _values_and_cotangents(case, arrays, projection_rng):
    """The output and the cotangents of the differentiated inputs, on the current backend,
    for a projection drawn from ``projection_rng``."""
    _, build, _, _, _, positions = case
    tensors = [fl.from_numpy(np.ascontiguousarray(array)) for array in arrays]

    def function(*primals):
        values = list(tensors)
        for position, primal in zip(positions, primals, strict=True):
            values[position] = primal
        return build(*values)

    out, pullback = fl.vjp(function, *(tensors[position] for position in positions))
    projection = projection_rng.standard_normal(out.shape).astype(np.float32)
    return [out.numpy()] + [grad.numpy() for grad in pullback(fl.from_numpy(projection))]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gpu_matches_the_reference(case, rng):
    arrays = _arrays(case, rng)
    results = {}
    for name in ("reference", "cuda"):
        with fl.backend(name):
            results[name] = _values_and_cotangents(case, arrays, np.random.default_rng(7))
    for ours, expected in zip(results["cuda"], results["reference"], strict=True):
        np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)


# --- edge cases -----------------------------------------------------------------------------


def test_t_keeps_0d_and_1d_and_views_stay_lazy(reference_backend):
    scalar, vector = fl.tensor(2.0), fl.tensor([1.0, 2.0, 3.0])
    assert scalar.t().shape == () and fl.t(vector).shape == (3,)
    assert scalar.swapaxes(0, -1).shape == () and scalar.transpose(0, 0).shape == ()
    matrix = fl.ones(2, 3)
    assert matrix.t().node.op == "permute" and matrix.t().t().shape == (2, 3)
    assert fl.ravel(fl.ones(0, 3)).shape == (0,)


def test_zero_dimensional_inputs_as_torch(reference_backend):
    """0-d inputs (the table's helpers make arrays at least 1-d): values and gradients."""
    torch = torch_module()
    builds = [
        (lambda m, x, s: m.t(x) * s, "t"),
        (lambda m, x, s: m.ravel(x) * s, "ravel"),
        (lambda m, x, s: x.index_add(0, m.tensor([0]), s, alpha=2), "index_add"),
        (lambda m, x, s: m.hypot(x, s), "hypot"),
        (lambda m, x, s: m.std_mean(m.stack([x, s]))[0], "std_mean"),
        (lambda m, x, s: x.swapaxes(0, -1) * s, "swapaxes"),
    ]
    for build, label in builds:
        values = (0.75, -1.5)
        ours = [fl.tensor(value).requires_grad_() for value in values]
        theirs = [torch.tensor(value, requires_grad=True) for value in values]
        out, expected = build(fl, *ours), build(torch, *theirs)
        assert out.shape == tuple(expected.shape), label
        np.testing.assert_allclose(out.numpy(), expected.detach().numpy(), rtol=1e-6)
        grads = fl.grad(out.sum(), ours)
        expected_grads = torch.autograd.grad(expected.sum(), theirs)
        for grad, expected_grad in zip(grads, expected_grads, strict=True):
            np.testing.assert_allclose(grad.numpy(), expected_grad.numpy(), rtol=1e-6)


def test_diff_edges(reference_backend):
    x = fl.tensor([1.0, 4.0, 9.0])
    assert x.diff(n=5).shape == (0,) and x.diff(n=3).shape == (0,)
    np.testing.assert_array_equal(x.diff(n=0).numpy(), x.numpy())
    assert x.diff(n=0) is not x
    # n=0 leaves prepend and append out, as PyTorch
    assert fl.ones(2, 3).diff(n=0, prepend=fl.ones(2, 1)).shape == (2, 3)
    flags = fl.tensor([True, False, False, True])
    assert flags.diff().dtype is fl.bool_
    np.testing.assert_array_equal(flags.diff().numpy(), [True, False, True])
    counts = fl.tensor([1, 2, 5])
    assert counts.diff().dtype is fl.int64
    promoted = counts.diff(prepend=fl.tensor([0.5]))
    assert promoted.dtype is fl.float32
    np.testing.assert_allclose(promoted.numpy(), [0.5, 1.0, 3.0])


def test_elementwise_dtypes_and_special_values(reference_backend):
    big = fl.tensor([1e30, 3e38, 0.0, math.inf, -math.inf, math.nan, 3.0])
    other = fl.tensor([1e30, 3e38, 0.0, math.nan, 2.0, 1.0, -4.0])
    np.testing.assert_allclose(
        fl.hypot(big, other).numpy(),
        [math.sqrt(2) * 1e30, math.inf, 0.0, math.inf, math.inf, math.nan, 5.0],
        rtol=1e-6,
    )
    half = fl.tensor([300.0, 2.0], dtype=fl.float16)
    assert fl.hypot(half, half).dtype is fl.float16  # 300**2 overflows float16; hypot does not
    np.testing.assert_allclose(fl.hypot(half, half).numpy(), [424.25, 2.828], rtol=2e-3)
    assert fl.hypot(fl.ones(2), fl.ones(2, dtype=fl.float64)).dtype is fl.float64
    assert fl.logit(fl.tensor([0, 1])).dtype is fl.float32
    np.testing.assert_array_equal(fl.logit(fl.tensor([0, 1])).numpy(), [-math.inf, math.inf])
    # eps above 0.5: below eps gives eps first, as PyTorch's kernel (not clamp's max)
    np.testing.assert_allclose(fl.logit(fl.tensor([0.5]), 0.7).numpy(), [math.log(0.7 / 0.3)])
    np.testing.assert_allclose(fl.logit(fl.tensor([0.25]), -0.5).numpy(), [math.log(1 / 3)])
    fractions = fl.frac(fl.tensor([1.5, -2.25, math.inf, -0.0]))
    np.testing.assert_array_equal(fractions.numpy(), [0.5, -0.25, math.nan, -0.0])
    assert fl.frac(fl.ones(2, dtype=fl.float16)).dtype is fl.float16
    np.testing.assert_array_equal(fl.sgn(fl.tensor([-2, 0, 3])).numpy(), [-1, 0, 1])
    assert fl.sgn(fl.tensor([True, False])).dtype is fl.bool_
    np.testing.assert_array_equal(fl.tensor([7, -7]).floor_divide(2).numpy(), [3, -4])
    np.testing.assert_array_equal(fl.floor_divide(fl.tensor([7.0, -7.0]), 2).numpy(), [3, -4])


def test_hypot_gradient_is_nan_at_the_origin_only_as_torch(reference_backend):
    x, y = fl.zeros(2).requires_grad_(), fl.tensor([0.0, 3.0]).requires_grad_()
    fl.hypot(x, y).sum().backward()
    assert np.isnan(x.grad.numpy()[0]) and x.grad.numpy()[1] == 0.0
    np.testing.assert_allclose(y.grad.numpy()[1], 1.0)
    # ties and squares that underflow float32 (1e-30 ** 2): finite, as PyTorch's
    a, b = [3.0, 3.0, -3.0, 1e-30, 2.0, -1e-30], [3.0, -3.0, -3.0, 1e-30, 0.0, 2e-30]
    x, y = fl.tensor(a).requires_grad_(), fl.tensor(b).requires_grad_()
    grads = fl.grad(fl.hypot(x, y).sum(), [x, y])
    length = np.hypot(np.float64(a), np.float64(b))
    for grad, values in zip(grads, (a, b), strict=True):
        np.testing.assert_allclose(grad.numpy(), np.float64(values) / length, rtol=1e-6)


def test_count_nonzero(reference_backend):
    x = fl.tensor([[0.0, 1.0, math.nan], [-0.0, 2.0, 0.0]])
    assert fl.count_nonzero(x).item() == 3 and fl.count_nonzero(x).dtype is fl.int64
    np.testing.assert_array_equal(x.count_nonzero(dim=0).numpy(), [0, 2, 1])
    np.testing.assert_array_equal(fl.count_nonzero(x, -1).numpy(), [2, 1])
    assert fl.count_nonzero(x, (0, 1)).item() == 3 and fl.count_nonzero(x, []).item() == 3
    assert fl.count_nonzero(fl.tensor(3.0)).item() == 1
    assert fl.count_nonzero(fl.tensor(3.0), dim=0).item() == 1
    assert fl.count_nonzero(fl.tensor([True, False, True])).item() == 2


def test_aminmax_named_tuple_and_edges(reference_backend):
    x = fl.tensor([[1.0, 5.0, -2.0], [0.0, 3.0, 4.0]])
    pair = fl.aminmax(x)
    assert pair._fields == ("min", "max") and type(pair).__name__ == "aminmax"
    assert (pair.min.item(), pair.max.item()) == (-2.0, 5.0)
    low, high = x.aminmax(dim=0)
    np.testing.assert_array_equal(low.numpy(), [0.0, 3.0, -2.0])
    np.testing.assert_array_equal(high.numpy(), [1.0, 5.0, 4.0])
    assert x.aminmax(keepdim=True).min.shape == (1, 1)
    assert fl.aminmax(fl.tensor(3.0), dim=0).max.item() == 3.0
    assert fl.aminmax(fl.ones(0, 3), dim=1).min.shape == (0,)
    flags = fl.aminmax(fl.tensor([True, False]))
    assert (flags.min.item(), flags.max.item()) == (False, True)
    with pytest.raises(TypeError):
        fl.aminmax(x, 0)  # dim is keyword-only, as PyTorch's


def test_aminmax_gradient_splits_among_ties_as_torch(reference_backend):
    torch = torch_module()
    values = [[1.0, 1.0, 2.0], [3.0, 1.0, 0.0]]
    x, expected = fl.tensor(values).requires_grad_(), torch.tensor(values, requires_grad=True)
    x.aminmax(dim=1).min.sum().backward()
    expected.aminmax(dim=1).min.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), expected.grad.numpy())


def test_std_mean_spellings_agree(reference_backend, rng):
    array = normal(rng, (3, 4))
    x = fl.from_numpy(array)
    std, mean = fl.std_mean(x, True)
    assert isinstance(fl.std_mean(x), tuple) and std.shape == () and mean.shape == ()
    np.testing.assert_allclose(std.numpy(), array.std(ddof=1), rtol=1e-5)
    for spelled in (fl.std_mean(x, 0, False), fl.std_mean(x, dim=0, correction=0)):
        np.testing.assert_allclose(spelled[0].numpy(), array.std(0), rtol=1e-5)
    variance, _ = fl.var_mean(x, dim=1, unbiased=True, keepdim=True)
    np.testing.assert_allclose(variance.numpy(), array.var(1, ddof=1, keepdims=True), rtol=1e-5)


def test_addmm_beta_zero_and_alpha_zero_leave_nan_out_as_torch(reference_backend):
    nan = fl.full((2, 2), math.nan).requires_grad_()
    a, b = fl.ones(2, 3).requires_grad_(), fl.ones(3, 2).requires_grad_()
    out = fl.addmm(nan, a, b, beta=0, alpha=2)
    np.testing.assert_array_equal(out.numpy(), np.full((2, 2), 6.0))
    out.sum().backward()
    np.testing.assert_array_equal(nan.grad.numpy(), np.zeros((2, 2)))  # PyTorch's: zeros
    np.testing.assert_array_equal(a.grad.numpy(), np.full((2, 3), 4.0))
    bad = fl.full((2, 3), math.nan).requires_grad_()
    out = fl.addmm(fl.ones(2, 2), bad, b, alpha=0, beta=3)
    np.testing.assert_array_equal(out.numpy(), np.full((2, 2), 3.0))
    out.sum().backward()
    assert bad.grad is not None
    empty = fl.baddbmm(fl.empty(2, 2, 2), fl.ones(2, 2, 3), fl.ones(2, 3, 2), beta=0, alpha=0.5)
    np.testing.assert_array_equal(empty.numpy(), np.full((2, 2, 2), 1.5))


def test_index_add_in_place_and_integers(reference_backend):
    target = fl.zeros(3, 2)
    returned = target.index_add_(0, fl.tensor([0, 2, 0], dtype=fl.int32), fl.ones(3, 2))
    assert returned is target
    np.testing.assert_array_equal(target.numpy(), [[2, 2], [0, 0], [1, 1]])
    counts = fl.zeros(3, 2, dtype=fl.int64)
    added = counts.index_add(0, fl.tensor([0, 1, 1]), fl.ones(3, 2, dtype=fl.int64), alpha=2.5)
    assert added.dtype is fl.int64  # alpha taken as an int (2), as PyTorch
    np.testing.assert_array_equal(added.numpy(), [[2, 2], [4, 4], [0, 0]])
    single = fl.zeros(3, 2).index_add(0, fl.tensor(1), fl.ones(1, 2))
    np.testing.assert_array_equal(single.numpy(), [[0, 0], [1, 1], [0, 0]])


def test_cross_without_dim_takes_the_first_dim_of_size_3_and_warns(reference_backend, rng):
    a, b = normal(rng, (3, 3)), normal(rng, (3, 3))
    with pytest.warns(UserWarning, match="dim"):
        out = fl.cross(fl.from_numpy(a), fl.from_numpy(b))
    np.testing.assert_allclose(out.numpy(), np.cross(a, b, axis=0), rtol=1e-5, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fl.cross(fl.from_numpy(a), fl.from_numpy(b), dim=1)
    integers = fl.tensor([[1, 0, 0]]).cross(fl.tensor([[0, 1, 0]]), dim=1)
    assert integers.dtype is fl.int64 and integers.numpy().tolist() == [[0, 0, 1]]


LAYOUT_SHAPES = [(), (5,), (2, 3), (2, 1, 4), (2, 0, 3), (3, 0), (1, 1)]


@pytest.mark.parametrize("shape", LAYOUT_SHAPES, ids=str)
def test_layout_metadata_is_a_contiguous_tensors(shape, reference_backend):
    x = fl.zeros(shape)
    expected = []
    for axis in range(len(shape)):
        expected.append(math.prod(max(size, 1) for size in shape[axis + 1 :]))
    assert x.stride() == tuple(expected) and x.storage_offset() == 0
    assert all(x.stride(axis) == expected[axis] for axis in range(-len(shape), len(shape)))
    assert x.nelement() == x.numel() == math.prod(shape)
    assert x.is_contiguous()  # what the strides promise
    try:
        torch = __import__("torch")
    except ImportError:
        return
    assert x.stride() == torch.zeros(shape).stride()


def test_views_report_the_layout_they_read_as(reference_backend):
    # every tensor reads as C-contiguous (is_contiguous() is True, contiguous() is itself):
    # a transpose, a slice or a broadcast reports a contiguous tensor's strides, offset 0
    x = fl.zeros(2, 3)
    turned = x.t()
    assert turned.stride() == (2, 1) and turned.is_contiguous() and turned.contiguous() is turned
    assert x[:, 1:].stride() == (2, 1) and x[1:].storage_offset() == 0
    assert x.expand(4, 2, 3).stride() == (6, 3, 1)
    sizes = {fl.float16: 2, fl.bfloat16: 2, fl.float32: 4, fl.float64: 8, fl.int64: 8,
             fl.int32: 4, fl.bool_: 1, fl.uint8: 1}  # fmt: skip
    for dtype, size in sizes.items():
        assert fl.zeros(2, dtype=dtype).element_size() == size


def test_dtypes_match_torch(reference_backend):
    torch = torch_module()
    pairs = [
        (lambda m: m.logit(m.tensor([0, 1, 2])), "logit int"),
        (lambda m: m.hypot(m.ones(2, dtype=m.float16), m.ones(2, dtype=m.float16)), "f16"),
        (lambda m: m.hypot(m.ones(2), m.ones(2, dtype=m.float64)), "hypot f64"),
        (lambda m: m.count_nonzero(m.ones(2, 2), 0), "count_nonzero"),
        (lambda m: m.diff(m.tensor([1, 2, 5]), prepend=m.tensor([0.5])), "diff promote"),
        (lambda m: m.diff(m.tensor([True, False])), "diff bool"),
        (lambda m: m.sgn(m.tensor([-2, 3])), "sgn int"),
        (lambda m: m.tensor([7, -7]).floor_divide(2), "floor_divide int"),
        (lambda m: m.frac(m.ones(2, dtype=m.float16)), "frac f16"),
        (lambda m: m.aminmax(m.tensor([1, 2])).min, "aminmax int"),
        (lambda m: m.tile(m.tensor([True]), (2,)), "tile bool"),
    ]
    for build, label in pairs:
        ours, theirs = build(fl), build(torch)
        assert ours.dtype.name == str(theirs.dtype).removeprefix("torch."), label
        assert ours.shape == tuple(theirs.shape), label
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy(), err_msg=label)


# --- errors ---------------------------------------------------------------------------------

M = fl.zeros  # shorthand for the error table (tensors built inside each call)

ERRORS = [
    ("t_3d", lambda: M(2, 3, 4).t(), fl.ShapeError, ["t", "[2, 3, 4]", "3-D"]),
    ("adjoint_1d", lambda: fl.adjoint(M(3)), fl.ShapeError, ["adjoint", "[3]", "1-D"]),
    ("swapaxes_dim", lambda: M(2, 3).swapaxes(0, 3), IndexError, ["swapaxes", "3"]),
    ("swapdims_type", lambda: M(2, 3).swapdims(0, 1.0), TypeError, ["swapdims", "dim"]),
    ("view_as_not_tensor", lambda: M(2, 3).view_as((3, 2)), TypeError, ["view_as", "tuple"]),
    ("expand_as", lambda: M(2, 3).expand_as(M(3)), fl.ShapeError, ["expand", "[2, 3]"]),
    ("reshape_as", lambda: M(2, 3).reshape_as(M(5)), fl.ShapeError, ["reshape", "[5]"]),
    ("tile_negative", lambda: M(2, 3).tile(2, -1), fl.ShapeError, ["tile", "-1", "[2, 3]"]),
    ("addmm_3d", lambda: fl.addmm(M(2, 2), M(1, 2, 3), M(3, 2)), fl.ShapeError,
     ["addmm", "mat1", "[1, 2, 3]"]),
    ("addmm_inner", lambda: fl.addmm(M(2, 2), M(2, 3), M(4, 2)), fl.ShapeError,
     ["addmm", "2x3", "4x2"]),
    ("addmm_dtype", lambda: fl.addmm(M(2, 2, dtype=fl.float64), M(2, 3), M(3, 2)), TypeError,
     ["addmm", "float64[2, 2]", "float32[2, 3]"]),
    ("addmm_input_shape", lambda: fl.addmm(M(3, 2), M(2, 3), M(3, 2)), fl.ShapeError,
     ["addmm", "[3, 2]", "[2, 2]"]),
    ("addmm_integers", lambda: fl.addmm(M(2, 2, dtype=fl.int64), M(2, 3, dtype=fl.int64),
                                        M(3, 2, dtype=fl.int64)), TypeError,
     ["addmm", "int64[2, 3]"]),
    ("baddbmm_batches", lambda: fl.baddbmm(M(2, 2), M(3, 2, 3), M(4, 3, 2)), fl.ShapeError,
     ["baddbmm", "[3, 2, 3]", "[4, 3, 2]"]),
    ("baddbmm_2d", lambda: M(2, 2).baddbmm(M(2, 3), M(3, 2)), fl.ShapeError,
     ["baddbmm", "3-D", "[2, 3]"]),
    ("hypot_integers", lambda: fl.hypot(fl.tensor([1, 2]), fl.tensor([1, 2])), TypeError,
     ["hypot", "int64[2]"]),
    ("hypot_number", lambda: fl.hypot(M(2), 3.0), TypeError, ["hypot", "float"]),
    ("frac_integers", lambda: fl.frac(fl.tensor([1, 2])), TypeError, ["frac", "int64[2]"]),
    ("aminmax_empty", lambda: fl.aminmax(M(0, 3)), RuntimeError, ["aminmax", "[0, 3]"]),
    ("aminmax_empty_dim", lambda: M(0, 3).aminmax(dim=0), IndexError, ["aminmax", "[0, 3]"]),
    ("count_nonzero_twice", lambda: fl.count_nonzero(M(2, 3), (0, 0)), ValueError,
     ["count_nonzero", "(0, 0)"]),
    ("std_mean_integers", lambda: fl.std_mean(fl.tensor([1, 2])), TypeError,
     ["std_mean", "int64[2]"]),
    ("var_mean_both", lambda: fl.var_mean(M(3), 0, True, correction=0), TypeError,
     ["var_mean", "unbiased", "correction"]),
    ("diff_0d", lambda: fl.diff(fl.tensor(1.0)), fl.ShapeError, ["diff", "float32[]"]),
    ("diff_order", lambda: M(3).diff(n=-1), ValueError, ["diff", "-1"]),
    ("diff_prepend_rank", lambda: M(3).diff(prepend=fl.tensor(0.5)), fl.ShapeError,
     ["diff", "prepend", "float32[]"]),
    ("diff_append_shape", lambda: M(2, 3).diff(append=M(3, 3)), fl.ShapeError,
     ["diff", "append", "[3, 3]", "[2, 3]"]),
    ("rot90_three_dims", lambda: M(2, 3).rot90(1, [0, 1, 2]), ValueError, ["rot90", "[0, 1, 2]"]),
    ("rot90_1d", lambda: fl.rot90(M(2)), fl.ShapeError, ["rot90", "[2]"]),
    ("rot90_same_dims", lambda: M(2, 3).rot90(1, (0, -2)), ValueError, ["rot90", "0", "-2"]),
    ("rot90_dim_range", lambda: M(2, 3).rot90(1, (0, 5)), IndexError, ["rot90", "5"]),
    ("cross_length", lambda: fl.cross(M(4, 4), M(4, 4), dim=0), fl.ShapeError,
     ["cross", "length 3", "[4, 4]"]),
    ("cross_rank", lambda: M(4, 3).cross(M(3), dim=-1), fl.ShapeError,
     ["cross", "[4, 3]", "[3]"]),
    ("cross_dtype", lambda: M(4, 3, dtype=fl.int64).cross(M(4, 3), dim=1), TypeError,
     ["cross", "int64[4, 3]", "float32[4, 3]"]),
    ("cross_no_3", lambda: fl.cross(M(4, 4), M(4, 4)), fl.ShapeError, ["cross", "size 3"]),
    ("index_add_float_index", lambda: M(3, 2).index_add(0, fl.tensor([0.0]), M(1, 2)),
     TypeError, ["index_add", "float32[1]"]),
    ("index_add_matrix_index", lambda: M(3, 2).index_add(0, fl.tensor([[0, 1]]), M(2, 2)),
     IndexError, ["index_add", "int64[1, 2]"]),
    ("index_add_source_shape", lambda: fl.index_add(M(3, 2), 0, fl.tensor([0, 2]), M(3, 2)),
     fl.ShapeError, ["index_add", "float32[3, 2]", "2"]),
    ("index_add_source_dtype", lambda: M(3, 2).index_add(0, fl.tensor([0]),
                                                        M(1, 2, dtype=fl.float64)),
     TypeError, ["index_add", "float64[1, 2]", "float32[3, 2]"]),
    ("index_add_dim", lambda: M(3, 2).index_add(2, fl.tensor([0]), M(1, 2)), IndexError,
     ["index_add", "dim 2"]),
    ("stride_dim", lambda: M(2, 3).stride(2), IndexError, ["stride", "2"]),
    ("stride_0d", lambda: fl.tensor(1.0).stride(0), IndexError, ["stride", "0-d"]),
]  # fmt: skip


@pytest.mark.parametrize("case", ERRORS, ids=[case[0] for case in ERRORS])
def test_bad_input_raises_at_the_user_line(case, reference_backend):
    _, call, error, words = case
    assert_user_error(call, error, words, at=HERE)


def test_index_add_out_of_range_raises_on_the_reference_backend(reference_backend):
    with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
        M(3, 2).index_add(0, fl.tensor([0, 5]), fl.ones(2, 2)).numpy()


# --- under fl.compile -----------------------------------------------------------------------


def _rearranged(x):
    """[3, 4] -> [4, 3]: several of the new views and composites in one graph."""
    turned = x.rot90(-1).swapaxes(0, 1).t()  # [3, 4] -> [4, 3] -> [3, 4] -> [4, 3]
    stepped = fl.diff(x.t(), dim=0, prepend=x.t()[:1])
    return fl.hypot(turned, stepped + 1.0) + fl.logit(x.t().sigmoid(), eps=0.1)


def _products(x):
    """[4, 3] -> [4, 3]: addmm, cross, tile, frac, aminmax and std_mean."""
    low, high = fl.aminmax(x, dim=0, keepdim=True)
    std, mean = fl.std_mean(x, dim=1, keepdim=True)
    product = fl.addmm(x, x, x.t().tile(1, 1)[:, :3], beta=0.5, alpha=0.25)
    return x.cross(product, dim=1) + (high - low) * std + mean + fl.frac(x * 3.0)


def _indexed(x):
    """[4, 3] -> [4, 3]: index_add, baddbmm, count_nonzero as a float, var_mean."""
    added = fl.index_add(x, 0, fl.tensor([3, 0, 3]), x[:3] * 2.0)
    variance, mean = fl.var_mean(x, 0, keepdim=True)
    batched = fl.baddbmm(x.unsqueeze(0), x.unsqueeze(0), x.t().unsqueeze(0)[..., :3], beta=0.0)
    return added + batched[0] * variance + mean * fl.count_nonzero(x, 1).unsqueeze(1).to(x.dtype)


@pytest.mark.parametrize("op", [_rearranged, _products, _indexed],
                         ids=["rearranged", "products", "indexed"])  # fmt: skip
def test_compiled_matches_lazy_with_gradients(op, rng, backend):
    shape = (3, 4) if op is _rearranged else (4, 3)
    x = fl.tensor(normal(rng, shape)).requires_grad_()
    out_shape = (4, 3)
    seed = fl.tensor(normal(rng, out_shape))
    assert_compiled_matches_lazy(op, x, seed, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", [_rearranged, _products, _indexed],
                         ids=["rearranged", "products", "indexed"])  # fmt: skip
def test_cuda_kernels_compile_with_nvrtc(op, cuda_backend, nvrtc, rng):
    """The forward and backward kernels of the new ops render and compile for the GPU (no
    GPU needed: NVRTC only)."""
    shape = (3, 4) if op is _rearranged else (4, 3)
    x = fl.from_numpy(normal(rng, shape))
    out, pullback = fl.vjp(op, x)
    (grad,) = pullback(fl.ones(out.shape))
    for cubin in compile_plan_kernels([out.node, grad.node]):
        assert cubin[:4] == b"\x7fELF"
