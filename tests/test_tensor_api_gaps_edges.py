"""Edge cases and errors of the PyTorch tensor methods and functions FLAME lacked (the
values and gradients of their usual cases are in tests/test_tensor_api_gaps.py): 0-d and
empty inputs, special values, dtypes against PyTorch, the layout metadata, and the errors bad
input raises when the op is built, at the user's line."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from opinfo import assert_user_error

import flame as fl

HERE = "test_tensor_api_gaps_edges.py"


def torch_module():
    return pytest.importorskip("torch", reason="PyTorch is the reference for these checks")


def normal(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


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
