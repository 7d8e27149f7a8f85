"""scatter, scatter_reduce (sum, mean), nonzero and masked_select against PyTorch (issue 18),
values and gradients, on the reference backend and on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="PyTorch is the oracle of these tests")


def test_scatter_without_repeats_matches_pytorch(backend, torch, rng):
    base = rng.standard_normal((4, 5)).astype(np.float32)
    src = rng.standard_normal((2, 5)).astype(np.float32)
    index = np.array([[0, 1, 2, 3, 0], [2, 3, 0, 1, 3]], dtype=np.int64)
    x, s = fl.tensor(base).requires_grad_(), fl.tensor(src).requires_grad_()
    out = fl.scatter(x, 0, fl.tensor(index), s)
    (out * out).sum().backward()
    tx, ts = torch.tensor(base, requires_grad=True), torch.tensor(src, requires_grad=True)
    tout = torch.scatter(tx, 0, torch.tensor(index), ts)
    (tout * tout).sum().backward()
    np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), rtol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-6)
    np.testing.assert_allclose(s.grad.numpy(), ts.grad.numpy(), rtol=1e-6)
    filled = fl.scatter(fl.tensor(base), 1, fl.tensor(index[:, :2]), value=9.0).numpy()
    expected = torch.scatter(torch.tensor(base), 1, torch.tensor(index[:, :2]), 9.0).numpy()
    np.testing.assert_array_equal(filled, expected)


@pytest.mark.parametrize("reduce", ["sum", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce_matches_pytorch(backend, torch, rng, reduce, include_self):
    base = rng.standard_normal((3, 4)).astype(np.float32)
    src = rng.standard_normal((5, 4)).astype(np.float32)
    index = rng.integers(0, 2, size=(5, 4))  # row 2 never hit: include_self matters there
    x, s = fl.tensor(base).requires_grad_(), fl.tensor(src).requires_grad_()
    out = fl.scatter_reduce(x, 0, fl.tensor(index), s, reduce, include_self=include_self)
    out.pow(2).sum().backward()
    tx, ts = torch.tensor(base, requires_grad=True), torch.tensor(src, requires_grad=True)
    tout = torch.scatter_reduce(tx, 0, torch.tensor(index), ts, reduce, include_self=include_self)
    tout.pow(2).sum().backward()
    np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s.grad.numpy(), ts.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_scatter_reduce_refuses_an_unknown_reduction(backend):
    with pytest.raises(ValueError, match="'median' is not supported"):
        fl.scatter_reduce(fl.zeros(3), 0, fl.zeros(2, dtype=fl.int64), fl.ones(2), "median")


def test_nonzero_and_masked_select(backend, rng):
    values = rng.standard_normal((3, 4)).astype(np.float32)
    values[values < 0.2] = 0
    x = fl.tensor(values).requires_grad_()
    np.testing.assert_array_equal(fl.nonzero(x).numpy(), np.argwhere(values))
    rows, cols = fl.nonzero(x, as_tuple=True)
    np.testing.assert_array_equal(rows.numpy(), np.nonzero(values)[0])
    np.testing.assert_array_equal(cols.numpy(), np.nonzero(values)[1])
    chosen = values > np.median(values)  # some, not all
    picked = fl.masked_select(x, fl.tensor(chosen))
    np.testing.assert_array_equal(picked.numpy(), values[chosen])
    (picked * 3).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.where(chosen, 3.0, 0.0))
    x.grad = None  # nothing selected: an empty result, and a zero gradient
    empty = fl.masked_select(x, fl.tensor(np.zeros((3, 4), dtype=bool)))
    assert empty.shape == (0,)
    (empty * 3).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros((3, 4), np.float32))
    row_mask = fl.tensor(np.array([True, False, True, False]))  # broadcast over rows
    np.testing.assert_array_equal(x.masked_select(row_mask).numpy(), values[:, [0, 2]].reshape(-1))
