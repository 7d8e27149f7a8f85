"""Cumulative ops and sorting (flame/scan.py, flame/sorting.py, their library ops in
flame/ir/ops/scan.py and flame/runtime/library_scan.py): values and indices against NumPy,
values, indices and gradients against PyTorch where importable, gradients against float64
central differences, the GPU implementations against the reference (``gpu`` tier), and the
errors bad input raises."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_against_finite_differences, check_against_torch

import flame as fl
import flame.scan as C
import flame.sorting as O


def torch_module():
    return pytest.importorskip("torch", reason="PyTorch is the reference for these checks")


def distinct(rng, *shape):
    """Values 0.1 apart in random order: sorts and running extremes have no ties."""
    count = int(np.prod(shape))
    return ((rng.permutation(count) - count / 2) * 0.1).reshape(shape).astype(np.float32)


def running_extreme_index(array, axis, largest):
    """NumPy's spelling of PyTorch's cummax/cummin index rule (ties take the later index)."""
    moved = np.moveaxis(array, axis, -1)
    out = np.zeros(moved.shape, np.int64)
    for row in np.ndindex(moved.shape[:-1]):
        best = 0
        for position in range(moved.shape[-1]):
            value, current = moved[row + (position,)], moved[row + (best,)]
            if np.isnan(value) or (
                not np.isnan(current) and (value >= current if largest else value <= current)
            ):
                best = position
            out[row + (position,)] = best
    return np.moveaxis(out, -1, axis)


# (name, flame builder, NumPy reference, PyTorch spelling, sampler shape)
CASES = [
    ("cumsum", lambda x: C.cumsum(x, 1), lambda a: np.cumsum(a, 1),
     lambda x: x.cumsum(1), (3, 5)),
    ("cumsum_first", lambda x: x.cumsum(0), lambda a: np.cumsum(a, 0),
     lambda x: x.cumsum(0), (4, 2, 3)),
    ("cumprod", lambda x: C.cumprod(x, -1), lambda a: np.cumprod(a, -1),
     lambda x: x.cumprod(-1), (3, 5)),
    ("logcumsumexp", lambda x: C.logcumsumexp(x * 20, 1),
     lambda a: np.logaddexp.accumulate(a * 20, 1), lambda x: (x * 20).logcumsumexp(1), (3, 6)),
    ("cummax_values", lambda x: C.cummax(x, 1).values,
     lambda a: np.maximum.accumulate(a, 1), lambda x: x.cummax(1).values, (3, 6)),
    ("cummin_values", lambda x: x.cummin(0).values, lambda a: np.minimum.accumulate(a, 0),
     lambda x: x.cummin(0).values, (5, 2)),
    ("sort", lambda x: O.sort(x, 1).values, lambda a: np.sort(a, 1),
     lambda x: x.sort(1).values, (3, 6)),
    ("sort_descending", lambda x: O.sort(x, 0, descending=True).values,
     lambda a: -np.sort(-a, 0), lambda x: x.sort(0, descending=True).values, (5, 3)),
    ("topk", lambda x: O.topk(x, 2).values, lambda a: -np.sort(-a, -1)[:, :2],
     lambda x: x.topk(2).values, (3, 6)),
    ("topk_smallest", lambda x: x.topk(3, 0, largest=False).values,
     lambda a: np.sort(a, 0)[:3], lambda x: x.topk(3, 0, largest=False).values, (5, 2)),
]  # fmt: skip
IDS = [case[0] for case in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_value_matches_numpy(case, rng, reference_backend):
    _, build, reference, _, shape = case
    array = distinct(rng, *shape)
    np.testing.assert_allclose(build(fl.from_numpy(array)).numpy(), reference(array), rtol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradient_matches_finite_differences(case, rng):
    _, build, _, _, shape = case
    check_against_finite_differences(build, [distinct(rng, *shape)], [0], rng)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_value_and_gradient_match_torch(case, rng):
    torch_module()
    _, build, _, spelling, shape = case
    check_against_torch(build, spelling, [distinct(rng, *shape)], [0], rng)


def test_cumprod_gradient_at_zeros_matches_torch(rng):
    array = rng.standard_normal((4, 6)).astype(np.float32)
    array[0, 2] = array[1, 0] = array[1, 3] = array[2, 5] = array[3, 1] = array[3, 4] = 0.0
    check_against_finite_differences(lambda x: C.cumprod(x, 1), [array], [0], rng)
    torch_module()
    check_against_torch(lambda x: C.cumprod(x, 1), lambda x: x.cumprod(1), [array], [0], rng)


def test_indices_match_numpy(rng, reference_backend):
    array = distinct(rng, 4, 7)
    x = fl.from_numpy(array)
    np.testing.assert_array_equal(O.argsort(x, 1).numpy(), np.argsort(array, 1))
    np.testing.assert_array_equal(x.sort(0).indices.numpy(), np.argsort(array, 0))
    np.testing.assert_array_equal(O.argsort(x, -1, descending=True).numpy(), np.argsort(-array, -1))
    np.testing.assert_array_equal(x.topk(3).indices.numpy(), np.argsort(-array, -1)[:, :3])
    for function, largest in ((C.cummax, True), (C.cummin, False)):
        np.testing.assert_array_equal(
            function(x, 1).indices.numpy(), running_extreme_index(array, 1, largest)
        )


def test_ties_and_nan_follow_torch_rules(reference_backend):
    values = np.array([1.0, 3.0, 3.0, np.nan, 2.0, np.nan, 1.0], np.float32)
    x = fl.from_numpy(values)
    # cummax/cummin: ties take the later index, a NaN sticks (and later NaNs move the index)
    assert C.cummax(x, 0).indices.numpy().tolist() == [0, 1, 2, 3, 3, 5, 5]
    assert C.cummin(x, 0).indices.numpy().tolist() == [0, 0, 0, 3, 3, 5, 5]
    # sorts are stable; NaN is the largest value
    assert O.argsort(x, stable=True).numpy().tolist() == [0, 6, 4, 1, 2, 3, 5]
    assert O.sort(x, descending=True, stable=True).indices.numpy().tolist() == [
        3, 5, 1, 2, 4, 0, 6,
    ]  # fmt: skip


def test_ties_and_nan_match_torch(reference_backend):
    torch = torch_module()
    values = np.array([1.0, 3.0, 3.0, np.nan, 2.0, np.nan, 1.0, 3.0], np.float32)
    x, t = fl.from_numpy(values), torch.from_numpy(values)
    for ours, theirs in (
        (C.cummax(x, 0), t.cummax(0)), (C.cummin(x, 0), t.cummin(0)),
        (O.sort(x, stable=True), t.sort(stable=True)),
        (O.sort(x, descending=True, stable=True), t.sort(descending=True, stable=True)),
    ):  # fmt: skip
        np.testing.assert_array_equal(ours.indices.numpy(), theirs.indices.numpy())
        np.testing.assert_array_equal(ours.values.numpy(), theirs.values.numpy())


def test_integer_and_bool_scans_give_int64_as_torch(reference_backend):
    ints = fl.tensor(np.array([[1, -2, 3], [4, 5, -6]], np.int32))
    total = C.cumsum(ints, 1)
    assert total.dtype is fl.int64
    np.testing.assert_array_equal(total.numpy(), [[1, -1, 2], [4, 9, 3]])
    assert C.cumprod(ints, 0).numpy().tolist() == [[1, -2, 3], [4, -10, -18]]
    flags = fl.tensor(np.array([True, False, True]))
    assert C.cumsum(flags, 0).numpy().tolist() == [1, 1, 2]
    assert C.cumsum(ints, 1, dtype=fl.float32).dtype is fl.float32
    assert O.sort(ints, 1).values.numpy().tolist() == [[-2, 1, 3], [-6, 4, 5]]


def test_zero_dim_and_empty_inputs(reference_backend):
    scalar = fl.tensor(2.5)
    assert C.cumsum(scalar, 0).numpy() == 2.5 and C.cumsum(scalar, -1).shape == ()
    assert C.cummax(scalar, 0).indices.numpy() == 0
    assert O.sort(scalar).values.numpy() == 2.5
    empty = fl.zeros(3, 0)
    assert C.cumsum(empty, 1).shape == (3, 0) and O.sort(empty, 1).values.shape == (3, 0)


def test_logcumsumexp_does_not_overflow(reference_backend):
    values = np.array([1000.0, 1000.0, -1000.0, 1001.0], np.float32)
    result = C.logcumsumexp(fl.from_numpy(values), 0).numpy()
    np.testing.assert_allclose(result, np.logaddexp.accumulate(values.astype(np.float64)))


BAD_INPUT = [
    (lambda x: C.cumsum(x, 2), IndexError, "cumsum: dim 2 is out of range"),
    (lambda x: C.logcumsumexp(x.long(), 0), TypeError, "logcumsumexp: needs a float input"),
    (lambda x: C.cummax(x, -3), IndexError, "cummax: dim -3 is out of range"),
    (lambda x: O.sort(x, 5), IndexError, "sort: dim 5 is out of range"),
    (lambda x: O.topk(x, 5), fl.ShapeError, r"topk: k \(5\) must be in \[0, 4\].*\[3, 4\]"),
    (lambda x: O.topk(x, 4, dim=0), fl.ShapeError, r"topk: k \(4\) must be in \[0, 3\]"),
]


@pytest.mark.parametrize("index", range(len(BAD_INPUT)))
def test_bad_input_raises_at_the_users_line(index, reference_backend):
    build, error, pattern = BAD_INPUT[index]
    with pytest.raises(error, match=pattern) as raised:
        build(fl.zeros(3, 4))
    assert "[at test_api_scan_sort.py:" in str(raised.value)


# --- gpu tier: the library implementations against the reference -------------------------------

GPU_CASES = [
    ("cumsum", lambda x: C.cumsum(x, 1)), ("cumsum_dim0", lambda x: C.cumsum(x, 0)),
    ("cumprod", lambda x: C.cumprod(x * 0.01 + 1.0, 1)),
    ("logcumsumexp", lambda x: C.logcumsumexp(x, 1)),
    ("cummax", lambda x: C.cummax(x, 1).indices), ("cummin", lambda x: C.cummin(x, 0).indices),
    ("argsort", lambda x: O.argsort(x, 1)), ("argsort_desc", lambda x: O.argsort(x, 0, True)),
    ("sort_values", lambda x: O.sort(x, 1).values), ("topk", lambda x: O.topk(x, 5, 1).values),
    ("transposed_cumsum", lambda x: C.cumsum(x.T, 1)),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[case[0] for case in GPU_CASES])
def test_gpu_matches_reference(case, dtype, rng):
    import flame.runtime.library_scan  # noqa: F401  (registers the CUDA implementations)

    _, build = case
    # order-one values: float32 sums taken in another order differ by a few ulps of the sums
    array = rng.standard_normal((64, 300)).astype(np.float32)
    with fl.backend("reference"):
        expected = build(fl.from_numpy(array).to(dtype)).numpy()
    with fl.backend("cuda"):
        actual = build(fl.from_numpy(array).to(dtype)).numpy()
    assert actual.dtype == expected.dtype
    if expected.dtype.kind == "i":
        np.testing.assert_array_equal(actual, expected)
    else:
        tolerance = 2e-4 if dtype == "float32" else 1e-2
        np.testing.assert_allclose(
            actual.astype(np.float64), expected.astype(np.float64), rtol=tolerance, atol=tolerance
        )


@pytest.mark.gpu
def test_gpu_gradients_and_nan_ties_match_reference(rng):
    import flame.runtime.library_scan  # noqa: F401

    values = np.array([[1.0, 3.0, 3.0, np.nan, 2.0, np.nan, 1.0]] * 3, np.float32)
    array = distinct(rng, 8, 40)
    results = {}
    for backend in ("reference", "cuda"):
        with fl.backend(backend):
            x = fl.from_numpy(array)
            x.requires_grad_()
            loss = (C.cumprod(x, 1) + C.logcumsumexp(x, 0) + O.sort(x, 1).values).sum()
            loss.backward()
            tied = fl.from_numpy(values)
            results[backend] = [x.grad.numpy(), C.cummax(tied, 1).indices.numpy(),
                                O.argsort(tied, 1, descending=True).numpy()]  # fmt: skip
    np.testing.assert_allclose(results["cuda"][0], results["reference"][0], rtol=1e-4, atol=1e-5)
    for actual, expected in zip(results["cuda"][1:], results["reference"][1:], strict=True):
        np.testing.assert_array_equal(actual, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, dim", [((3, 20000), 1), ((50000,), 0), ((70000, 2), 0)])
def test_gpu_long_rows_match_reference(shape, dim, rng):
    """Rows long enough to be cut into blocks: ties (small integers) and NaNs across block
    boundaries must follow the same rules as one walk along the row."""
    import flame.runtime.library_scan  # noqa: F401

    ties = rng.integers(-50, 50, shape).astype(np.float32)
    with_nan = ties.copy()
    with_nan.reshape(-1)[rng.choice(with_nan.size, 5, replace=False)] = np.nan
    smooth = rng.standard_normal(shape).astype(np.float32)
    results = {}
    for backend in ("reference", "cuda"):
        with fl.backend(backend):
            results[backend] = [
                C.cummax(fl.from_numpy(ties), dim).indices.numpy(),
                C.cummin(fl.from_numpy(with_nan), dim).indices.numpy(),
                C.cummax(fl.from_numpy(ties.astype(np.int32)), dim).indices.numpy(),
                C.logcumsumexp(fl.from_numpy(smooth), dim).numpy(),
            ]
    for actual, expected in zip(results["cuda"][:3], results["reference"][:3], strict=True):
        np.testing.assert_array_equal(actual, expected)
    np.testing.assert_allclose(results["cuda"][3], results["reference"][3], rtol=1e-5, atol=1e-5)
