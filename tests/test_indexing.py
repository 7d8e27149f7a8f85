"""Indexing ops: the references against PyTorch and NumPy at every dtype, build-time errors,
out-of-range indices (IndexError on the reference backend; on the GPU zeros / dropped, and
the IndexError at the next read),
fusion boundaries, the generated kernels compiled with NVRTC, and (gpu tier) the kernels
against the float64 oracle, transposed views included."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
from flame.indexing import (
    embedding,
    gather,
    index_select,
    index_tensor,
    masked_fill,
    one_hot,
    scatter_add,
    take_along_dim,
)  # fmt: skip
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.runtime import indexing_kernels, reference

DATA_DTYPES = (fl.float32, fl.float16, fl.bfloat16, fl.int32, fl.int64, fl.bool_)
INDEX_DTYPES = (fl.int32, fl.int64)
SCATTER_DTYPES = (fl.float32, fl.float16, fl.bfloat16, fl.int32, fl.int64)


def values(rng, shape, dtype) -> np.ndarray:
    if dtype.is_bool:
        return rng.random(shape) < 0.5
    if dtype.is_int:
        return rng.integers(-50, 50, shape).astype(dtype.numpy)
    return rng.standard_normal(shape).astype(np.float32).astype(dtype.numpy)


def positions(rng, shape, size, dtype=fl.int64) -> np.ndarray:
    return rng.integers(0, size, shape).astype(dtype.numpy)


def to_torch(array: np.ndarray):
    torch = pytest.importorskip("torch")
    if array.dtype == fl.bfloat16.numpy:
        return torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array))


def from_torch(tensor) -> np.ndarray:
    import torch

    if tensor.dtype in (torch.bfloat16, torch.float16):
        return tensor.float().numpy()
    return tensor.numpy()


def assert_equal(result: fl.Tensor, expected: np.ndarray) -> None:
    actual = result.numpy()
    if result.dtype in (fl.bfloat16, fl.float16):
        actual = actual.astype(np.float32)
    assert actual.shape == expected.shape
    np.testing.assert_array_equal(actual, expected)


def tensors(*arrays):
    return [fl.from_numpy(np.asarray(array)) for array in arrays]


dtype_id = str  # ids like flame.float32


# --- the references against PyTorch --------------------------------------------------------


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("dtype", DATA_DTYPES, ids=dtype_id)
def test_gather_matches_torch(dtype, index_dtype, dim, reference_backend, rng):
    torch = pytest.importorskip("torch")
    source = values(rng, (4, 5, 6), dtype)
    shape = [size - 1 for size in source.shape]
    shape[dim] = 7
    index = positions(rng, shape, source.shape[dim], index_dtype)
    expected = torch.gather(to_torch(source), dim, to_torch(index).long())
    data, idx = tensors(source, index)
    assert_equal(gather(data, dim, idx), from_torch(expected))
    assert_equal(data.gather(dim, idx), from_torch(expected))


@pytest.mark.parametrize("dim", [0, 2])
@pytest.mark.parametrize("dtype", DATA_DTYPES, ids=dtype_id)
def test_index_select_matches_torch(dtype, dim, reference_backend, rng):
    torch = pytest.importorskip("torch")
    source = values(rng, (4, 5, 6), dtype)
    for index in (positions(rng, (9,), source.shape[dim]), np.array(2)):
        expected = torch.index_select(to_torch(source), dim, to_torch(index))
        assert_equal(index_select(*tensors(source)[:1], dim, *tensors(index)), from_torch(expected))


@pytest.mark.parametrize(
    "source_shape, index_shape, dim",
    [((4, 1, 6), (1, 5, 3), 2), ((4, 5), (4, 2), 1), ((4, 5, 6), (2, 3), None)],
)
def test_take_along_dim_matches_torch(source_shape, index_shape, dim, reference_backend, rng):
    torch = pytest.importorskip("torch")
    source = values(rng, source_shape, fl.float32)
    size = int(np.prod(source_shape)) if dim is None else source_shape[dim]
    low = 0 if dim is None else -size  # as torch: negative entries wrap only along a dim
    index = rng.integers(low, size, index_shape)
    expected = torch.take_along_dim(to_torch(source), to_torch(index), dim)
    assert_equal(take_along_dim(*tensors(source, index), dim), from_torch(expected))


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("dtype", SCATTER_DTYPES, ids=dtype_id)
def test_scatter_add_matches_torch(dtype, dim, reference_backend, rng):
    torch = pytest.importorskip("torch")
    target, source = values(rng, (5, 6), dtype), values(rng, (7, 8), dtype)
    shape = [4, 5]
    shape[dim] = 7
    index = positions(rng, shape, 5 if dim == 0 else 6)  # many repeats
    result = scatter_add(*tensors(target), dim, *tensors(index, source))
    if (
        dtype.is_float and dtype is not fl.float32
    ):  # torch sums in the narrow type: compare in float64
        expected = target.astype(np.float64)
        coordinates = list(np.indices(index.shape, sparse=True))
        coordinates[dim] = index
        np.add.at(expected, tuple(coordinates), source[: shape[0], : shape[1]].astype(np.float64))
        tolerance = 2.0**-7 if dtype is fl.bfloat16 else 2.0**-10
        np.testing.assert_allclose(
            result.numpy().astype(np.float64), expected, rtol=tolerance, atol=tolerance
        )
        return
    expected = torch.scatter_add(to_torch(target), dim, to_torch(index), to_torch(source))
    np.testing.assert_allclose(result.numpy(), from_torch(expected), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("dtype", (fl.float32, fl.bfloat16), ids=dtype_id)
def test_embedding_matches_torch(dtype, index_dtype, reference_backend, rng):
    torch = pytest.importorskip("torch")
    weight = values(rng, (10, 4), dtype)
    ids = positions(rng, (3, 5), 10, index_dtype)
    expected = torch.nn.functional.embedding(to_torch(ids).long(), to_torch(weight))
    assert_equal(embedding(*tensors(ids, weight)), from_torch(expected))
    assert_equal(embedding(*tensors(ids, weight), padding_idx=-1), from_torch(expected))


def test_one_hot_matches_torch(reference_backend):
    torch = pytest.importorskip("torch")
    labels = np.array([[0, 3], [2, 1]])
    for classes in (-1, 6):
        expected = torch.nn.functional.one_hot(torch.from_numpy(labels), classes).numpy()
        result = one_hot(*tensors(labels), classes)
        assert result.dtype is fl.int64
        assert_equal(result, expected)
    with pytest.raises(ValueError, match="empty"):
        one_hot(fl.from_numpy(np.zeros(0, np.int64)))


def test_masked_fill_matches_torch_and_stays_elementwise(reference_backend, rng):
    pytest.importorskip("torch")
    source, mask = values(rng, (3, 4), fl.float32), rng.random((4,)) < 0.5
    data, condition = tensors(source, mask)
    for value in (-1.5, fl.from_numpy(np.array(2.0, np.float32))):
        torch_value = 2.0 if isinstance(value, fl.Tensor) else value
        expected = to_torch(source).masked_fill(to_torch(mask), torch_value).numpy()
        result = data.masked_fill(condition, value)
        assert result.node.op == "where"  # elementwise: it fuses
        assert_equal(result, expected)
    integers = fl.from_numpy(np.array([1, 2, 3], np.int32))
    filled = masked_fill(integers, fl.from_numpy(np.array([True, False, True])), 1.5)
    assert filled.dtype is fl.int32 and filled.tolist() == [1, 2, 1]  # as torch: cast to int


def test_index_tensor_wraps_negative_entries(reference_backend, rng):
    source = values(rng, (5, 3), fl.float32)
    index = np.array([[0, -1], [2, 4]])
    assert_equal(index_tensor(fl.from_numpy(source), fl.from_numpy(index)), source[index])
    assert_equal(index_tensor(fl.from_numpy(source), [-5, 1]), source[[-5, 1]])


# --- build-time errors -----------------------------------------------------------------------


def floats(*shape):
    return fl.from_numpy(np.zeros(shape, np.float32))


def longs(*shape):
    return fl.from_numpy(np.zeros(shape, np.int64))


def bools(*shape):
    return fl.from_numpy(np.zeros(shape, bool))


# case: (build, error type, words the message holds)
BAD_BUILDS = {
    "gather-rank": (lambda: gather(floats(4, 5), 1, longs(3)), fl.ShapeError, "number of dims"),
    "gather-float-index": (lambda: gather(floats(4), 0, floats(4)), TypeError, "int32 or int64"),
    "gather-dim": (lambda: gather(floats(4, 5), 2, longs(4, 5)), IndexError, "dim 2"),
    "gather-larger": (lambda: gather(floats(4, 5), 1, longs(6, 2)), fl.ShapeError, "larger"),
    "index_select-2d": (lambda: index_select(floats(4), 0, longs(2, 2)), fl.ShapeError, "1-d"),
    "take_along-broadcast": (
        lambda: take_along_dim(floats(4, 5), longs(3, 2), 1),
        fl.ShapeError,
        "broadcast",
    ),
    "scatter-dtype": (
        lambda: scatter_add(floats(4), 0, longs(2), longs(2)),
        TypeError,
        "one dtype",
    ),
    "scatter-src": (
        lambda: scatter_add(floats(4, 4), 0, longs(2, 3), floats(2, 2)),
        fl.ShapeError,
        "src",
    ),
    "scatter-bool": (lambda: scatter_add(bools(3), 0, longs(2), bools(2)), TypeError, "bool"),
    "embedding-weight": (lambda: embedding(longs(3), floats(2, 3, 4)), fl.ShapeError, "2-d"),
    "embedding-ids": (lambda: embedding(floats(3), floats(2, 3)), TypeError, "int32 or int64"),
    "one_hot-float": (lambda: one_hot(floats(3), 4), TypeError, "int32 or int64"),
    "masked_fill-mask": (lambda: masked_fill(floats(3), longs(3), 0.0), TypeError, "bool"),
    "masked_fill-shape": (
        lambda: masked_fill(floats(3), bools(2, 3), 0.0),
        fl.ShapeError,
        "[2, 3]",
    ),
    "index_tensor-bool": (lambda: index_tensor(floats(3), bools(3)), TypeError, "bool"),
}


@pytest.mark.parametrize("case", sorted(BAD_BUILDS))
def test_bad_input_raises_when_built_at_the_user_line(case, reference_backend):
    build, error_type, words = BAD_BUILDS[case]
    with pytest.raises(error_type) as error:
        build()
    assert words in str(error.value) and "test_indexing.py" in str(error.value)


OUT_OF_RANGE = {
    "gather": (lambda: gather(floats(4, 5), 1, fl.tensor([[0, 7]])), "dim 1", "7"),
    "index_select": (lambda: index_select(floats(4, 5), 0, fl.tensor([1, -1])), "dim 0", "-1"),
    "take_along_dim": (lambda: take_along_dim(floats(4, 5), fl.tensor([[-6]]), 1), "dim 1", "-6"),
    "scatter_add": (lambda: scatter_add(floats(4), 0, fl.tensor([4]), floats(1)), "dim 0", "4"),
    "embedding": (lambda: embedding(fl.tensor([3, 10]), floats(10, 2)), "dim 0", "10"),
    "index_tensor": (lambda: index_tensor(floats(3, 2), fl.tensor([3])), "dim 0", "3"),
    "one_hot": (lambda: one_hot(fl.tensor([0, 5]), 5), "num_classes=5", "5"),
}


@pytest.mark.parametrize("op", sorted(OUT_OF_RANGE))
def test_reference_raises_index_error_naming_op_dim_and_value(op, reference_backend):
    build, where, value = OUT_OF_RANGE[op]
    result = build()  # building is fine: the values are not known yet
    with pytest.raises(IndexError) as error:
        result.numpy()
    message = str(error.value)
    assert op in message and where in message and value in message


# --- structure: fusion boundaries, kernels -------------------------------------------------


def test_gathers_are_fusion_boundaries_and_masked_fill_fuses(cuda_backend, rng):
    data = fl.from_numpy(values(rng, (4, 5), fl.float32))
    gathered = fl.exp(gather(data, 1, fl.from_numpy(positions(rng, (4, 2), 5)))) * 2
    graph = run_pipeline(Graph((gathered.node,)))
    assert [group.kind for group in graph.groups] == ["library", "elementwise"]
    filled = (data.masked_fill(fl.from_numpy(rng.random(5) < 0.5), 0.0) + 1) * 3
    graph = run_pipeline(Graph((filled.node,)))
    assert [group.kind for group in graph.groups] == ["elementwise"]


def test_collapse_merges_evenly_strided_axes():
    sizes, strides = indexing_kernels.collapse((2, 3, 1, 4), (12, 4, 99, 1), (0, 0, 5, 1))
    assert sizes == (6, 4) and strides == ((4, 1), (0, 1))
    assert indexing_kernels.collapse((1, 1), (3, 1)) == ((1,), ((0,),))
    assert indexing_kernels.offset_type(10, (10,), [(1,)]) == "int"
    assert indexing_kernels.offset_type(2**31, (2**31,), [(1,)]) == "long long"


def test_generated_kernels_compile(nvrtc):
    from flame.runtime.compiler import nvrtc_compile

    sources = [
        indexing_kernels.gather_source("gather", rank, size, index, offset)
        for rank in (1, 3) for size in (1, 2, 4, 8) for index in ("int32", "int64")
        for offset in ("int", "long long")
    ]  # fmt: skip
    sources += [
        indexing_kernels.scatter_add_source("scatter_add", 2, dtype.name, "int64", "int")
        for dtype in SCATTER_DTYPES
    ]
    conversions = [("float32", "float16"), ("float32", "bfloat16"), ("bfloat16", "float32")]
    sources += [indexing_kernels.convert_source("convert", *pair) for pair in conversions]
    sources += [indexing_kernels.check_source("check", index) for index in ("int32", "int64")]
    for source in sources:
        name = source.split("void ")[1].split("(")[0]
        assert nvrtc_compile(source, name, "sm_90")


# --- the GPU ------------------------------------------------------------------------------


def oracle(tensor) -> np.ndarray:
    return reference.evaluate([tensor.node], precision=np.float64, realized=False)[0]


def gathers(rng, dtype, index_dtype):
    """One result per gather-like op over the same data, built on the current backend."""
    source = fl.from_numpy(values(rng, (6, 7, 5), dtype))
    index = fl.from_numpy(positions(rng, (4, 9, 3), 7, index_dtype))
    wrapped = fl.from_numpy(rng.integers(-5, 5, (6, 1, 4)).astype(index_dtype.numpy))
    rows = fl.from_numpy(positions(rng, (11,), 5, index_dtype))
    table = fl.from_numpy(values(rng, (10, 8), dtype))
    return {
        "gather": gather(source, 1, index),
        "index_select": index_select(source, 2, rows),
        "take_along_dim": take_along_dim(source, wrapped, 2),
        "take_along_dim-flat": take_along_dim(source, index),
        "embedding": embedding(fl.from_numpy(positions(rng, (3, 4), 10, index_dtype)), table),
        "index_tensor": index_tensor(source, fl.from_numpy(rng.integers(-6, 6, (2, 5)))),
    }


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("dtype", DATA_DTYPES, ids=dtype_id)
def test_gpu_gathers_match_oracle_exactly(dtype, index_dtype, cuda_backend, rng):
    for name, result in gathers(rng, dtype, index_dtype).items():
        expected = oracle(result)
        actual = result.numpy()
        assert actual.shape == expected.shape, name
        np.testing.assert_array_equal(actual.astype(np.float64), expected.astype(np.float64), name)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("dtype", SCATTER_DTYPES, ids=dtype_id)
def test_gpu_scatter_add_matches_oracle(dtype, dim, cuda_backend, rng):
    shape = [300, 40]
    shape[dim] = 2000  # many collisions: every target entry gets ~7-50 atomic additions
    index = positions(rng, shape, 300 if dim == 0 else 40)
    target, source = values(rng, (300, 40), dtype), values(rng, (2000, 2000), dtype)
    result = scatter_add(*tensors(target), dim, *tensors(index, source))
    expected = oracle(result)
    tolerance = {"float32": 1e-5, "float16": 2.0**-10, "bfloat16": 2.0**-7}.get(dtype.name, 0)
    np.testing.assert_allclose(
        result.numpy().astype(np.float64), expected, rtol=tolerance, atol=tolerance * 8
    )


@pytest.mark.gpu
def test_gpu_gather_reads_transposed_views_in_place(cuda_backend, rng):
    import cupy

    from flame.ir.node import Node
    from flame.runtime.storage import Storage

    base = cupy.asarray(values(rng, (5, 64), fl.float32))
    storage = Storage("cuda", fl.float32, array=base.T)  # (64, 5), strides swapped
    source = fl.Tensor(
        Node("buffer", (), (("storage", storage),), fl.float32, (64, 5), None), "cuda"
    )
    result = gather(source, 1, fl.from_numpy(positions(rng, (64, 3), 5)))
    np.testing.assert_array_equal(result.numpy(), oracle(result))
    rows = embedding(fl.from_numpy(positions(rng, (7,), 64)), source)
    np.testing.assert_array_equal(rows.numpy(), oracle(rows))


def read_refused(tensor, op: str, value: str) -> np.ndarray:
    """The first read raises the kernel's report (op, value, this file's line); the value
    is there for a second read."""
    with pytest.raises(IndexError) as error:
        tensor.numpy()
    message = str(error.value)
    assert op in message and value in message and "test_indexing.py" in message, message
    return tensor.numpy()


@pytest.mark.gpu
def test_gpu_out_of_range_indices_are_reported_and_never_read_outside(cuda_backend):
    """The kernel reads 0 (drops a scatter's contribution) and reports: the next read raises."""
    source = fl.from_numpy(np.arange(1, 13, dtype=np.float32).reshape(3, 4))
    picked = read_refused(gather(source, 1, fl.tensor([[0, 4], [0, 3], [2, 0]])), "gather", "4")
    np.testing.assert_array_equal(picked, [[1, 0], [5, 8], [11, 9]])
    taken = take_along_dim(source, fl.tensor([[-1, -5]]), 1)  # -1 wraps, -5 is out
    np.testing.assert_array_equal(read_refused(taken, "take_along_dim", "-5"),
                                  [[4, 0], [8, 0], [12, 0]])  # fmt: skip
    rows = read_refused(embedding(fl.tensor([2, 3, 2]), source), "embedding", "3")
    np.testing.assert_array_equal(rows, [[9, 10, 11, 12], [0, 0, 0, 0], [9, 10, 11, 12]])
    summed = scatter_add(floats(4), 0, fl.tensor([1, 4, 1, 1]), floats(4) + 1)
    np.testing.assert_array_equal(read_refused(summed, "scatter_add", "4"), [0, 3, 0, 0])
    np.testing.assert_array_equal(read_refused(one_hot(fl.tensor([1, 3]), 3), "one_hot", "3"),
                                  [[0, 1, 0], [0, 0, 0]])  # fmt: skip
    np.testing.assert_array_equal(gather(source, 1, fl.tensor([[3]] * 3)).numpy(), [[4], [8], [12]])


@pytest.mark.gpu
def test_gpu_one_hot_and_masked_fill(cuda_backend, rng):
    from flame.runtime.executor import default_executor
    from flame.runtime.launch import Launch
    from flame.runtime.walks import linearize

    labels = fl.from_numpy(positions(rng, (5, 7), 9, fl.int32))
    encoded = one_hot(labels, 9)
    np.testing.assert_array_equal(encoded.numpy(), oracle(encoded))
    data = fl.from_numpy(values(rng, (33, 65), fl.float32))
    filled = (data.masked_fill(fl.from_numpy(rng.random(65) < 0.5), -2.0) + 1) * 3
    _, _, key = linearize([filled.node])
    np.testing.assert_allclose(filled.numpy(), oracle(filled), rtol=1e-6)
    assert [type(step) for step in default_executor()._plans[key].launches] == [Launch]
