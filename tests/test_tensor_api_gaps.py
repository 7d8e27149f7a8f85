"""PyTorch tensor methods and functions FLAME lacked (flame/rearranging.py, and additions to
flame/functional.py, flame/reductions.py, flame/linalg.py, flame/indexing.py), from one
table of cases: values against NumPy and gradients against float64 central differences
(both run without PyTorch), values and gradients against PyTorch where it is importable,
the GPU against the reference backend (gpu tier); and a few of them under ``fl.compile`` and
through NVRTC. Edge cases and errors: tests/test_tensor_api_gaps_edges.py."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_against_finite_differences, check_against_torch, flame_vjp
from opinfo import assert_compiled_matches_lazy, compile_plan_kernels

import flame as fl


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
    _, out, _, cotangents = flame_vjp(build, arrays, positions, projection_rng)
    return [out.numpy()] + [grad.numpy() for grad in cotangents]


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
