"""Elementwise ops on the GPU (the ``gpu`` tier): every op of the registry at every dtype it
accepts, against the float64 oracle; random numbers and iota; shared work; kernel reuse
across sizes; zero-copy exchange with PyTorch and CuPy."""

from __future__ import annotations

import numpy as np
import pytest
from opinfo import (
    FLOAT_DTYPES,
    VARIANTS,
    build,
    params,
    special_arrays,
    special_attr_samples,
    tensors,
    variant_outputs,
)

import flame as fl
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.runtime import reference
from flame.runtime.compiler import default_kernel_cache

pytestmark = pytest.mark.gpu

# (rtol, atol) per result dtype. float32: the GPU's expf, tanhf, erff, ... are within a few
# ulp; float16/bfloat16 are computed in float32 and rounded once. Ints and bools: exact.
TOLERANCE = {"float32": (1e-5, 1e-6), "float16": (1e-3, 1e-5), "bfloat16": (8e-3, 1e-4)}
NARROW_EPSILON = {"float16": 2.0**-10, "bfloat16": 2.0**-7}
CHAIN_ATOL = 1e-5  # float32 expressions of several ops: a few ulp each, near-zero results


def oracle(tensors) -> list[np.ndarray]:
    """Every value from the data leaves up, in float64, whatever the GPU already did."""
    return reference.evaluate([t.node for t in tensors], precision=np.float64, realized=False)


def assert_close(actual: np.ndarray, expected, dtype_name: str, what: str = "", atol=None):
    if dtype_name not in TOLERANCE:
        np.testing.assert_array_equal(actual, expected.astype(actual.dtype), err_msg=what)
        return
    rtol, dtype_atol = TOLERANCE[dtype_name]
    atol = dtype_atol if atol is None else atol
    np.testing.assert_allclose(
        actual.astype(np.float64), expected, rtol=rtol, atol=atol, equal_nan=True, err_msg=what
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("case", params())
def test_op_matches_float64_oracle(case, variant, cuda_backend, rng):
    for attrs in case.attr_samples():
        outputs = variant_outputs(case, variant, attrs, rng)
        expected = oracle(outputs)
        fl.realize(*outputs)
        for position, (tensor, value) in enumerate(zip(outputs, expected, strict=True)):
            what = f"{case.id} {variant} {attrs} output {position}"
            assert tensor.is_realized, what
            assert tensor.numpy().shape == tensor.shape, what
            assert_close(tensor.numpy(), value, tensor.dtype.name, what)


@pytest.mark.parametrize("case", params(dtypes=FLOAT_DTYPES))
def test_special_values_match_float64_oracle(case, cuda_backend):
    """NaN, infinities and signed zeros give what the reference gives."""
    arrays = special_arrays(case)
    for attrs in special_attr_samples(case):
        result = build(case.op.name, tensors(arrays), attrs)
        expected = oracle([result])[0]
        inputs = ", ".join(f"{array.tolist()}" for array in arrays)
        assert_close(result.numpy(), expected, result.dtype.name, f"{case.id}({inputs})")


# --- generated leaves -----------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 7, 4099, 2**20 + 5])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda dtype: dtype.name)
def test_rand_and_randn_match_reference(dtype, size, cuda_backend):
    uniform = fl.rand(size, seed=1234, dtype=dtype)
    normal = fl.randn(size, seed=99, dtype=dtype)
    shifted = fl.randn(size, seed=99, dtype=dtype) * 2 + 1  # generated inside a consumer
    expected = oracle([uniform, normal, shifted])
    fl.realize(uniform, normal, shifted)
    np.testing.assert_array_equal(uniform.numpy().astype(np.float64), expected[0])
    # GPU logf/cosf and NumPy's differ by a few float32 ulp; where that straddles a rounding
    # boundary of a narrow dtype the stored value moves by one of its ulp (times 2 after * 2).
    epsilon = (
        float(np.finfo(np.float32).eps) * 8 if dtype is fl.float32 else NARROW_EPSILON[dtype.name]
    )
    for tensor, value in zip((normal, shifted), expected[1:], strict=True):
        actual = tensor.numpy().astype(np.float64)
        np.testing.assert_allclose(actual, value, rtol=2 * epsilon, atol=8 * epsilon)
    values = uniform.numpy().astype(np.float64)
    assert values.min() >= 0 and values.max() <= 1
    if size > 2**20:  # and the numbers look like what they claim to be
        assert abs(values.mean() - 0.5) < 5e-3
        gaussian = normal.numpy().astype(np.float64)
        assert abs(gaussian.mean()) < 1e-2 and abs(gaussian.std() - 1) < 1e-2


@pytest.mark.parametrize(
    "start, end, step, dtype",
    [
        (0, 2**20 + 7, 1, None),
        (5, -40, -3, None),
        (0.5, 300.0, 0.25, None),
        (0, 1000, 1, "float16"),
    ],
)
def test_arange_matches_reference_and_numpy(start, end, step, dtype, cuda_backend):
    values = fl.arange(start, end, step, dtype=dtype)
    plus_one = fl.arange(start, end, step, dtype=dtype) + 1
    expected = oracle([values, plus_one])
    fl.realize(values, plus_one)
    assert_close(values.numpy(), expected[0], values.dtype.name)
    assert_close(plus_one.numpy(), expected[1], plus_one.dtype.name)
    np.testing.assert_allclose(values.numpy().astype(np.float64), np.arange(start, end, step))


# --- schedules --------------------------------------------------------------------------------


def test_realize_two_outputs_computes_shared_work_once(cuda_backend, rng):
    array = rng.standard_normal((64, 300)).astype(np.float32)
    shared = fl.exp(fl.tanh(fl.from_numpy(array))) * 3
    first, second = shared + 1, fl.sin(shared)
    graph = run_pipeline(Graph((first.node, second.node)))
    assert len(graph.groups) == 1, "two outputs of one shape share one kernel"
    assert {id(node) for node in graph.groups[0].outputs} == {id(first.node), id(second.node)}
    fl.realize(first, second)
    reference_shared = np.exp(np.tanh(array.astype(np.float64))) * 3
    assert_close(first.numpy(), reference_shared + 1, "float32", atol=CHAIN_ATOL)
    assert_close(second.numpy(), np.sin(reference_shared), "float32", atol=CHAIN_ATOL)


def test_realize_outputs_of_different_shapes(cuda_backend, rng):
    rows = fl.from_numpy(rng.standard_normal((48, 1)).astype(np.float32))
    columns = fl.from_numpy(rng.standard_normal((33,)).astype(np.float32))
    small = fl.gelu(rows).sigmoid() * 2 - 1
    large = small * columns + fl.cos(columns)
    expected = oracle([small, large])
    fl.realize(large, small)
    assert_close(small.numpy(), expected[0], "float32", atol=CHAIN_ATOL)
    assert_close(large.numpy(), expected[1], "float32", atol=CHAIN_ATOL)


def reused_expression(rows, columns, rng) -> tuple[fl.Tensor, np.ndarray]:
    """``tanh(x * 2 + bias)`` over ``[rows, columns]`` and its float64 value."""
    x = rng.standard_normal((rows, columns)).astype(np.float32)
    bias = rng.standard_normal(columns).astype(np.float32)
    result = fl.tanh(fl.from_numpy(x) * 2 + fl.from_numpy(bias)).realize()
    return result, np.tanh(x.astype(np.float64) * 2 + bias)


def test_new_sizes_reuse_compiled_kernels(cuda_backend, rng):
    stats = default_kernel_cache().stats
    result, expected = reused_expression(256, 512, rng)
    assert_close(result.numpy(), expected, "float32", atol=CHAIN_ATOL)
    flat = fl.from_numpy(rng.standard_normal(1000).astype(np.float32))
    fl.sigmoid(flat).realize()
    before = (stats.compiles, stats.disk_hits)
    for rows, columns in [(128, 1024), (512, 256), (1000, 64), (3, 4096)]:
        result, expected = reused_expression(rows, columns, rng)
        assert_close(result.numpy(), expected, "float32", f"[{rows}, {columns}]", CHAIN_ATOL)
    for size in (1003, 5, 2**20 + 1):
        array = rng.standard_normal(size).astype(np.float32)
        assert_close(fl.sigmoid(fl.from_numpy(array)).numpy(), 1 / (1 + np.exp(-array)), "float32")
    assert (stats.compiles, stats.disk_hits) == before, "a new size needed a new kernel"


# --- exchange with PyTorch and CuPy -------------------------------------------------------

EXCHANGE_DTYPES = ["float32", "float16", "int32", "int64", "bool"]


def data_pointer(tensor: fl.Tensor) -> int:
    return tensor.__cuda_array_interface__["data"][0]


def torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA device")
    return torch


@pytest.mark.parametrize("dtype_name", EXCHANGE_DTYPES)
def test_torch_round_trip_is_zero_copy(dtype_name, cuda_backend):
    torch = torch_cuda()
    source = (torch.arange(24, device="cuda").reshape(4, 6) % 5).to(getattr(torch, dtype_name))
    tensor = fl.from_dlpack(source)
    assert (tensor.backend, tensor.shape, tensor.dtype.name) == ("cuda", (4, 6), dtype_name)
    assert data_pointer(tensor) == source.data_ptr()
    np.testing.assert_array_equal(tensor.numpy(), source.cpu().numpy())
    result = fl.maximum(tensor, tensor).realize()  # a FLAME kernel reads torch's memory
    back = torch.from_dlpack(result)
    assert back.data_ptr() == data_pointer(result)
    assert back.dtype == source.dtype and tuple(back.shape) == (4, 6)
    np.testing.assert_array_equal(back.cpu().numpy(), source.cpu().numpy())


@pytest.mark.parametrize("dtype_name", EXCHANGE_DTYPES)
def test_cupy_round_trip_is_zero_copy(dtype_name, cuda_backend):
    cupy = pytest.importorskip("cupy")
    source = (cupy.arange(30).reshape(5, 6) % 4).astype(dtype_name)
    tensor = fl.from_dlpack(source)
    assert data_pointer(tensor) == source.data.ptr
    result = fl.minimum(tensor, tensor).realize()
    for view in (cupy.asarray(result), cupy.from_dlpack(result)):
        assert view.data.ptr == data_pointer(result)
        assert view.dtype == np.dtype(dtype_name) and view.shape == (5, 6)
        np.testing.assert_array_equal(cupy.asnumpy(view), cupy.asnumpy(source))


def test_strided_and_offset_views_are_read_in_place(cuda_backend):
    """Transposed, sliced (16-byte misaligned) and reversed views: no copy, right values."""
    cupy = pytest.importorskip("cupy")
    base = cupy.arange(8 * 12, dtype=cupy.float32).reshape(8, 12)
    views = {
        "transposed": base.T,
        "misaligned": base[:, 1:],
        "every-other": base[::2, ::3],
        "reversed": base[::-1],
    }
    for name, view in views.items():
        tensor = fl.from_dlpack(view)
        assert data_pointer(tensor) == view.data.ptr, name
        result = (fl.sqrt(tensor) + tensor * 2).numpy()
        host = cupy.asnumpy(view).astype(np.float64)
        assert_close(result, np.sqrt(host) + host * 2, "float32", name, CHAIN_ATOL)


def test_bfloat16_has_no_cuda_array_interface(cuda_backend):
    """The CUDA array interface has no bfloat16 type: FLAME says so instead of lying."""
    tensor = fl.from_numpy(np.ones(4, np.float32)).bfloat16().realize()
    with pytest.raises(AttributeError, match="bfloat16"):
        tensor.__cuda_array_interface__  # noqa: B018
    np.testing.assert_array_equal(tensor.numpy().astype(np.float32), np.ones(4, np.float32))
