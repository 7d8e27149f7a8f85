"""matmul, bmm and ``@``: shape and dtype rules at build time, the reference against NumPy and
PyTorch, the cuBLAS call plan checked on the CPU by emulating cuBLAS with NumPy, and (gpu
tier) cuBLAS against the float64 oracle: dtypes, transposed views without copies, batch
broadcasting, TF32 opt-in, and a bias + activation fused after the matmul."""

from __future__ import annotations

import contextvars
import threading

import numpy as np
import pytest

import flame as fl
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.linalg import bmm, get_matmul_precision, matmul, matmul_precision, set_matmul_precision
from flame.runtime import library_linalg, reference
from flame.runtime.library import strided_array

FLOATS = (fl.float32, fl.float16, fl.bfloat16)
SHAPES = [
    ((3,), (3,)), ((3,), (3, 4)), ((2, 3), (3,)), ((2, 3), (3, 4)), ((5, 2, 3), (3, 4)),
    ((2, 3), (5, 3, 4)), ((4, 1, 2, 3), (5, 3, 2)), ((1, 2, 3), (6, 3, 4)), ((3,), (2, 3, 1)),
    ((0, 3), (3, 4)), ((2, 0), (0, 4)),
]  # fmt: skip
# (rtol, atol per sqrt(K)) against float64: float32 sums, or one rounding of the result
TOLERANCE = {"float32": (1e-5, 1e-5), "float16": (2e-3, 2e-3), "bfloat16": (1.6e-2, 1.6e-2)}


def sample(rng, shape, dtype) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32).astype(dtype.numpy)


def assert_matmul_close(actual, expected, dtype, inner):
    rtol, atol = TOLERANCE[dtype.name]
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol * max(1.0, inner**0.5)
    )


def shape_id(case) -> str:
    return "@".join("x".join(map(str, shape)) or "scalar" for shape in case)


# --- the reference and the rules ----------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("shapes", SHAPES, ids=shape_id)
def test_reference_matches_numpy(shapes, dtype, reference_backend, rng):
    left, right = (sample(rng, shape, dtype) for shape in shapes)
    result = fl.from_numpy(left) @ fl.from_numpy(right)
    expected = np.matmul(left.astype(np.float64), right.astype(np.float64))
    assert result.shape == expected.shape and result.dtype is dtype
    assert_matmul_close(result.numpy(), expected, dtype, shapes[0][-1])


@pytest.mark.parametrize("shapes", SHAPES, ids=shape_id)
def test_reference_matches_torch(shapes, reference_backend, rng):
    torch = pytest.importorskip("torch")
    left, right = (sample(rng, shape, fl.float32) for shape in shapes)
    expected = torch.matmul(torch.from_numpy(left), torch.from_numpy(right)).numpy()
    result = matmul(fl.from_numpy(left), fl.from_numpy(right)).numpy()
    assert result.shape == expected.shape
    np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-5)


def test_bmm_matches_torch(reference_backend, rng):
    torch = pytest.importorskip("torch")
    left, right = sample(rng, (4, 2, 3), fl.float32), sample(rng, (4, 3, 5), fl.float32)
    expected = torch.bmm(torch.from_numpy(left), torch.from_numpy(right)).numpy()
    a, b = fl.from_numpy(left), fl.from_numpy(right)
    for result in (bmm(a, b), a.bmm(b)):
        np.testing.assert_allclose(result.numpy(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "left, right, result",
    [(fl.float16, fl.bfloat16, fl.float32), (fl.float16, fl.float32, fl.float32),
     (fl.bfloat16, fl.bfloat16, fl.bfloat16)],
    ids=lambda d: d.name,
)  # fmt: skip
def test_float_operands_promote(left, right, result, reference_backend):
    product = fl.ones(2, 3, dtype=left) @ fl.ones(3, 4, dtype=right)
    assert product.dtype is result
    np.testing.assert_array_equal(product.numpy().astype(np.float32), np.full((2, 4), 3.0))


@pytest.mark.parametrize("other", [fl.int32, fl.int64, fl.bool_], ids=lambda d: d.name)
def test_non_float_operands_are_rejected(other, reference_backend):
    with pytest.raises(TypeError) as error:
        fl.zeros(2, 3, dtype=other) @ fl.ones(3, 4)
    message = str(error.value)
    assert "matmul" in message and other.name in message and "float32" in message
    assert "test_linalg.py" in message


@pytest.mark.parametrize(
    "left, right",
    [((2, 3), (4, 5)), ((2, 2, 3), (3, 3, 4)), ((), (3,)), ((3,), ())],
    ids=["inner", "batch", "scalar-left", "scalar-right"],
)
def test_bad_shapes_raise_when_built_naming_both(left, right, reference_backend):
    with pytest.raises(fl.ShapeError) as error:
        fl.ones(*left) @ fl.ones(*right)
    message = str(error.value)
    assert "matmul" in message and "test_linalg.py" in message
    assert str(list(left)) in message and str(list(right)) in message


@pytest.mark.parametrize(
    "left, right, words",
    [((2, 3), (3, 4), "3-D"), ((2, 2, 3), (3, 3, 4), "batch"), ((2, 2, 3), (2, 4, 4), "inner")],
)
def test_bmm_checks(left, right, words, reference_backend):
    with pytest.raises(fl.ShapeError) as error:
        bmm(fl.ones(*left), fl.ones(*right))
    assert words in str(error.value) and str(list(left)) in str(error.value)


def test_operator_forms(reference_backend, rng):
    left, right = sample(rng, (2, 3), fl.float32), sample(rng, (3, 4), fl.float32)
    a, b = fl.from_numpy(left), fl.from_numpy(right)
    expected = left @ right
    for result in (a @ b, a.matmul(b), b.__rmatmul__(a), matmul(a, b)):
        np.testing.assert_allclose(result.numpy(), expected, rtol=1e-6)
    with pytest.raises(TypeError, match="matmul"):
        matmul(a, 2.0)


def test_precision_is_an_attribute_chosen_when_built(reference_backend):
    assert get_matmul_precision() == "highest"
    with matmul_precision("tf32"):
        fast = fl.ones(2, 3) @ fl.ones(3, 2)
        half = fl.ones(2, 3, dtype=fl.float16) @ fl.ones(3, 2, dtype=fl.float16)
    strict = fl.ones(2, 3) @ fl.ones(3, 2)
    assert fast.node.attr("precision") == "tf32"
    assert half.node.attr("precision") == "highest"  # only float32 has a TF32 mode
    assert strict.node.attr("precision") == "highest"
    assert 'precision="tf32"' in fast.ir()
    np.testing.assert_array_equal(fast.numpy(), np.full((2, 2), 3.0, np.float32))


def test_precision_setting_stays_in_its_context():
    seen = {}

    def in_thread():
        set_matmul_precision("high")  # PyTorch's name for TF32
        seen["thread"] = get_matmul_precision()

    worker = threading.Thread(target=in_thread)
    worker.start()
    worker.join()
    contextvars.copy_context().run(set_matmul_precision, "tf32")
    assert seen["thread"] == "tf32"
    assert get_matmul_precision() == "highest"
    with pytest.raises(ValueError, match="precision"):
        set_matmul_precision("medium")


def test_bias_and_activation_fuse_after_the_matmul(cuda_backend):
    """Built on the CUDA backend but only planned: one library group, one kernel."""
    left, right, bias = (
        fl.from_numpy(np.ones(shape, np.float32)) for shape in ((8, 16), (16, 4), (4,))
    )
    product = fl.gelu(left @ right + bias)
    graph = run_pipeline(Graph((product.node,)))
    assert [group.kind for group in graph.groups] == ["library", "elementwise"]


# --- the cuBLAS call plan, emulated with NumPy --------------------------------------------


def _view(rng, shape, layout):
    """An array of logical ``shape`` laid out as ``layout`` describes (a view where it can)."""
    *batch, rows, columns = shape
    if layout == "contiguous":
        return rng.standard_normal(shape).astype(np.float32)
    if layout == "transposed":
        return rng.standard_normal((*batch, columns, rows)).astype(np.float32).swapaxes(-1, -2)
    if layout == "padded":
        return rng.standard_normal((*batch, rows, columns + 3)).astype(np.float32)[..., :columns]
    if layout == "padded-transposed":
        base = rng.standard_normal((*batch, columns, rows + 2)).astype(np.float32)
        return base[..., :rows].swapaxes(-1, -2)
    if layout == "expanded":  # a broadcast batch: stride 0, like an expand view
        return np.broadcast_to(rng.standard_normal((rows, columns)).astype(np.float32), shape)
    if layout == "batch-permuted":
        base = rng.standard_normal((batch[1], batch[0], rows, columns)).astype(np.float32)
        return base.transpose(1, 0, 2, 3)
    if layout == "strided":  # both strides > 1: no leading dimension describes it
        return rng.standard_normal((*batch, rows, 2 * columns)).astype(np.float32)[..., ::2]
    if layout == "reversed":
        return rng.standard_normal(shape).astype(np.float32)[..., ::-1, :]
    raise ValueError(layout)


def _column_major(pointer, rows, columns, leading, bounds):
    """The ``rows x columns`` column-major float32 matrix at ``pointer`` with ``leading``,
    after checking it lies inside one of the arrays the plan may touch."""
    import ctypes

    extent = ((columns - 1) * leading + rows) * 4
    assert any(low <= pointer and pointer + extent <= high for low, high in bounds), "out of bounds"
    flat = np.ctypeslib.as_array(
        ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), (extent // 4,)
    )
    return np.lib.stride_tricks.as_strided(flat, (rows, columns), (4, 4 * leading))


def emulate(calls, bounds) -> None:
    """Run cuBLAS calls with NumPy: C = op(A) @ op(B), column-major, per batch entry."""
    for call in calls:
        for entry in range(call.count):
            a_shape = (call.m, call.k) if call.transpose_a == 0 else (call.k, call.m)
            b_shape = (call.k, call.n) if call.transpose_b == 0 else (call.n, call.k)
            a = _column_major(call.a + 4 * entry * call.stride_a, *a_shape, call.lda, bounds)
            b = _column_major(call.b + 4 * entry * call.stride_b, *b_shape, call.ldb, bounds)
            c = _column_major(call.c + 4 * entry * call.stride_c, call.m, call.n, call.ldc, bounds)
            a = a if call.transpose_a == 0 else a.T
            b = b if call.transpose_b == 0 else b.T
            c[...] = a.astype(np.float64) @ b.astype(np.float64)


PLAN_CASES = [
    # (left shape, right shape, left layout, right layout, calls, copies)
    ((6, 5), (5, 7), "contiguous", "transposed", 1, 0),
    ((6, 5), (5, 7), "transposed", "transposed", 1, 0),
    ((6, 5), (5, 7), "padded", "padded-transposed", 1, 0),
    ((3, 6, 5), (5, 7), "contiguous", "transposed", 1, 0),  # rows folded: one GEMM
    ((3, 1, 5), (5, 7), "contiguous", "contiguous", 1, 0),
    ((3, 6, 5), (3, 5, 7), "transposed", "contiguous", 1, 0),  # one strided-batched call
    ((3, 6, 5), (3, 5, 7), "expanded", "padded", 1, 0),
    ((4, 1, 6, 5), (3, 5, 7), "contiguous", "transposed", 4, 0),  # loop over the outer axis
    ((2, 3, 6, 5), (3, 5, 7), "batch-permuted", "contiguous", 2, 0),
    ((6, 5), (5, 7), "strided", "contiguous", 1, 1),
    ((2, 6, 5), (5, 7), "contiguous", "reversed", 1, 1),
]  # fmt: skip


@pytest.mark.parametrize(
    "case", PLAN_CASES, ids=lambda case: f"{case[2]}@{case[3]}-{len(case[0])}d"
)
def test_cublas_plan_emulated(case, rng):
    """Twice per layout: planned, then (different arrays) from the plan cache."""
    left_shape, right_shape, left_layout, right_layout, call_count, copy_count = case
    for _ in range(2):
        left, right = _view(rng, left_shape, left_layout), _view(rng, right_shape, right_layout)
        expected = np.matmul(left.astype(np.float64), right.astype(np.float64))
        out = np.full(expected.shape, np.nan, np.float32)
        calls, alive = library_linalg.cached_gemms(left, right, out, np, lambda a: a.ctypes.data)
        copies = sum(kept is not given for kept, given in zip(alive, (left, right), strict=True))
        assert (len(calls), copies) == (call_count, copy_count)
        bounds = [np.lib.array_utils.byte_bounds(array) for array in (left, right, out, *alive)]
        emulate(calls, bounds)
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_matrix_layout_rules():
    layout = library_linalg.matrix_layout
    assert layout(4, 3, 3, 1) == (library_linalg.OP_N, 3)  # row-major
    assert layout(4, 3, 1, 4) == (library_linalg.OP_T, 4)  # a transposed view
    assert layout(4, 3, 2, 8) is None  # both strides > 1
    assert layout(4, 3, 0, 1) is None  # rows broadcast: rows would overlap
    assert layout(1, 3, 99, 1) == (library_linalg.OP_N, 3)  # size-1 axes: any stride


# --- the GPU ------------------------------------------------------------------------------


def oracle(tensor) -> np.ndarray:
    return reference.evaluate([tensor.node], precision=np.float64, realized=False)[0]


def cuda_view(array, dtype) -> fl.Tensor:
    """A CUDA tensor over a CuPy array (a view, strides kept; bfloat16 as uint16 bits)."""
    from flame.ir.node import Node
    from flame.runtime.storage import Storage

    storage = Storage("cuda", dtype, array=array)
    return fl.Tensor(Node("buffer", (), (("storage", storage),), dtype, array.shape, None), "cuda")


def device_sample(rng, shape, dtype, transposed=False):
    """A CuPy array of ``dtype``'s storage, contiguous or a transposed view of the last axes."""
    import cupy

    stored = (*shape[:-2], shape[-1], shape[-2]) if transposed else shape
    host = sample(rng, stored, dtype)
    array = cupy.asarray(host.view(np.uint16) if dtype is fl.bfloat16 else host)
    if not transposed:
        return array
    *batch, row_stride, column_stride = (stride // array.itemsize for stride in array.strides)
    return strided_array(array, shape, (*batch, column_stride, row_stride))


LARGER = [((64, 128), (128, 96)), ((3, 64, 128), (128, 32)), ((4, 1, 16, 32), (5, 32, 8)),
          ((1, 16, 32), (6, 32, 8)), ((7, 16, 32), (7, 32, 8))]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("shapes", SHAPES + LARGER, ids=shape_id)
def test_gpu_matmul_matches_float64_oracle(shapes, dtype, cuda_backend, rng):
    left, right = (fl.from_numpy(sample(rng, shape, dtype)) for shape in shapes)
    result = left @ right
    expected = oracle(result)
    assert result.numpy().shape == expected.shape
    assert_matmul_close(result.numpy().astype(np.float64), expected, dtype, shapes[0][-1])


def large_allocations(minimum: int):
    """A CuPy memory hook (a context manager) and the list of pool allocations of at least
    ``minimum`` bytes made while it is active."""
    from cupy.cuda import memory_hook

    sizes: list[int] = []

    class Hook(memory_hook.MemoryHook):
        name = "flame_large_allocations"

        def malloc_postprocess(self, **kwargs):
            if kwargs["size"] >= minimum:
                sizes.append(kwargs["size"])

    return Hook(), sizes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("which", ["right", "left", "both"])
def test_gpu_transposed_views_reach_cublas_without_copies(which, dtype, cuda_backend, rng):
    shapes = ((64, 256), (256, 32))
    arrays = [
        device_sample(rng, shape, dtype, transposed=which in (side, "both"))
        for shape, side in zip(shapes, ("left", "right"), strict=True)
    ]
    left, right = (cuda_view(array, dtype) for array in arrays)
    (left @ right).numpy()  # warm: cuBLAS handle and workspace, the plan
    hook, copies = large_allocations(minimum=min(array.nbytes for array in arrays))
    result = left @ right
    with hook:
        result.realize()
    assert copies == [], "an operand was copied"
    assert_matmul_close(result.numpy(), oracle(result), dtype, 256)


@pytest.mark.gpu
def test_gpu_layouts_cublas_cannot_read_are_copied(cuda_backend, rng):
    import cupy

    base = cupy.asarray(sample(rng, (64, 64), fl.float32))
    strided = cuda_view(base[:, ::2], fl.float32)  # [64, 32], both strides > 1
    reversed_rows = cuda_view(base[31::-1, :], fl.float32)  # [32, 64], negative row stride
    result = strided @ reversed_rows
    assert_matmul_close(result.numpy(), oracle(result), fl.float32, 32)


@pytest.mark.gpu
def test_gpu_tf32_is_opt_in(cuda_backend, rng):
    left = fl.from_numpy(sample(rng, (256, 1024), fl.float32))
    right = fl.from_numpy(sample(rng, (1024, 256), fl.float32))
    strict = left @ right
    with matmul_precision("tf32"):
        fast = left @ right
    expected = oracle(strict)
    strict_error = np.abs(strict.numpy() - expected).max()
    fast_error = np.abs(fast.numpy() - expected).max()
    assert strict_error < 1e-4 * 32
    assert fast_error < 2e-3 * 32  # 10-bit mantissa inputs, float32 sums; results ~ 32
    assert fast_error > 2 * strict_error, "TF32 did not change the result: not used?"


@pytest.mark.gpu
def test_gpu_highest_keeps_tf32_off_even_if_the_handle_allows_it(cuda_backend, rng):
    import cupy
    from cupy.cuda import cublas

    handle = cupy.cuda.device.get_cublas_handle()
    before = cublas.getMathMode(handle)
    cublas.setMathMode(handle, library_linalg.CUBLAS_TF32_TENSOR_OP_MATH)
    try:
        left = fl.from_numpy(sample(rng, (256, 1024), fl.float32))
        result = left @ fl.from_numpy(sample(rng, (1024, 256), fl.float32))
        assert np.abs(result.numpy() - oracle(result)).max() < 1e-4 * 32
        assert cublas.getMathMode(handle) == library_linalg.CUBLAS_TF32_TENSOR_OP_MATH
    finally:
        cublas.setMathMode(handle, before)


@pytest.mark.gpu
def test_gpu_bias_gelu_is_one_library_call_and_one_kernel(cuda_backend, rng):
    from flame.runtime.executor import LibraryCall, default_executor
    from flame.runtime.launch import Launch
    from flame.runtime.walks import linearize

    left = fl.from_numpy(sample(rng, (96, 80), fl.float32))
    right = fl.from_numpy(sample(rng, (80, 48), fl.float32))
    bias = fl.from_numpy(sample(rng, (48,), fl.float32))
    result = fl.gelu(left @ right + bias)
    _, _, key = linearize([result.node])
    expected = oracle(result)
    result.realize()
    launches = default_executor()._plans[key].launches
    assert [type(step) for step in launches] == [LibraryCall, Launch]
    assert_matmul_close(result.numpy(), expected, fl.float32, 80)


@pytest.mark.parametrize("batch", [(5,), (2, 3)])
def test_a_shared_weights_gradient_is_one_matmul_over_the_folded_batch(batch, rng):
    """``x @ w`` with x [*batch, T, K] and w [K, N] (F.linear over tokens): the gradient of w
    is one [K, N] product over the batch folded into the rows, not a product per batch item
    ([*batch, K, N] written) summed afterwards; values as NumPy's."""
    x_host = rng.standard_normal((*batch, 4, 6))
    w_host = rng.standard_normal((6, 3))
    g_host = rng.standard_normal((*batch, 4, 3))
    with fl.backend("cuda"):  # graphs are built and planned; nothing runs
        x = fl.tensor(x_host.astype(np.float32))
        w = fl.tensor(w_host.astype(np.float32))
        g = fl.tensor(g_host.astype(np.float32))
        _, vjp = fl.vjp(lambda w: x @ w, w)
        (w_grad,) = vjp(g)
        products = [n for n in Graph((w_grad.node,)).nodes if n.op == "matmul"]
    assert [n.shape for n in products] == [(6, 3)]
    expected = x_host.reshape(-1, 6).T @ g_host.reshape(-1, 3)
    (found,) = reference.evaluate([w_grad.node], precision=np.float64, realized=False)
    np.testing.assert_allclose(found, expected, rtol=1e-5, atol=1e-5)
