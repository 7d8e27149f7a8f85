"""float64 (issue 18): a FLAME dtype computed in double everywhere.

CPU tier: float64 data stays float64 (``fl.tensor``/``fl.from_numpy`` of a float64 array,
like PyTorch; Python floats still give float32), promotion matches ``torch.result_type``,
the generated CUDA of a float64 kernel computes in ``double`` with the double math functions
(``exp``, not ``expf``; ``0.5``, not ``0.5f``; helpers rewritten, reductions accumulating in
double) and NVRTC compiles it; float32 kernels are unchanged. GPU tier: values within a few
ulp of float64 NumPy, which float32 arithmetic anywhere on the way would miss by 1e-8."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import flame as fl
from flame.codegen.doubles import Float64Unsupported, double_text
from flame.codegen.lower import lower_group
from flame.codegen.render import render
from flame.codegen.spec import c_literal
from flame.ir import dtypes
from flame.ir.evaluate import compute_dtype
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.runtime.executor import _layout_of

F64 = dtypes.float64
# values well inside every op's domain; float32 arithmetic would be off by ~1e-8 relative
POINTS = np.linspace(-3.0, 3.0, 1001) + 1.0 / 3.0
UNARY = {
    "exp": (fl.exp, np.exp),
    "log": (lambda t: fl.log(t.abs() + 0.5), lambda a: np.log(np.abs(a) + 0.5)),
    "sin": (fl.sin, np.sin),
    "tanh": (fl.tanh, np.tanh),
    "sigmoid": (fl.sigmoid, lambda a: 1 / (1 + np.exp(-a))),
    "erf": (fl.erf, np.vectorize(math.erf)),
    "gelu": (fl.gelu, lambda a: 0.5 * a * (1 + np.vectorize(math.erf)(a / math.sqrt(2)))),
    "sqrt": (lambda t: (t * t + 1.0).sqrt(), lambda a: np.sqrt(a * a + 1.0)),
    "pow": (lambda t: (t.abs() + 0.5) ** 2.5, lambda a: (np.abs(a) + 0.5) ** 2.5),
}
REFERENCE_COMPUTES_DOUBLE = compute_dtype(F64) == np.float64
needs_double_reference = pytest.mark.skipif(
    not REFERENCE_COMPUTES_DOUBLE,
    reason="flame/ir/evaluate.py compute_dtype still runs float64 ops in float32 (issue 18 "
    "report: use dtype.numpy_compute)",
)


def sources(*tensors) -> list[str]:
    graph = run_pipeline(Graph(tuple(t.node for t in tensors)))
    return [render(lower_group(group, _layout_of).spec) for group in graph.groups]


def body(source: str) -> str:
    """The kernel after the prelude (whose f16 helpers legitimately spell float)."""
    return source[source.index("#endif\n}") :]


# --- data in -------------------------------------------------------------------------------
def test_float64_data_stays_float64_and_python_floats_stay_float32(reference_backend):
    array = POINTS.copy()
    assert fl.from_numpy(array).dtype is F64
    assert fl.tensor(array).dtype is F64
    assert fl.tensor(np.float64(2.5)).dtype is F64  # as torch.tensor(np.float64(2.5))
    assert fl.tensor([1.5, 2.0]).dtype is dtypes.float32
    assert fl.tensor(2.5).dtype is dtypes.float32
    assert fl.tensor([1.5], dtype="double").dtype is F64
    np.testing.assert_array_equal(fl.from_numpy(array).numpy(), array)


def test_float64_names_resolve(reference_backend):
    assert dtypes.dtype("float64") is dtypes.dtype("double") is F64
    assert dtypes.dtype(np.float64) is F64
    assert F64.c_compute == "double" and F64.short == "f64" and F64.itemsize == 8
    torch = pytest.importorskip("torch")
    assert dtypes.dtype(torch.float64) is F64


@pytest.mark.skipif(not hasattr(fl, "float64"), reason="flame/__init__.py exports no float64 yet")
def test_flame_exports_float64_and_double():
    assert fl.float64 is fl.double is F64


def test_double_and_type_methods(reference_backend):
    from flame import dtype_views

    x = fl.tensor([1.5, -2.25])
    assert dtype_views.double(x).dtype is F64
    assert dtype_views.type_(x) == "flame.FloatTensor"
    assert dtype_views.type_(x, F64).dtype is F64
    assert dtype_views.type_(x, "torch.DoubleTensor").dtype is F64
    assert x.double().dtype is F64  # attached by flame.dtype_views
    assert x.type(np.float64).type() == "flame.DoubleTensor"


# --- promotion -----------------------------------------------------------------------------
def _operand(dtype, zero_dim: bool):
    return fl.ones(() if zero_dim else (3,), dtype=dtype)


@pytest.mark.parametrize("left_zero,right_zero", [(False, False), (False, True), (True, True)])
def test_promotion_with_float64_matches_pytorch(left_zero, right_zero, reference_backend):
    torch = pytest.importorskip("torch", reason="promotion is compared with torch.result_type")
    for left, right in itertools.product(dtypes.ALL, (F64,)):
        pairs = (((left, left_zero), (right, right_zero)), ((right, left_zero), (left, right_zero)))
        for a, b in pairs:
            ours = (_operand(*a) + _operand(*b)).dtype
            theirs = torch.result_type(
                torch.ones(() if a[1] else (3,), dtype=getattr(torch, a[0].name)),
                torch.ones(() if b[1] else (3,), dtype=getattr(torch, b[0].name)),
            )
            assert ours.name == str(theirs).removeprefix("torch."), (a, b)


def test_promotion_with_float64_without_pytorch(reference_backend):
    assert dtypes.promote(F64, dtypes.float32) is F64
    assert dtypes.promote(dtypes.bfloat16, F64) is F64
    assert dtypes.promote(dtypes.int64, F64) is F64
    assert (_operand(dtypes.float32, False) + _operand(F64, True)).dtype is dtypes.float32
    assert (_operand(dtypes.int32, False) + _operand(F64, True)).dtype is F64
    assert (_operand(F64, False) * 2.5).dtype is F64  # a Python float is weak
    assert (_operand(dtypes.int64, False) * 2.5).dtype is dtypes.float32


# --- values on the reference backend ------------------------------------------------------
@needs_double_reference
@pytest.mark.parametrize("name", sorted(UNARY))
def test_reference_computes_float64_in_double(name, reference_backend):
    ours, numpy_function = UNARY[name]
    result = ours(fl.from_numpy(POINTS.copy()))
    assert result.dtype is F64
    np.testing.assert_allclose(result.numpy(), numpy_function(POINTS), rtol=1e-14, atol=1e-15)


@needs_double_reference
def test_reference_sum_and_matmul_in_double(reference_backend):
    values = np.full(1000, 0.1) + np.arange(1000) * 1e-9
    assert fl.from_numpy(values).sum().numpy() == pytest.approx(values.sum(), rel=1e-15)
    matrix = np.linspace(-1, 1, 12).reshape(3, 4) / 3.0
    product = fl.from_numpy(matrix) @ fl.from_numpy(matrix.T.copy())
    assert product.dtype is F64
    np.testing.assert_allclose(product.numpy(), matrix @ matrix.T, rtol=1e-15)


@needs_double_reference
def test_reference_gradients_in_double(reference_backend):
    import math

    erf = np.vectorize(math.erf)
    x = fl.from_numpy(POINTS.copy()).requires_grad_()
    (fl.gelu(x) * x.exp()).sum().backward()
    assert x.grad.dtype is F64
    cdf = 0.5 * (1 + erf(POINTS / math.sqrt(2)))
    density = np.exp(-POINTS * POINTS / 2) / math.sqrt(2 * math.pi)
    expected = (cdf + POINTS * density + POINTS * cdf) * np.exp(POINTS)
    np.testing.assert_allclose(x.grad.numpy(), expected, rtol=1e-14, atol=1e-15)


# --- generated CUDA ------------------------------------------------------------------------
def test_float64_kernels_compute_in_double(cuda_backend):
    x = fl.from_numpy(POINTS.reshape(7, 143).copy())
    (elementwise,) = sources(fl.gelu(x * 1.5) + x.exp() - x.sigmoid())
    kernel = body(elementwise)
    assert "const double v" in kernel and "double* out0" in kernel
    assert "flame_gelu_none_f64(double x)" in kernel and "erf(" in kernel
    assert "exp(v0)" in kernel and "__ddiv_rn(1.0, 1.0 + exp(-v0))" in kernel
    for float_only in ("expf(", "erff(", "__expf(", "__fdividef(", "float", "1.5f"):
        assert float_only not in kernel, float_only


def test_float64_reductions_accumulate_in_double(cuda_backend):
    x = fl.from_numpy(POINTS.reshape(7, 143).copy())
    (total,) = sources((x.tanh() * 2.0).sum(1))
    assert "double acc" in total and "float acc" not in total
    (peak,) = sources(x.amax(1))
    assert "flame_max_f64(" in peak and "double acc" in peak


def test_float64_kernels_compile_with_nvrtc(cuda_backend, nvrtc):
    from flame.runtime.compiler import nvrtc_compile

    x = fl.from_numpy(POINTS.reshape(7, 143).copy())
    nan = x * float("nan")
    tensors = [
        fl.gelu(x, approximate="tanh") + x.exp() * x.sigmoid() - x.silu(),
        (x // 0.7) + (x % 1.3) + fl.minimum(x, x.abs()) + fl.maximum(nan, x),
        (x.sqrt().log1p() ** 2.5).sum(0),
        fl.arange(143, dtype=F64) * x + float("inf"),
        x.to(dtypes.float32) + x.to(dtypes.float16).to(F64).amin(1, keepdim=True).float(),
        (x > 0.5).to(F64) + x.to(dtypes.int32),
    ]
    for source in sources(*tensors):
        name = source.split("void __launch_bounds__(")[1].split(") ")[1].split("(")[0]
        assert nvrtc_compile(source, name, "sm_90")[:4] == b"\x7fELF", name


def _registry_float64_cases():
    """Every registry op that takes floats, with each of its attribute samples, built over
    float64 operands (``where``'s condition a bool)."""
    from opinfo import build

    from flame.ir.ops import elementwise_ops

    cases = []
    for op in elementwise_ops():
        if not op.accepts(2):
            continue
        samples = ({"dtype": F64},) if op.name == "cast" else op.attr_samples
        for attrs in samples:
            operands = [fl.from_numpy(np.linspace(0.1, 0.9, 64).reshape(8, 8) + k) for k in
                        range(op.arity)]  # fmt: skip
            if op.name == "where":
                operands[0] = operands[0] > 0.5
            cases.append((op.name, attrs, build(op.name, operands, attrs)))
    return cases


def test_every_float_op_of_the_registry_renders_in_double(cuda_backend, nvrtc):
    from flame.runtime.compiler import nvrtc_compile

    for name, attrs, tensor in _registry_float64_cases():
        for source in sources(tensor):
            kernel = body(source).replace("__int_as_float", "").replace("_as_double", "")
            assert "float" not in kernel, (name, attrs)
            kernel_name = source.split("void __launch_bounds__(")[1].split(") ")[1].split("(")[0]
            assert nvrtc_compile(source, kernel_name, "sm_90")[:4] == b"\x7fELF", (name, attrs)


def test_float32_kernels_have_no_double(cuda_backend):
    x = fl.from_numpy(POINTS.reshape(7, 143).astype(np.float32))
    for source in sources(fl.gelu(x) * x.exp(), x.sum(1), x.amax(0)):
        assert "double" not in source and "_f64" not in source


def test_double_literals_are_exact():
    third = 1.0 / 3.0
    assert float(c_literal(third, F64)) == third
    assert float(c_literal(third, dtypes.float32).rstrip("f")) == float(np.float32(third))
    assert c_literal(float("inf"), F64) == "__longlong_as_double(0x7ff0000000000000LL)"
    assert c_literal(-float("inf"), F64) == "__longlong_as_double(0xfff0000000000000LL)"
    assert "0x7ff8" in c_literal(float("nan"), F64)


def test_double_text_rewrites_float_spellings_only():
    rewritten = double_text("__fdividef(1.0f, 1.0f + __expf(-v0)) * (float)i + 1e-6f")
    assert rewritten == "__ddiv_rn(1.0, 1.0 + exp(-v0)) * (double)i + 1e-6"
    assert double_text("__int_as_float(0x7f800000) + 2.5f") == "__int_as_float(0x7f800000) + 2.5"
    assert double_text("flame_max(fabsf(v1), 0.0f)") == "flame_max_f64(fabs(v1), 0.0)"
    with pytest.raises(Float64Unsupported, match="__float_as_uint"):
        double_text("__float_as_uint(v0) >> 1")


# --- GPU tier ------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(UNARY))
def test_gpu_float64_ops_match_numpy_in_double(name, cuda_backend):
    ours, numpy_function = UNARY[name]
    result = ours(fl.from_numpy(POINTS.copy()))
    assert result.dtype is F64
    np.testing.assert_allclose(result.numpy(), numpy_function(POINTS), rtol=1e-14, atol=1e-15)


@pytest.mark.gpu
def test_gpu_every_float_op_of_the_registry_in_double(cuda_backend):
    from flame.runtime import reference

    for name, attrs, tensor in _registry_float64_cases():
        (expected,) = reference.evaluate([tensor.node], precision=np.float64, realized=False)
        got = tensor.numpy()
        assert got.dtype == expected.dtype or not tensor.dtype.is_float, (name, attrs)
        np.testing.assert_allclose(got, expected, rtol=1e-13, atol=1e-14, err_msg=name)


@pytest.mark.gpu
def test_gpu_float64_reductions_and_softmax(cuda_backend):
    values = np.full((4, 3000), 0.1) + np.arange(3000) * 1e-9
    x = fl.from_numpy(values)
    np.testing.assert_allclose(x.sum(1).numpy(), values.sum(1), rtol=1e-14)
    np.testing.assert_allclose(x.sum(0).numpy(), values.sum(0), rtol=1e-15)
    np.testing.assert_array_equal(x.amax(1).numpy(), values.max(1))
    shifted = np.exp(values - values.max(1, keepdims=True))
    expected = shifted / shifted.sum(1, keepdims=True)
    got = (x - x.amax(1, keepdim=True)).exp()
    got = got / got.sum(1, keepdim=True)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-13)


@pytest.mark.gpu
def test_gpu_float64_matmul_uses_double(cuda_backend):
    rng = np.random.default_rng(0)
    left, right = rng.standard_normal((3, 64, 96)), rng.standard_normal((96, 80))
    product = fl.from_numpy(left) @ fl.from_numpy(right)
    assert product.dtype is F64
    np.testing.assert_allclose(product.numpy(), left @ right, rtol=1e-12, atol=1e-12)
    batched = fl.from_numpy(left) @ fl.from_numpy(left.transpose(0, 2, 1).copy())
    np.testing.assert_allclose(batched.numpy(), left @ left.transpose(0, 2, 1), atol=1e-12)


@pytest.mark.gpu
def test_gpu_compiled_float64_step_matches_lazy(cuda_backend):
    weights = fl.from_numpy(np.linspace(-1, 1, 96).reshape(12, 8) / 3.0)

    def step(batch):
        hidden = fl.gelu(batch @ weights)
        return (hidden * hidden).sum(1), hidden.amax(0)

    compiled = fl.compile(step)
    for seed in range(3):
        batch = fl.from_numpy(np.random.default_rng(seed).standard_normal((5, 12)))
        for ours, lazy in zip(compiled(batch), step(batch)):
            assert ours.dtype is F64
            np.testing.assert_allclose(ours.numpy(), lazy.numpy(), rtol=1e-14, atol=1e-15)


@pytest.mark.gpu
def test_gpu_float64_mixed_with_float32(cuda_backend):
    wide = fl.from_numpy(POINTS.copy())
    narrow = fl.from_numpy(POINTS.astype(np.float32))
    mixed = wide + narrow
    assert mixed.dtype is F64
    expected = POINTS + POINTS.astype(np.float32).astype(np.float64)
    np.testing.assert_array_equal(mixed.numpy(), expected)
    back = wide.to(dtypes.float32)
    np.testing.assert_array_equal(back.numpy(), POINTS.astype(np.float32))
