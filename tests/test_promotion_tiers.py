"""PyTorch's result types, three tiers deep: tensors with dimensions, zero-dimensional tensors,
Python numbers (flame/ir/dtypes.py, ``result_type``). Checked for every pair of dtypes in every
pairing of ranks and with each kind of Python number, against a table written from PyTorch's
rules here and against PyTorch itself where it is importable."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import flame as fl
from flame.ir import dtypes

DTYPES = (fl.bool_, fl.int32, fl.int64, fl.float16, fl.bfloat16, fl.float32)


def _operand(dtype, zero_dim: bool):
    shape = () if zero_dim else (3,)
    return fl.ones(shape, dtype=dtype)


@pytest.mark.parametrize("left_zero,right_zero", [(False, False), (False, True), (True, True)])
def test_tensor_pairs_match_pytorch(left_zero, right_zero, reference_backend):
    torch = pytest.importorskip("torch")
    for left, right in itertools.product(DTYPES, DTYPES):
        ours = (_operand(left, left_zero) + _operand(right, right_zero)).dtype
        theirs = torch.result_type(
            torch.ones((() if left_zero else (3,)), dtype=getattr(torch, left.name)),
            torch.ones((() if right_zero else (3,)), dtype=getattr(torch, right.name)),
        )
        assert ours.name == str(theirs).removeprefix("torch."), (left, left_zero, right, right_zero)


@pytest.mark.parametrize("scalar", [True, 2, 2.5])
def test_tensor_and_python_number_match_pytorch(scalar, reference_backend):
    torch = pytest.importorskip("torch")
    for dtype, zero_dim in itertools.product(DTYPES, (False, True)):
        ours = (_operand(dtype, zero_dim) + scalar).dtype
        theirs = torch.result_type(
            torch.ones((() if zero_dim else (3,)), dtype=getattr(torch, dtype.name)), scalar
        )
        assert ours.name == str(theirs).removeprefix("torch."), (dtype, zero_dim, scalar)


def test_zero_dim_tensors_are_weak_without_pytorch(reference_backend):
    # the rules spelled out, for machines without PyTorch
    cases = [
        ((fl.float16, False), (fl.float32, True), fl.float16),
        ((fl.int32, False), (fl.int64, True), fl.int32),
        ((fl.int32, False), (fl.float16, True), fl.float16),
        ((fl.bool_, False), (fl.int32, True), fl.int32),
        ((fl.bfloat16, False), (fl.float16, True), fl.bfloat16),
        ((fl.float16, True), (fl.bfloat16, True), fl.float32),
        ((fl.float16, False), (fl.bfloat16, False), fl.float32),
    ]
    for (left, left_zero), (right, right_zero), expected in cases:
        for a, b in (
            ((left, left_zero), (right, right_zero)),
            ((right, right_zero), (left, left_zero)),
        ):
            got = (_operand(*a) + _operand(*b)).dtype
            assert got is expected, (a, b, got)
    assert dtypes.result_type([], [fl.int32], [2.5]) is fl.float32
    assert dtypes.result_type([fl.float16], [], [True, 3]) is fl.float16


def test_zero_dim_operand_values_and_where(reference_backend):
    halves = fl.tensor(np.array([1.5, -2.0, 4.0], dtype=np.float16))
    scale = fl.tensor(np.float32(3.0))
    product = halves * scale
    assert product.dtype is fl.float16
    np.testing.assert_array_equal(product.numpy(), np.array([4.5, -6.0, 12.0], np.float16))
    chosen = fl.where(halves > 0, halves, scale)
    assert chosen.dtype is fl.float16
    np.testing.assert_array_equal(chosen.numpy(), np.array([1.5, 3.0, 4.0], np.float16))
