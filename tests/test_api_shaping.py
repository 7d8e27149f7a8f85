"""The shape and creation helpers of issue 18 (flame/shaping.py, flame/ranges.py,
flame/contraction.py, flame/norms.py): values against NumPy (runs without PyTorch), values and
gradients against PyTorch where it is importable, gradients against float64 central
differences, and the errors bad input raises when the op is built."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_against_finite_differences, check_against_torch

import flame as fl
import flame.contraction as E
import flame.norms as N
import flame.ranges as G
import flame.shaping as S
from flame.joining import pad, tril, triu


def normal(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def torch_module():
    return pytest.importorskip("torch", reason="PyTorch is the reference for these checks")


# (name, flame builder, NumPy reference, PyTorch spelling, input shapes): differentiable
# functions of float inputs, every input differentiated.
CASES = [
    ("chunk", lambda x: S.chunk(x, 3, 1)[1], lambda a: a[:, 3:6],
     lambda x: x.chunk(3, 1)[1], [(4, 7)]),
    ("split_int", lambda x: S.split(x, 2, -1)[2], lambda a: a[:, 4:],
     lambda x: x.split(2, -1)[2], [(3, 5)]),
    ("split_sizes", lambda x: S.split(x, [1, 3], 0)[1] * 2, lambda a: a[1:] * 2,
     lambda x: x.split([1, 3], 0)[1] * 2, [(4, 2)]),
    ("unbind", lambda x: S.unbind(x, 1)[2], lambda a: a[:, 2], lambda x: x.unbind(1)[2],
     [(3, 4)]),
    ("clone", lambda x: S.clone(x) * 3, lambda a: a * 3, lambda x: x.clone() * 3, [(3,)]),
    ("repeat_interleave", lambda x: x.repeat_interleave(2, 0),
     lambda a: np.repeat(a, 2, 0), lambda x: x.repeat_interleave(2, 0), [(3, 2)]),
    ("repeat_interleave_flat", lambda x: S.repeat_interleave(x, 3),
     lambda a: np.repeat(a.reshape(-1), 3), lambda x: x.repeat_interleave(3), [(2, 2)]),
    ("roll", lambda x: S.roll(x, (1, -2), (0, 1)), lambda a: np.roll(a, (1, -2), (0, 1)),
     lambda x: x.roll((1, -2), (0, 1)), [(3, 5)]),
    ("roll_flat", lambda x: S.roll(x, 4), lambda a: np.roll(a, 4), lambda x: x.roll(4),
     [(2, 3)]),
    ("outer", S.outer, np.outer, lambda a, b: a.outer(b), [(3,), (4,)]),
    ("diagonal", lambda x: S.diagonal(x, 1, 0, 2), lambda a: np.diagonal(a, 1, 0, 2),
     lambda x: x.diagonal(1, 0, 2), [(3, 2, 4)]),
    ("diagonal_below", lambda x: S.diagonal(x, -1), lambda a: np.diagonal(a, -1),
     lambda x: x.diagonal(-1), [(4, 3)]),
    ("diag_vector", lambda x: S.diag(x, 1), lambda a: np.diag(a, 1),
     lambda x: x.diag(1), [(3,)]),
    ("diag_vector_below", lambda x: S.diag(x, -2), lambda a: np.diag(a, -2),
     lambda x: x.diag(-2), [(3,)]),
    ("diag_matrix", lambda x: S.diag(x), np.diag, lambda x: x.diag(), [(3, 4)]),
    ("unfold", lambda x: S.unfold(x, 1, 3, 2),
     lambda a: np.stack([a[:, i : i + 3] for i in (0, 2)], 1), lambda x: x.unfold(1, 3, 2),
     [(2, 6)]),
    ("unflatten", lambda x: S.unflatten(x, 1, (2, -1)), lambda a: a.reshape(3, 2, 2),
     lambda x: x.unflatten(1, (2, -1)), [(3, 4)]),
    ("movedim", lambda x: S.movedim(x, 0, -1), lambda a: np.moveaxis(a, 0, -1),
     lambda x: x.movedim(0, -1), [(2, 3, 4)]),
    ("softmax_method", lambda x: x.softmax(0), None, lambda x: x.softmax(0), [(3, 4)]),
    ("log_softmax_method", lambda x: x.log_softmax(-1), None, lambda x: x.log_softmax(-1),
     [(3, 4)]),
    ("einsum_bmm", lambda a, b: E.einsum("bij,bjk->bik", a, b), lambda a, b: a @ b,
     None, [(2, 3, 4), (2, 4, 5)]),
    ("einsum_attention", lambda q, k: E.einsum("bhqd,bhkd->bhqk", q, k),
     lambda q, k: q @ np.swapaxes(k, -1, -2), None, [(2, 2, 3, 4), (2, 2, 5, 4)]),
    ("einsum_transpose", lambda x: E.einsum("...ij->...ji", x),
     lambda a: np.swapaxes(a, -1, -2), None, [(2, 3, 4)]),
    ("einsum_outer", lambda a, b: E.einsum("i,j->ij", a, b), np.outer, None, [(3,), (4,)]),
    ("einsum_diagonal", lambda x: E.einsum("ii->i", x), np.diag, None, [(4, 4)]),
    ("einsum_trace", lambda x: E.einsum("ii", x), np.trace, None, [(4, 4)]),
    ("einsum_batch_trace", lambda x: E.einsum("bii->b", x),
     lambda a: np.trace(a, axis1=1, axis2=2), None, [(3, 4, 4)]),
    ("einsum_chain", lambda a, b, c: E.einsum("ij,jk,kl->il", a, b, c),
     lambda a, b, c: a @ b @ c, None, [(2, 3), (3, 4), (4, 2)]),
    ("einsum_implicit", lambda a, b: E.einsum("ij,jk", a, b), lambda a, b: a @ b, None,
     [(2, 3), (3, 4)]),
    ("einsum_broadcast", lambda a, b: E.einsum("...ij,...jk->...ik", a, b),
     lambda a, b: a @ b, None, [(2, 1, 3, 4), (5, 4, 2)]),
    ("einsum_rowdot", lambda a, b: E.einsum("ij,ij->i", a, b), lambda a, b: (a * b).sum(1),
     None, [(3, 4), (3, 4)]),
    ("norm_fro", lambda x: N.norm(x), lambda a: np.linalg.norm(a), lambda x: x.norm(),
     [(3, 4)]),
    ("norm_fro_dims", lambda x: N.norm(x, "fro", (1, 2), True),
     lambda a: np.sqrt((a * a).sum((1, 2), keepdims=True)),
     lambda x: x.norm("fro", (1, 2), True), [(2, 3, 4)]),
    ("norm_2", lambda x: N.norm(x, 2, 1), lambda a: np.linalg.norm(a, 2, 1),
     lambda x: x.norm(2, 1), [(3, 4)]),
    ("norm_1", lambda x: N.norm(x, 1, 0, True), lambda a: np.abs(a).sum(0, keepdims=True),
     lambda x: x.norm(1, 0, True), [(3, 4)]),
    ("norm_inf", lambda x: N.norm(x, float("inf"), 1), lambda a: np.abs(a).max(1),
     lambda x: x.norm(float("inf"), 1), [(3, 4)]),
    ("norm_neg_inf", lambda x: N.norm(x, -float("inf")), lambda a: np.abs(a).min(),
     lambda x: x.norm(-float("inf")), [(3, 4)]),
    ("norm_3", lambda x: N.norm(x, 3, -1), lambda a: (np.abs(a) ** 3).sum(-1) ** (1 / 3),
     lambda x: x.norm(3, -1), [(3, 4)]),
    ("normalize", lambda x: fl.nn.functional.normalize(x, dim=1),
     lambda a: a / np.linalg.norm(a, 2, 1, keepdims=True), None, [(3, 4)]),
]  # fmt: skip
IDS = [case[0] for case in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_value_matches_numpy(case, rng, reference_backend):
    _, build, reference, _, shapes = case
    if reference is None:
        pytest.skip("no independent NumPy spelling; checked against PyTorch")
    arrays = [normal(rng, *shape) for shape in shapes]
    out = build(*(fl.from_numpy(array) for array in arrays))
    np.testing.assert_allclose(out.numpy(), reference(*arrays), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradient_matches_finite_differences(case, rng):
    _, build, _, _, shapes = case
    arrays = [normal(rng, *shape) for shape in shapes]
    check_against_finite_differences(build, arrays, list(range(len(arrays))), rng)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_value_and_gradient_match_torch(case, rng):
    torch = torch_module()
    name, build, _, spelling, shapes = case
    if spelling is None:  # einsum, normalize: the functional spelling
        if name.startswith("einsum"):
            equation = _EQUATIONS[name]

            def spelling(*tensors):
                return torch.einsum(equation, *tensors)
        else:

            def spelling(x):
                return torch.nn.functional.normalize(x, dim=1)

    arrays = [normal(rng, *shape) for shape in shapes]
    check_against_torch(build, spelling, arrays, list(range(len(arrays))), rng)


_EQUATIONS = {
    "einsum_bmm": "bij,bjk->bik", "einsum_attention": "bhqd,bhkd->bhqk",
    "einsum_transpose": "...ij->...ji", "einsum_outer": "i,j->ij", "einsum_diagonal": "ii->i",
    "einsum_trace": "ii", "einsum_batch_trace": "bii->b", "einsum_chain": "ij,jk,kl->il",
    "einsum_implicit": "ij,jk", "einsum_broadcast": "...ij,...jk->...ik",
    "einsum_rowdot": "ij,ij->i",
}  # fmt: skip


def test_pieces_cover_the_input_as_torch_splits_it(reference_backend):
    x = fl.from_numpy(np.arange(10, dtype=np.float32))
    assert [piece.shape for piece in S.chunk(x, 4)] == [(3,), (3,), (3,), (1,)]
    assert [piece.shape for piece in S.chunk(x, 3)] == [(4,), (4,), (2,)]
    assert [piece.shape for piece in x.split(4)] == [(4,), (4,), (2,)]
    assert [len(S.unbind(fl.zeros(2, 3), d)) for d in (0, 1)] == [2, 3]
    np.testing.assert_array_equal(np.concatenate([p.numpy() for p in x.chunk(4)]), np.arange(10))


def test_new_tensors_take_dtype_and_backend_of_self(reference_backend):
    x = fl.zeros(2, 3, dtype=fl.float16)
    assert x.new_zeros(4).dtype is fl.float16 and x.new_zeros((4, 1)).shape == (4, 1)
    np.testing.assert_array_equal(x.new_ones(2, 2).numpy(), np.ones((2, 2)))
    np.testing.assert_array_equal(x.new_full((3,), 7, dtype=fl.int32).numpy(), [7, 7, 7])
    assert x.new_full((3,), 7, dtype=fl.int32).dtype is fl.int32
    assert x.new_empty(5).shape == (5,) and x.new_zeros(1).backend == "reference"
    assert x.type_as(fl.zeros(1, dtype=fl.int64)).dtype is fl.int64
    assert x.dim() == 2 and x.contiguous() is x and x.clone() is not x
    assert x.reshape(shape=(3, 2)).shape == (3, 2) and x.reshape(6).shape == (6,)


def test_repeat_interleave_with_counts(reference_backend):
    x = fl.from_numpy(np.arange(6, dtype=np.float32).reshape(3, 2))
    counts = fl.tensor([2, 0, 1])
    np.testing.assert_array_equal(
        S.repeat_interleave(x, counts, 0).numpy(), np.repeat(x.numpy(), [2, 0, 1], 0)
    )
    np.testing.assert_array_equal(S.repeat_interleave(counts).numpy(), [0, 0, 2])


def test_meshgrid_both_indexings(reference_backend):
    a, b = np.arange(3, dtype=np.float32), np.arange(4, dtype=np.float32)
    for indexing in ("ij", "xy"):
        grids = S.meshgrid(fl.from_numpy(a), fl.from_numpy(b), indexing=indexing)
        for grid, expected in zip(grids, np.meshgrid(a, b, indexing=indexing), strict=True):
            np.testing.assert_array_equal(grid.numpy(), expected)


def test_ranges_match_numpy(reference_backend):
    np.testing.assert_allclose(G.linspace(-2, 3, 11).numpy(), np.linspace(-2, 3, 11), atol=1e-6)
    assert G.linspace(0, 1, 1).numpy().tolist() == [0.0] and G.linspace(0, 1, 0).shape == (0,)
    np.testing.assert_allclose(G.logspace(-1, 2, 4).numpy(), np.logspace(-1, 2, 4), rtol=1e-6)
    np.testing.assert_allclose(G.logspace(0, 4, 5, base=2).numpy(), 2.0 ** np.arange(5))
    np.testing.assert_array_equal(G.eye(3).numpy(), np.eye(3))
    np.testing.assert_array_equal(G.eye(2, 4, dtype=fl.int32).numpy(), np.eye(2, 4))
    np.testing.assert_array_equal(G.tril_indices(4, 3, -1).numpy(), np.tril_indices(4, -1, 3))
    np.testing.assert_array_equal(G.triu_indices(3, 5, 1).numpy(), np.triu_indices(3, 1, 5))
    assert G.tril_indices(3, 3).dtype is fl.int64


def test_ranges_match_torch(reference_backend):
    torch = torch_module()
    np.testing.assert_array_equal(G.linspace(0, 1, 7).numpy(), torch.linspace(0, 1, 7).numpy())
    np.testing.assert_array_equal(
        G.linspace(-1, 10, 4, dtype=fl.int32).numpy(),
        torch.linspace(-1, 10, 4, dtype=torch.int32).numpy(),
    )
    np.testing.assert_allclose(
        G.logspace(-2, 2, 5).numpy(), torch.logspace(-2, 2, 5).numpy(), rtol=1e-6
    )
    np.testing.assert_array_equal(
        G.triu_indices(4, 6, -1).numpy(), torch.triu_indices(4, 6, -1).numpy()
    )


def test_triangles_of_bool_stay_bool(reference_backend, rng):
    mask = rng.random((4, 5)) < 0.5
    for function, expected in ((tril, np.tril(mask, 1)), (triu, np.triu(mask, -1))):
        result = function(fl.tensor(mask), 1 if function is tril else -1)
        assert result.dtype is fl.bool_
        np.testing.assert_array_equal(result.numpy(), expected)


def test_einsum_of_integers_matches_numpy(reference_backend, rng):
    a, b = rng.integers(-4, 5, (3, 4)), rng.integers(-4, 5, (4, 2))
    result = E.einsum("ij,jk->ik", fl.tensor(a), fl.tensor(b))
    assert result.dtype is fl.int64
    np.testing.assert_array_equal(result.numpy(), a @ b)


def test_isclose_and_allclose(reference_backend):
    values = np.array([1.0, np.nan, np.inf, -np.inf, 1e-9, 2.0, np.inf], np.float32)
    others = np.array([1.0 + 1e-6, np.nan, np.inf, np.inf, 0.0, 2.1, 1.0], np.float32)
    for equal_nan in (False, True):
        result = N.isclose(fl.from_numpy(values), fl.from_numpy(others), equal_nan=equal_nan)
        expected = np.isclose(values, others, rtol=1e-5, atol=1e-8, equal_nan=equal_nan)
        np.testing.assert_array_equal(result.numpy(), expected)
    assert N.allclose(fl.from_numpy(values[:1]), fl.from_numpy(others[:1]))
    assert not N.allclose(fl.from_numpy(values), fl.from_numpy(others), equal_nan=True)
    assert fl.from_numpy(values).isclose(1.0).numpy().tolist() == [True] + [False] * 6


def test_norm_gradient_at_zero_is_zero_as_in_torch(reference_backend):
    x = fl.zeros(2, 3)
    x.requires_grad_()
    N.norm(x, 2, 1).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros((2, 3)))


def test_pad_modes_match_numpy(reference_backend, rng):
    array = normal(rng, 2, 3, 5)
    widths = ((0, 0), (0, 2), (3, 1))
    for mode, numpy_mode in (("reflect", "reflect"), ("replicate", "edge"), ("circular", "wrap")):
        result = pad(fl.from_numpy(array), (3, 1, 0, 2), mode=mode)
        np.testing.assert_array_equal(result.numpy(), np.pad(array, widths, mode=numpy_mode))


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_pad_modes_match_torch(mode, rng):
    torch = torch_module()
    array = normal(rng, 2, 3, 4, 5)
    pads = (2, 1, 0, 3)
    check_against_torch(lambda x: pad(x, pads, mode), lambda x: torch.nn.functional.pad(
        x, pads, mode=mode), [array], [0], rng)  # fmt: skip


# --- bad input: errors when the op is built, naming op, shapes, dim, at the user's line --------

BAD_INPUT = [
    (lambda x: S.split(x, [1, 2], 1), fl.ShapeError, r"split: sizes \[1, 2\].*add up to 4.*dim 1"),
    (lambda x: S.chunk(x, 0), ValueError, "chunk: chunks must be a positive int"),
    (lambda x: S.unbind(x, 2), IndexError, "unbind: dim 2 is out of range"),
    (lambda x: S.diagonal(x, 0, 1, 1), fl.ShapeError, "diagonal: dim1 1 and dim2 1"),
    (lambda x: S.unfold(x, 1, 5, 1), fl.ShapeError, r"unfold: size 5.*float32\[3, 4\]"),
    (lambda x: S.unflatten(x, 1, (3, -1)), fl.ShapeError, "unflatten: sizes .* do not multiply"),
    (lambda x: S.outer(x, x), fl.ShapeError, "outer: needs two 1-d tensors"),
    (lambda x: S.roll(x, (1, 2), 0), ValueError, "roll: 2 shifts for 1 dims"),
    (lambda x: S.repeat_interleave(x, fl.tensor([1, 2]), 0), fl.ShapeError, "repeat_interleave"),
    (lambda x: E.einsum("ij,jk->ik", x, x), fl.ShapeError, "einsum: 'ij,jk->ik': label 'j'"),
    (lambda x: E.einsum("ijk->i", x), fl.ShapeError, r"term 'ijk' has 3 labels.*\[3, 4\]"),
    (lambda x: E.einsum("ij->k", x), ValueError, "output label 'k' is in no operand"),
    (lambda x: N.norm(x, "nuc"), ValueError, "norm: p must be 'fro' or a number"),
    (lambda x: pad(x, (5, 0), mode="reflect"), fl.ShapeError, "reflect padding"),
    (lambda x: pad(x, (1, 1), mode="mirror"), ValueError, "pad: mode must be one of"),
]


@pytest.mark.parametrize("index", range(len(BAD_INPUT)))
def test_bad_input_raises_at_the_users_line(index, reference_backend):
    build, error, pattern = BAD_INPUT[index]
    with pytest.raises(error, match=pattern) as raised:
        build(fl.zeros(3, 4))
    assert "[at test_api_shaping.py:" in str(raised.value)


# --- gpu tier: the same compositions lowered to kernels, against the reference ------------------


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gpu_value_and_gradient_match_reference(case, rng):
    _, build, _, _, shapes = case
    arrays = [normal(rng, *shape) for shape in shapes]
    results = {}
    for backend in ("reference", "cuda"):
        with fl.backend(backend):
            inputs = [fl.from_numpy(array) for array in arrays]
            for tensor in inputs:
                tensor.requires_grad_()
            out = build(*inputs)
            (out * out).sum().backward()
            results[backend] = [out.numpy()] + [tensor.grad.numpy() for tensor in inputs]
    for actual, expected in zip(results["cuda"], results["reference"], strict=True):
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
