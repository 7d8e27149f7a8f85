"""NumPy/PyTorch advanced indexing: several index tensors mixed with ints, slices, None and
Ellipsis, bool masks; values against NumPy, gradients against PyTorch (issue 18)."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl

ROWS = np.array([0, 2, -1])
COLS = np.array([[1], [3]])
CASES = {
    "one tensor": lambda i: (i(ROWS),),
    "two tensors broadcast": lambda i: (i(ROWS), i(COLS)),
    "tensor, slice, tensor (apart)": lambda i: (i(ROWS), slice(None), i(np.array([0, 1, 4]))),
    "slice then two adjacent": lambda i: (slice(1, 3), i(ROWS[:2]), i(np.array([1, 0]))),
    "int beside a tensor": lambda i: (1, i(ROWS)),
    "int apart from a tensor": lambda i: (1, slice(None), i(np.array([0, 2]))),
    "ellipsis and none": lambda i: (Ellipsis, None, i(np.array([4, 0]))),
    "list": lambda i: ([0, 1], slice(None, None, 2)),
    "bool mask": lambda i: (i(np.array([True, False, True])),),
    "2-d bool mask": lambda i: (i(np.arange(12).reshape(3, 4) % 5 == 0),),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_advanced_indexing_matches_numpy(backend, rng, name):
    values = rng.standard_normal((3, 4, 5)).astype(np.float32)
    expected = values[CASES[name](np.asarray)]
    actual = fl.tensor(values)[
        CASES[name](lambda a: fl.tensor(a) if isinstance(a, np.ndarray) else a)
    ]
    assert actual.shape == expected.shape
    np.testing.assert_array_equal(actual.numpy(), expected)


@pytest.mark.parametrize("name", sorted(CASES))
def test_advanced_indexing_gradient_matches_pytorch(rng, name):
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle of this test")
    values = rng.standard_normal((3, 4, 5)).astype(np.float32)
    with fl.backend("reference"):
        x = fl.tensor(values).requires_grad_()
        out = x[CASES[name](lambda a: fl.tensor(a) if isinstance(a, np.ndarray) else a)]
        (out * out).sum().backward()
    tx = torch.tensor(values, requires_grad=True)
    tout = tx[CASES[name](lambda a: torch.tensor(a) if isinstance(a, np.ndarray) else a)]
    (tout * tout).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-6)


def test_bad_indices_raise_index_errors(backend):
    x = fl.zeros(3, 4)
    with pytest.raises(IndexError, match="could not be broadcast"):
        x[fl.tensor(np.array([0, 1])), fl.tensor(np.array([0, 1, 2]))]
    with pytest.raises(IndexError, match="integer or bool"):
        x[fl.tensor(np.array([0.5]))]
    with pytest.raises(IndexError, match="too many indices"):
        x[fl.tensor(np.array([0])), 1, 2]
