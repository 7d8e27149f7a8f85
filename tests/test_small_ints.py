"""int8, uint8 and int16 (issue 18) and views of one dtype's bits as another.

The small integers are FLAME dtypes as in PyTorch: NumPy data keeps them (no widening to
int32), promotion matches ``torch.result_type`` (``uint8 + int8 -> int16``), arithmetic wraps
at every step as PyTorch's does (kernels compute in the type itself), sums widen to int64.
``view(dtype)`` reinterprets bits (``flame/dtype_views.py``)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import flame as fl
from flame import dtype_views
from flame.codegen.lower import lower_group
from flame.codegen.render import render
from flame.ir import dtypes
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.runtime.executor import _layout_of

SMALL = (dtypes.uint8, dtypes.int8, dtypes.int16)


def _operand(dtype, zero_dim: bool):
    return fl.ones(() if zero_dim else (3,), dtype=dtype)


def _data(dtype, size=64):
    info = np.iinfo(dtype.numpy)
    values = np.linspace(info.min, info.max, size).round()
    return values.astype(dtype.numpy)


def sources(*tensors) -> list[str]:
    graph = run_pipeline(Graph(tuple(t.node for t in tensors)))
    return [render(lower_group(group, _layout_of).spec) for group in graph.groups]


# --- dtypes and data ----------------------------------------------------------------------
def test_small_int_names_and_numpy_data(reference_backend):
    for dtype, aliases in zip(SMALL, (("byte",), ("char",), ("short",))):
        for spelling in (dtype.name, np.dtype(dtype.numpy), *aliases):
            assert dtypes.dtype(spelling) is dtype
        array = _data(dtype)
        assert fl.from_numpy(array).dtype is dtype
        assert fl.tensor(array).dtype is dtype
        np.testing.assert_array_equal(fl.from_numpy(array).numpy(), array)


@pytest.mark.skipif(not hasattr(fl, "int8"), reason="flame/__init__.py exports no int8 yet")
def test_flame_exports_the_small_ints():
    assert (fl.uint8, fl.int8, fl.int16) == SMALL


# --- promotion, every pair of FLAME dtypes ------------------------------------------------
def test_promotion_table_is_pytorchs():
    torch = pytest.importorskip("torch", reason="the table is compared with torch.promote_types")
    for left, right in itertools.product(dtypes.ALL, dtypes.ALL):
        theirs = torch.promote_types(getattr(torch, left.name), getattr(torch, right.name))
        assert dtypes.promote(left, right).name == str(theirs).removeprefix("torch.")


@pytest.mark.parametrize("left_zero,right_zero", [(False, False), (False, True), (True, True)])
def test_result_types_match_pytorch(left_zero, right_zero, reference_backend):
    torch = pytest.importorskip("torch", reason="result types are compared with torch")
    for left, right in itertools.product(dtypes.ALL, SMALL):
        pairs = (((left, left_zero), (right, right_zero)), ((right, left_zero), (left, right_zero)))
        for a, b in pairs:
            ours = (_operand(*a) + _operand(*b)).dtype
            theirs = torch.result_type(
                torch.ones(() if a[1] else (3,), dtype=getattr(torch, a[0].name)),
                torch.ones(() if b[1] else (3,), dtype=getattr(torch, b[0].name)),
            )
            assert ours.name == str(theirs).removeprefix("torch."), (a, b)
    for dtype, scalar in itertools.product(SMALL, (True, 2, 2.5)):
        theirs = torch.result_type(torch.ones(3, dtype=getattr(torch, dtype.name)), scalar)
        assert (_operand(dtype, False) + scalar).dtype.name == str(theirs)[len("torch.") :]


def test_promotion_without_pytorch():
    assert dtypes.promote(dtypes.uint8, dtypes.int8) is dtypes.int16
    assert dtypes.promote(dtypes.int8, dtypes.int16) is dtypes.int16
    assert dtypes.promote(dtypes.uint8, dtypes.int32) is dtypes.int32
    assert dtypes.promote(dtypes.bool_, dtypes.uint8) is dtypes.uint8
    assert dtypes.promote(dtypes.int16, dtypes.float16) is dtypes.float16
    assert dtypes.result_type([dtypes.uint8], [dtypes.int64], [7]) is dtypes.uint8


# --- values: wrapping at every step, as PyTorch ------------------------------------------
def test_arithmetic_wraps_like_pytorch(reference_backend):
    unsigned = fl.from_numpy(np.array([1, 2, 200, 255], np.uint8))
    signed = fl.from_numpy(np.array([-128, -1, 100, 127], np.int8))
    np.testing.assert_array_equal((unsigned + 100).numpy(), [101, 102, 44, 99])
    np.testing.assert_array_equal((-unsigned).numpy(), [255, 254, 56, 1])
    np.testing.assert_array_equal((signed * 3).numpy(), [-128, -3, 44, 125])
    np.testing.assert_array_equal(((signed + signed) > 0).numpy(), [False, False, False, False])
    mixed = unsigned + signed
    assert mixed.dtype is dtypes.int16
    np.testing.assert_array_equal(mixed.numpy(), [-127, 1, 300, 382])
    total = unsigned.sum()
    assert total.dtype is dtypes.int64 and int(total.numpy()) == 458
    assert signed.amax().dtype is dtypes.int8 and int(signed.amin().numpy()) == -128


def test_python_scalars_wrap_into_small_ints_like_pytorch(reference_backend):
    unsigned = fl.from_numpy(np.array([1, 2, 250], np.uint8))
    np.testing.assert_array_equal((unsigned + 200).numpy(), [201, 202, 194])
    np.testing.assert_array_equal((unsigned + -1).numpy(), [0, 1, 249])
    np.testing.assert_array_equal(fl.full((2,), 255, dtype=dtypes.uint8).numpy(), [255, 255])
    signed = fl.from_numpy(np.array([1, -2], np.int8))
    np.testing.assert_array_equal((signed + 200).numpy(), [-55, -58])


# --- generated CUDA -----------------------------------------------------------------------
def test_small_int_kernels_compute_in_their_own_type(cuda_backend, nvrtc):
    from flame.runtime.compiler import nvrtc_compile

    signed = fl.from_numpy(_data(dtypes.int8).reshape(4, 16))
    unsigned = fl.from_numpy(_data(dtypes.uint8).reshape(4, 16))
    short = fl.from_numpy(_data(dtypes.int16).reshape(4, 16))
    tensors = ((signed * 3 + 1) > 0, unsigned.amax(1), short.sum(0), (unsigned + signed).float())
    wrapped, peak, total, widened = [sources(tensor)[0] for tensor in tensors]
    assert "const signed char v" in wrapped  # each step stored in int8: wraps as PyTorch
    assert "int acc" in peak and "(-2147483647 - 1)" in peak  # max in an int
    assert "long long acc" in total
    assert "const short v" in widened
    for source in (wrapped, peak, total, widened):
        name = source.split("void __launch_bounds__(")[1].split(") ")[1].split("(")[0]
        assert nvrtc_compile(source, name, "sm_90")[:4] == b"\x7fELF", name


# --- view(dtype), type(dtype) ---------------------------------------------------------------
def test_view_reinterprets_bits_of_equal_size(reference_backend):
    values = np.array([[1.5, -2.0], [0.0, np.inf]], np.float32)
    viewed = dtype_views.view_dtype(fl.from_numpy(values), dtypes.int32)
    assert viewed.dtype is dtypes.int32 and viewed.shape == (2, 2)
    np.testing.assert_array_equal(viewed.numpy(), values.view(np.int32))
    back = dtype_views.view_dtype(viewed, "float32")
    np.testing.assert_array_equal(back.numpy(), values)
    unsigned = dtype_views.view_dtype(fl.from_numpy(np.array([-1, 5], np.int8)), dtypes.uint8)
    np.testing.assert_array_equal(unsigned.numpy(), [255, 5])


def test_view_of_another_size_scales_the_last_axis(reference_backend):
    values = np.arange(24, dtype=np.float32).reshape(4, 6)
    halves = dtype_views.view_dtype(fl.from_numpy(values), dtypes.int16)
    assert halves.shape == (4, 12)
    np.testing.assert_array_equal(halves.numpy(), values.view(np.int16))
    doubles = dtype_views.view_dtype(fl.from_numpy(values), dtypes.float64)
    assert doubles.shape == (4, 3)
    np.testing.assert_array_equal(doubles.numpy(), values.view(np.float64))
    computed = dtype_views.view_dtype(fl.from_numpy(values) * 2.0, dtypes.uint8)
    np.testing.assert_array_equal(computed.numpy(), (values * 2).view(np.uint8))


def test_view_refuses_what_pytorch_refuses(reference_backend):
    odd = fl.from_numpy(np.zeros((2, 3), np.int16))
    with pytest.raises(RuntimeError, match="6 bytes, not a multiple of 4"):
        dtype_views.view_dtype(odd, dtypes.float32)
    with pytest.raises(RuntimeError, match="0-dimensional"):
        dtype_views.view_dtype(fl.tensor(1.0), dtypes.int16)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        dtype_views.view_dtype(fl.from_numpy(np.zeros((4, 4), np.float32).T), dtypes.int16)


def test_view_dtype_argument_is_told_from_sizes():
    assert dtype_views.is_dtype(dtypes.int8) and dtype_views.is_dtype(np.float32)
    assert dtype_views.is_dtype(np.dtype("int16"))
    assert not dtype_views.is_dtype(3) and not dtype_views.is_dtype((2, 3))
    torch = pytest.importorskip("torch")
    assert dtype_views.is_dtype(torch.float64) and not dtype_views.is_dtype(torch.Size([2]))


def test_byte_char_short_methods(reference_backend):
    x = fl.from_numpy(np.array([-3.7, 300.0, 2.5], np.float32))
    assert x.short().dtype is dtypes.int16 and x.short().numpy().tolist() == [-3, 300, 2]
    assert x.char().dtype is dtypes.int8 and x.byte().dtype is dtypes.uint8


def test_small_ints_through_dlpack(reference_backend):
    torch = pytest.importorskip("torch", reason="exchanged with PyTorch tensors")
    for dtype in SMALL:
        source = torch.arange(-4, 4).to(getattr(torch, dtype.name))
        imported = fl.from_dlpack(source)
        assert imported.dtype is dtype
        np.testing.assert_array_equal(imported.numpy(), source.numpy())
    wide = torch.linspace(-1, 1, 5, dtype=torch.float64) / 3
    assert fl.from_dlpack(wide).dtype is dtypes.float64
    np.testing.assert_array_equal(fl.from_dlpack(wide).numpy(), wide.numpy())


def test_type_casts_and_names(reference_backend):
    x = fl.from_numpy(np.array([-3, 7], np.int16))
    assert dtype_views.type_(x) == "flame.ShortTensor"
    assert dtype_views.type_(x, "torch.ByteTensor").numpy().tolist() == [253, 7]
    assert dtype_views.type_(x, dtypes.int8).dtype is dtypes.int8


# --- GPU tier ------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_small_int_arithmetic_matches_numpy(cuda_backend):
    for dtype in SMALL:
        array = _data(dtype, 1000)
        x = fl.from_numpy(array)
        with np.errstate(all="ignore"):
            expected = (array * array.dtype.type(3) + array.dtype.type(1)).astype(dtype.numpy)
        np.testing.assert_array_equal((x * 3 + 1).numpy(), expected)
        np.testing.assert_array_equal(x.sum().numpy(), array.astype(np.int64).sum())
        rows = array.reshape(10, 100)
        np.testing.assert_array_equal(x.reshape(10, 100).amax(1).numpy(), rows.max(1))
        np.testing.assert_array_equal(x.float().numpy(), array.astype(np.float32))


@pytest.mark.gpu
def test_gpu_views_share_memory(cuda_backend):
    values = np.linspace(-2, 2, 64, dtype=np.float32).reshape(8, 8)
    viewed = dtype_views.view_dtype(fl.from_numpy(values), dtypes.int16)
    np.testing.assert_array_equal(viewed.numpy(), values.view(np.int16))
    bf16 = dtype_views.view_dtype(fl.from_numpy(values.view(np.int16)), dtypes.bfloat16)
    assert bf16.shape == (8, 16)
    expected = values.view(np.int16).view(dtypes.bfloat16.numpy).astype(np.float32)
    np.testing.assert_array_equal(bf16.to(dtypes.float32).numpy(), expected)
