"""Elementwise ops, CPU tier: every op of the registry at every dtype it accepts.

(a) shape and dtype rule vs NumPy broadcasting and the documented promotion table;
(b) values on the reference backend vs NumPy semantics written here, in float64;
(c) values and dtypes vs PyTorch (CPU), where it is installed;
(d) every op's generated kernel compiles with NVRTC (no GPU needed);
(e) NaN propagation through maximum, minimum and clamp;
(f) bad input fails when the op is built, at the user's line, and leaves operands usable.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from opinfo import (
    DTYPES,
    FLOAT_DTYPES,
    build,
    compile_groups,
    documented_promotion,
    expected_dtypes,
    expected_values,
    params,
    special_arrays,
    special_attr_samples,
    variant_outputs,
)

import flame as fl
from flame.ir.dtypes import dtype as resolve_dtype
from flame.ir.graph import is_input

BROADCAST_SHAPES = ((3, 1, 5), (4, 5), (5,))
RULE_SCALARS = (True, 2, 2.5)
# (rtol, atol) per result dtype: float16/bfloat16 results are rounded once from float32.
TOLERANCE = {"float32": (1e-5, 1e-6), "float16": (1e-2, 1e-3), "bfloat16": (2e-2, 1e-2)}


def current_line() -> int:
    return inspect.currentframe().f_back.f_lineno


def assert_values(actual: np.ndarray, expected: np.ndarray, dtype_name: str, what: str):
    if dtype_name not in TOLERANCE:
        np.testing.assert_array_equal(actual, expected, err_msg=what)
        return
    rtol, atol = TOLERANCE[dtype_name]
    np.testing.assert_allclose(
        actual.astype(np.float64), expected, rtol=rtol, atol=atol, equal_nan=True, err_msg=what
    )


def value_variants(case, rng):
    """Named operand lists (arrays and Python scalars): broadcast shapes, and for ops of
    several inputs a weak scalar last (and first, for binary ops)."""
    arity = case.op.arity
    yield "broadcast", case.arrays(rng, BROADCAST_SHAPES[:arity])
    if arity >= 2:
        arrays = case.arrays(rng, BROADCAST_SHAPES[1:arity])
        yield "scalar-last", arrays + [case.scalar(rng, arity - 1)]
    if arity == 2:
        yield "scalar-first", [case.scalar(rng, 0), case.arrays(rng, [(4, 5), (4, 5)])[1]]


def operands_of(values):
    return [fl.from_numpy(value) if isinstance(value, np.ndarray) else value for value in values]


# --- (a) shape and dtype rule -----------------------------------------------------------


def rule_operands(case):
    """Operand kinds (dtype or Python scalar) for the dtype rule: the case itself, each
    partner dtype in the last input, and weak scalars in the last (and first) input."""
    kinds = list(case.input_dtypes())
    yield kinds
    if case.op.arity < 2:
        return
    for partner in DTYPES:
        yield kinds[:-1] + [partner]
    for scalar in RULE_SCALARS:
        yield kinds[:-1] + [scalar]
        if case.op.arity == 2:
            yield [scalar] + kinds[1:]


@pytest.mark.parametrize("case", params())
def test_shape_and_dtype_rule(case, reference_backend):
    checked = 0
    for attrs in case.attr_samples():
        for kinds in rule_operands(case):
            shapes = [
                shape
                for kind, shape in zip(kinds, BROADCAST_SHAPES, strict=False)
                if kind in DTYPES
            ]
            operands = [
                fl.from_numpy(np.zeros(shape, kind.numpy)) if kind in DTYPES else kind
                for kind, shape in zip(kinds, BROADCAST_SHAPES, strict=False)
            ]
            expected = expected_dtypes(case.op, kinds, attrs)
            what = f"{case.op.name}({', '.join(map(str, kinds))}) {attrs}"
            if expected is None:
                with pytest.raises(TypeError, match=case.op.name) as caught:
                    build(case.op.name, operands, attrs)
                assert "[at opinfo.py:" in str(caught.value), what  # the line that built it
                continue
            result = build(case.op.name, operands, attrs)
            assert result.shape == np.broadcast_shapes(*shapes), what
            assert result.dtype.name == expected[1], what
            checked += 1
    assert checked > 0


@pytest.mark.parametrize("case", params(arity=(1,)))
def test_unary_keeps_zero_d_shape(case, reference_backend):
    for attrs in case.attr_samples():
        operand = fl.from_numpy(np.zeros((), case.dtype.numpy))
        assert build(case.op.name, [operand], attrs).shape == ()


def test_documented_promotion_table_is_complete_and_symmetric():
    table = documented_promotion()
    names = [dtype.name for dtype in DTYPES]
    assert set(table) == {(a, b) for a in names for b in names}
    assert all(table[(a, b)] == table[(b, a)] for a, b in table)


# --- (b) values on the reference backend -------------------------------------------------


@pytest.mark.parametrize("case", params())
def test_value_matches_numpy_semantics(case, reference_backend, rng):
    checked = 0
    for attrs in case.attr_samples():
        for variant, values in value_variants(case, rng):
            result = build(case.op.name, operands_of(values), attrs)
            expected, result_dtype = expected_values(case.op, values, attrs)
            what = f"{case.id} {variant} {attrs}"
            assert result.dtype.name == result_dtype, what
            assert_values(result.numpy(), expected, result_dtype, what)
            checked += 1
    assert checked > 0


# --- (c) against PyTorch ----------------------------------------------------------------


def torch_function(torch, name, attrs):
    functional = torch.nn.functional
    special = {
        "neg": torch.neg,
        "copy": torch.clone,
        "div": torch.true_divide,
        "floordiv": torch.floor_divide,
        "remainder": torch.remainder,
        "gelu": lambda x: functional.gelu(x, approximate=attrs["approximate"]),
        "leaky_relu": lambda x: functional.leaky_relu(x, attrs["negative_slope"]),
        "softplus": lambda x: functional.softplus(x, attrs["beta"], attrs["threshold"]),
        "silu": functional.silu,
        "cast": lambda x: x.to(getattr(torch, resolve_dtype(attrs["dtype"]).name)),
    }
    return special.get(name) or getattr(torch, name, None)


@pytest.mark.parametrize("case", params(dtypes=(fl.float32, fl.int32, fl.int64, fl.bool_)))
def test_matches_pytorch(case, reference_backend, rng):
    torch = pytest.importorskip("torch")
    compared, refused = 0, []
    for attrs in case.attr_samples():
        function = torch_function(torch, case.op.name, attrs)
        if function is None:
            pytest.skip(f"no PyTorch counterpart of {case.op.name}")
        for variant, values in value_variants(case, rng):
            try:
                expected = function(*[torch.as_tensor(value) for value in values])
            except (RuntimeError, NotImplementedError, TypeError) as error:
                refused.append(f"{variant}: {error}".splitlines()[0])
                continue
            result = build(case.op.name, operands_of(values), attrs)
            what = f"{case.id} {variant} {attrs}"
            assert result.dtype.name == str(expected.dtype).removeprefix("torch."), what
            assert result.shape == tuple(expected.shape), what
            expected = expected.float() if expected.dtype == torch.bfloat16 else expected
            assert_values(result.numpy(), expected.numpy(), result.dtype.name, what)
            compared += 1
    if not compared:
        pytest.skip(f"PyTorch refuses {case.id}: {refused[0]}")


@pytest.mark.parametrize("case", params(dtypes=(fl.float32,)))
def test_special_values_match_pytorch(case, reference_backend):
    torch = pytest.importorskip("torch")
    arrays = special_arrays(case)
    if case.op.name == "gelu":  # PyTorch's CPU gelu gives NaN at +inf (its own quirk)
        arrays = [array[np.isfinite(array)] for array in arrays]
    for attrs in special_attr_samples(case):
        expected = torch_function(torch, case.op.name, attrs)(*map(torch.from_numpy, arrays))
        expected = expected.float() if expected.dtype == torch.bfloat16 else expected
        result = build(case.op.name, operands_of(arrays), attrs)
        inputs = ", ".join(f"{array.tolist()}" for array in arrays)
        assert_values(result.numpy(), expected.numpy(), result.dtype.name, f"{case.id}({inputs})")


# --- (d) every kernel compiles with NVRTC ---------------------------------------------------


@pytest.mark.parametrize("variant", ["odd", "broadcast", "scalar"])
@pytest.mark.parametrize("case", params())
def test_kernel_compiles_with_nvrtc(case, variant, cuda_backend, nvrtc, rng):
    for attrs in case.attr_samples():
        outputs = variant_outputs(case, variant, attrs, rng)
        graph, compiled = compile_groups([t.node for t in outputs])
        written = {id(node) for group in graph.groups for node in group.outputs}
        assert all(is_input(node) or id(node) in written for node in graph.outputs)
        if all(is_input(node) for node in graph.outputs):  # a cast to the same dtype
            assert case.op.name == "cast" and resolve_dtype(attrs["dtype"]) is case.dtype
            continue
        for spec, _, cubin in compiled:
            assert isinstance(cubin, bytes) and len(cubin) > 0, spec.name
        headers = "\n".join(source for _, source, _ in compiled)
        identity = case.op.name == "cast" and resolve_dtype(attrs["dtype"]) is case.dtype
        assert identity or f"= {case.op.name}(" in headers, f"{case.id}: op not in kernel"


@pytest.mark.parametrize("count", [1, 3])
def test_kernel_cache_takes_cubin_arguments_as_items(count, tmp_path, cuda_backend, nvrtc):
    """``KernelCache.cubins`` items are ``cubin``'s arguments, with a code identity too (as
    the executor passes them), for one kernel as for several."""
    from flame.runtime.cache import DiskCache
    from flame.runtime.compiler import KernelCache

    sources = [fl.from_numpy(np.ones(size, np.float32)) for size in (100, 200, 300)]
    results = [fl.exp(sources[0]), fl.sin(sources[1]), fl.cos(sources[2])][:count]
    _, compiled = compile_groups([result.node for result in results])
    items = [(text, spec.name, f"identity-{spec.name}") for spec, text, _ in compiled]
    cache = KernelCache(DiskCache(tmp_path), arch="sm_90")
    cubins = cache.cubins(items)
    assert len(cubins) == len(items) == count
    assert all(isinstance(cubin, bytes) and cubin for _, cubin in cubins)
    assert cache.stats.compiles == count


def lowered_specs(result: fl.Tensor):
    from flame.codegen.elementwise import lower_elementwise
    from flame.ir.graph import Graph
    from flame.ir.passes import run_pipeline
    from flame.runtime.executor import _layout_of

    graph = run_pipeline(Graph((result.node,)))
    return [lower_elementwise(group, _layout_of).spec for group in graph.groups]


def test_new_sizes_keep_kernel_identity(cuda_backend):
    """Sizes are kernel arguments: a new size renders the same code and keys the same cubin
    (``spec_key`` is what the compile cache looks kernels up by)."""
    from flame.codegen.render import code_key, render, spec_key

    identities = set()
    for rows, columns in [(256, 512), (128, 1024), (1000, 64)]:
        x = fl.from_numpy(np.ones((rows, columns), np.float32))
        bias = fl.from_numpy(np.ones(columns, np.float32))
        (spec,) = lowered_specs(fl.tanh(x * 2 + bias))
        identities.add((code_key(render(spec)), spec_key(spec)))
    assert len({code for code, _ in identities}) == 1, "the code itself changed with the size"
    assert len(identities) == 1, "spec_key changes with the size: every new size recompiles"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda dtype: dtype.name)
@pytest.mark.parametrize("scalar", [2.7, 0.1, 3])
def test_constants_mean_the_same_number_in_kernel_and_reference(dtype, scalar, cuda_backend):
    """A weak Python scalar becomes one constant: the literal the kernel uses is the value
    the reference interpreter uses (else GPU and oracle compute different things)."""
    from flame.codegen.spec import c_literal
    from flame.ir.evaluate import evaluate_leaf

    x = fl.from_numpy(np.ones(8, dtype.numpy))
    for result in (x * scalar, scalar + x, fl.maximum(x, scalar)):
        constants = [node for node in result.node.inputs if node.op == "const"]
        constants += [node.inputs[0] for node in result.node.inputs if node.op == "expand"]
        (constant,) = constants
        emitted = float(c_literal(constant.attr("value"), constant.dtype).removesuffix("f"))
        assert emitted == float(evaluate_leaf(constant)), f"{dtype.name} {result.node.op} {scalar}"


# --- (e) NaN propagation ------------------------------------------------------------------

NAN = float("nan")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda dtype: dtype.name)
def test_nan_propagates_through_maximum_minimum_clamp(dtype, reference_backend):
    left = fl.from_numpy(np.array([NAN, 1.0, -2.0, NAN, 0.25]).astype(dtype.numpy))
    right = fl.from_numpy(np.array([0.5, NAN, -3.0, NAN, 0.75]).astype(dtype.numpy))
    cases = {  # expected values per PyTorch's documentation: NaN in, NaN out
        "maximum": (fl.maximum(left, right), [NAN, NAN, -2.0, NAN, 0.75]),
        "maximum-reflected": (fl.maximum(right, left), [NAN, NAN, -2.0, NAN, 0.75]),
        "minimum": (fl.minimum(left, right), [NAN, NAN, -3.0, NAN, 0.25]),
        "minimum-reflected": (fl.minimum(right, left), [NAN, NAN, -3.0, NAN, 0.25]),
        "clamp": (fl.clamp(left, -1.0, 0.5), [NAN, 0.5, -1.0, NAN, 0.25]),
        "clamp-min": (left.clamp(min=0.0), [NAN, 1.0, 0.0, NAN, 0.25]),
        "clamp-max": (left.clamp(max=0.0), [NAN, 0.0, -2.0, NAN, 0.0]),
        "clamp-tensor-bounds": (fl.clamp(left, right, right), [NAN, NAN, -3.0, NAN, 0.75]),
        "clamp-nan-bound": (fl.clamp(left, min=NAN), [NAN] * 5),
    }
    for name, (result, expected) in cases.items():
        assert result.dtype is dtype, name
        np.testing.assert_array_equal(result.numpy().astype(np.float64), expected, err_msg=name)


# --- (f) bad input ------------------------------------------------------------------------


def assert_still_usable(pairs):
    """Each (tensor, expected array) realizes to the expected values."""
    for tensor, expected in pairs:
        np.testing.assert_array_equal(tensor.numpy(), expected)


def test_broadcast_mismatch_names_op_shapes_axis_and_line(reference_backend):
    left_array, right_array = np.arange(12.0, dtype=np.float32).reshape(3, 4), np.ones(5, np.int32)
    left, right = fl.from_numpy(left_array) * 2, fl.from_numpy(right_array)
    with pytest.raises(fl.ShapeError) as caught:
        line = current_line() + 1
        left + right
    message = str(caught.value)
    assert isinstance(caught.value, ValueError)
    for part in ("add", "[3, 4]", "[5]", "axis -1", f"[at test_ops.py:{line}]"):
        assert part in message, f"{part!r} not in {message!r}"
    assert_still_usable([(left, left_array * 2), (right, right_array)])


def test_unknown_dtype_name_raises_type_error(reference_backend):
    source = fl.from_numpy(np.ones(3, np.float32)) + 1
    with pytest.raises(TypeError, match="float128"):
        fl.zeros(3, dtype="float128")
    with pytest.raises(TypeError, match="complex32"):
        source.to("complex32")
    assert_still_usable([(source, np.full(3, 2.0, np.float32))])


@pytest.mark.parametrize(
    "attempt, op_name",
    [
        (lambda x: x + "a", "add"),
        (lambda x: "a" * x, "mul"),
        (lambda x: fl.exp([1, 2]), "exp"),
        (lambda x: fl.maximum(x, None), "maximum"),
        (lambda x: fl.where(x > 0, x, object()), "where"),
    ],
    ids=["tensor-plus-str", "str-times-tensor", "exp-of-list", "maximum-none", "where-object"],
)
def test_wrong_argument_type_names_the_op(attempt, op_name, reference_backend):
    array = np.array([1.0, -2.0, 3.0], np.float32)
    tensor = fl.from_numpy(array) - 1
    with pytest.raises(TypeError, match=op_name):
        attempt(tensor)
    assert_still_usable([(tensor, array - 1)])


def test_mixing_backends_raises_value_error():
    array = np.array([1.0, 2.0], np.float32)
    with fl.backend("reference"):
        on_cpu = fl.from_numpy(array) * 3
    with fl.backend("cuda"):
        on_gpu = fl.from_numpy(array)  # a buffer: reading it back needs no GPU
    with pytest.raises(ValueError, match="backends"):
        on_cpu + on_gpu
    with pytest.raises(ValueError, match="backends"):
        fl.maximum(on_gpu, on_cpu)
    assert on_cpu.backend == "reference" and on_gpu.backend == "cuda"
    assert_still_usable([(on_cpu, array * 3), (on_gpu, array)])


@pytest.mark.parametrize("condition_dtype", [fl.int32, fl.float32, fl.int64])
def test_where_needs_bool_condition(condition_dtype, reference_backend):
    condition_array = np.array([1, 0, 2]).astype(condition_dtype.numpy)
    condition = fl.from_numpy(condition_array)
    values = fl.from_numpy(np.array([1.0, 2.0, 3.0], np.float32)) + 1
    with pytest.raises(TypeError, match=f"where.*{condition_dtype.name}"):
        fl.where(condition, values, 0.0)
    expected = np.array([2.0, 0.0, 4.0], np.float32)
    assert_still_usable([(fl.where(condition != 0, values, 0.0), expected)])
    assert_still_usable([(condition, condition_array), (values, [2.0, 3.0, 4.0])])
