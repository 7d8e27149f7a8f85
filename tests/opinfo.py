"""Sample inputs for every elementwise op, built from its registry declaration.

The registry says which input kinds an op accepts (``categories``), where its inputs make
sense (``domains``: one ``(lo, hi)`` or ``(lo, hi, "nonzero")`` per input, ``(-3, 3)`` when
absent) and which attribute values to try (``attr_samples``). This module turns that into
NumPy arrays and Python numbers, and builds the op through the public API, so every test of
every op reads the one declaration.

It also holds what the tests compare against: the promotion table of the documentation, and
each op's NumPy semantics written independently of FLAME's own references (``SEMANTICS``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

import flame as fl
from flame.ir.dtypes import dtype as resolve_dtype
from flame.ir.ops import OpDef, elementwise_ops
from flame.tensor import apply

DTYPES = (fl.float32, fl.float16, fl.bfloat16, fl.int32, fl.int64, fl.bool_)
FLOAT_DTYPES = (fl.float32, fl.float16, fl.bfloat16)
DEFAULT_DOMAIN = (-3.0, 3.0)
NONZERO_MINIMUM = 0.5


@dataclass(frozen=True)
class OpCase:
    """One op at one input dtype: the unit every registry-driven test is parametrized by."""

    op: OpDef
    dtype: fl.DType

    @property
    def id(self) -> str:
        return f"{self.op.name}-{self.dtype.name}"

    def input_dtypes(self) -> tuple[fl.DType, ...]:
        """The dtype of each input: ``where`` takes a bool condition first."""
        if self.op.name == "where":
            return (fl.bool_,) + (self.dtype,) * (self.op.arity - 1)
        return (self.dtype,) * self.op.arity

    def attr_samples(self) -> tuple[dict, ...]:
        """The declared attribute samples; ``cast`` has one per target dtype."""
        if self.op.name == "cast":
            return tuple({"dtype": target} for target in DTYPES)
        return tuple(dict(sample) for sample in self.op.attr_samples)

    def arrays(self, rng: np.random.Generator, shapes) -> list[np.ndarray]:
        """One random array per input, of the given shapes, inside the op's domains."""
        return [
            sample_array(rng, shape, dtype, domain_of(self.op, position))
            for position, (shape, dtype) in enumerate(
                zip(shapes, self.input_dtypes(), strict=False)
            )
        ]

    def scalar(self, rng: np.random.Generator, position: int):
        """A Python number of this case's kind for input ``position`` (a weak scalar)."""
        value = sample_array(rng, (), self.input_dtypes()[position], domain_of(self.op, position))
        return value.item() if self.dtype.is_bool or self.dtype.is_int else float(value)


def accepts(op: OpDef, dtype: fl.DType) -> bool:
    return op.accepts(dtype.category)


def cases(dtypes=DTYPES, arity=None) -> list[OpCase]:
    """Every elementwise op of the registry at every dtype its ``categories`` accept."""
    found = []
    for op in elementwise_ops():
        if arity is not None and op.arity not in arity:
            continue
        found.extend(OpCase(op, dtype) for dtype in dtypes if accepts(op, dtype))
    return found


def params(dtypes=DTYPES, arity=None) -> list:
    """``cases`` as pytest params with ids like ``exp-float16``."""
    return [pytest.param(case, id=case.id) for case in cases(dtypes, arity)]


def domain_of(op: OpDef, position: int) -> tuple:
    if position < len(op.domains):
        return tuple(op.domains[position])
    return DEFAULT_DOMAIN


def sample_array(rng: np.random.Generator, shape, dtype: fl.DType, domain) -> np.ndarray:
    """Uniform numbers in ``domain``, stored as ``dtype`` holds them.

    Integers are the rounded float samples kept inside the domain; ``"nonzero"`` keeps
    ``|v| >= 0.5`` (and integers away from 0); bools are fair coin flips.
    """
    shape = tuple(shape)
    if dtype.is_bool:
        return np.asarray(rng.random(shape) < 0.5)
    low, high = domain[0], domain[1]
    nonzero = len(domain) > 2 and domain[2] == "nonzero"
    values = rng.uniform(low, high, size=shape)
    if nonzero:
        small = np.abs(values) < NONZERO_MINIMUM
        values = np.where(small, values + np.copysign(NONZERO_MINIMUM, values), values)
    if dtype.is_int:
        values = np.clip(np.round(values), math.ceil(low), math.floor(high))
        if nonzero:
            values = np.where(values == 0, 1, values)
    return np.asarray(values).astype(dtype.numpy)


def build(op_name: str, operands, attrs=None) -> fl.Tensor:
    """``op_name`` over tensors and Python numbers through the public API: ``fl.<name>``
    when FLAME exports it (``cast`` is ``Tensor.to``), else the generic builder."""
    attrs = dict(attrs or {})
    if op_name == "cast":
        return operands[0].to(attrs["dtype"])
    function = getattr(fl, op_name, None)
    if callable(function) and not isinstance(function, type):
        return function(*operands, **attrs)
    return apply(op_name, *operands, **attrs)


def tensors(arrays) -> list[fl.Tensor]:
    return [fl.from_numpy(np.ascontiguousarray(array)) for array in arrays]


# Named input layouts for kernels: the inputs' shapes, and the shape the result is brought to
# (a buffer is added on top when the op's own result is smaller, so it is read broadcast).
VARIANTS = {
    "odd": (lambda arity: [(7, 13)] * arity, (7, 13)),  # 91 elements: a vector tail
    "broadcast": (lambda arity: [(4096,)] + [(64, 4096)] * (arity - 1), (64, 4096)),
    "scalar": (lambda arity: [(7, 13)] * (arity - 1) + [()] if arity > 1 else [()], (7, 13)),
    "large": (lambda arity: [(2**20 + 3,)] * arity, (2**20 + 3,)),
}


def variant_outputs(case: OpCase, variant: str, attrs, rng) -> list[fl.Tensor]:
    """The op over inputs laid out as ``VARIANTS[variant]``, on the current backend; the
    ``scalar`` variant adds a second output with a weak Python scalar as the last input."""
    shapes_of, target = VARIANTS[variant]
    arrays = case.arrays(rng, shapes_of(case.op.arity))
    outputs = [build(case.op.name, tensors(arrays), attrs)]
    if variant == "scalar" and case.op.arity > 1:
        weak = tensors(arrays[:-1]) + [case.scalar(rng, case.op.arity - 1)]
        outputs.append(build(case.op.name, weak, attrs))
    if outputs[0].shape != target:
        padding = np.zeros(target, outputs[0].dtype.numpy)
        outputs[0] = outputs[0] + fl.from_numpy(padding)
    return outputs


# IEEE special values and signed zeros; no finite value whose result would overflow float32.
SPECIAL_VALUES = (math.nan, math.inf, -math.inf, -0.0, 0.0, 0.5, -1.0, 2.5)


def special_arrays(case: OpCase) -> list[np.ndarray]:
    """Every special value (every pair of them, for binary ops) in ``case.dtype``."""
    values = np.array(SPECIAL_VALUES)
    if case.op.arity == 1:
        grids = [values]
    else:
        grids = [grid.ravel() for grid in np.meshgrid(values, values, indexing="ij")]
    arrays = [grid.astype(case.dtype.numpy) for grid in grids]
    if case.op.name == "where":
        condition = np.arange(arrays[0].size) % 3 == 0
        arrays = [condition, *arrays]
    return arrays


def special_attr_samples(case: OpCase) -> tuple[dict, ...]:
    """Attribute samples for special values: casts only to floats (C leaves NaN and
    infinity converted to an integer undefined)."""
    samples = case.attr_samples()
    if case.op.name == "cast":
        return tuple(s for s in samples if resolve_dtype(s["dtype"]).is_float)
    return samples


# --- the documented dtype rule ------------------------------------------------------------

CATEGORY = {"bool": 0, "int32": 1, "int64": 1, "float16": 2, "bfloat16": 2, "float32": 2}
ABBREVIATIONS = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}


def documented_promotion() -> dict[tuple[str, str], str]:
    """The promotion table of ``flame/ir/dtypes.py``'s docstring, as ``(a, b) -> result``
    dtype names: the tests hold the code to what the documentation promises."""
    from flame.ir import dtypes as dtypes_module

    rows = [line for line in dtypes_module.__doc__.splitlines() if line.startswith("|")]
    split = [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in rows]
    header, body = split[0][1:], split[2:]
    table = {}
    for cells in body:
        for right, result in zip(header, cells[1:], strict=True):
            table[(cells[0], right)] = ABBREVIATIONS.get(result, result)
    return table


def _weak(tensor_dtype: str, scalar) -> str:
    """Python scalars only raise the category (float -> float32, int -> int64)."""
    category = 0 if isinstance(scalar, bool) else (1 if isinstance(scalar, int) else 2)
    if category <= CATEGORY[tensor_dtype]:
        return tensor_dtype
    return "float32" if category == 2 else "int64"


def expected_dtypes(op: OpDef, operands, attrs) -> tuple[str, str] | None:
    """``(compute dtype, result dtype)`` names for ``op`` over ``operands`` (``fl.DType`` for
    a tensor, a Python number for a scalar); None where the op must raise TypeError."""
    if op.name == "cast":
        return operands[0].name, resolve_dtype(attrs["dtype"]).name
    values = operands[1:] if op.name == "where" else operands
    table = documented_promotion()
    tensor_dtypes = [value.name for value in values if isinstance(value, fl.DType)]
    scalars = [value for value in values if not isinstance(value, fl.DType)]
    if tensor_dtypes:
        result = tensor_dtypes[0]
        for other in tensor_dtypes[1:]:
            result = table[(result, other)]
    else:
        result = _weak("bool", scalars.pop(0))
    for scalar in scalars:
        result = _weak(result, scalar)
    if op.promotion == "int_to_float" and CATEGORY[result] < 2:
        result = "float32"
    if "bif"[CATEGORY[result]] not in op.categories:
        return None
    return result, ("bool" if op.out_bool else result)


# --- lowering and compiling ----------------------------------------------------------------


def assert_user_error(call, error, words, at: str | None = None) -> None:
    """``call()`` raises ``error`` whose message holds every one of ``words`` (the op, the
    shapes, the argument) and, given ``at``, the user's file it was raised at."""
    with pytest.raises(error) as raised:
        call()
    message = str(raised.value)
    for word in words:
        assert word in message, (word, message)
    if at is not None:
        assert at in message, (at, message)


def assert_compiled_matches_lazy(op, x, seed, rtol=1e-6, atol=1e-6) -> None:
    """``op(x)`` and the gradient of ``sum(op(x) * seed)`` for ``x`` (which requires grad):
    the same under ``fl.compile`` as run lazily."""

    def step(x):
        out = op(x)
        (out * seed).sum().backward()
        return out

    compiled = fl.compile(step)(x)
    compiled_grad = x.grad.numpy()
    x.grad = None
    lazy = step(x)
    np.testing.assert_allclose(compiled.numpy(), lazy.numpy(), rtol=rtol, atol=atol)
    np.testing.assert_allclose(compiled_grad, x.grad.numpy(), rtol=rtol, atol=atol)


def compile_groups(nodes, arch: str = "sm_90"):
    """Run the passes over the graph of ``nodes``, lower every fused group, render it and
    compile it with NVRTC. Returns ``(processed graph, [(spec, source, cubin), ...])``."""
    from flame.codegen.elementwise import lower_elementwise
    from flame.codegen.render import render
    from flame.ir.graph import Graph
    from flame.ir.passes import run_pipeline
    from flame.runtime.compiler import nvrtc_compile
    from flame.runtime.executor import _layout_of

    graph = run_pipeline(Graph(tuple(nodes)))
    compiled = []
    for group in graph.groups:
        spec = lower_elementwise(group, _layout_of).spec
        source = render(spec)
        compiled.append((spec, source, nvrtc_compile(source, spec.name, arch)))
    return graph, compiled


def compile_plan_kernels(nodes, arch: str = "sm_90"):
    """The CUDA plan of ``nodes`` without a GPU: the passes, then every fused group (any
    kind but library calls) lowered, rendered and compiled with NVRTC. Returns the cubins
    (at least one is asserted)."""
    from flame.codegen.lower import lower_group
    from flame.codegen.render import render
    from flame.ir.graph import Graph
    from flame.ir.passes import run_pipeline
    from flame.runtime.compiler import nvrtc_compile
    from flame.runtime.executor import _layout_of

    graph = run_pipeline(Graph(tuple(nodes)))
    specs = [lower_group(group, _layout_of).spec for group in graph.groups
             if group.kind != "library"]  # fmt: skip
    assert specs, "the plan has no kernel"
    return [nvrtc_compile(render(spec), spec.name, arch) for spec in specs]


# --- NumPy semantics, independent of FLAME's references (PyTorch's meaning) -------------

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _gelu(x, approximate="none"):
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + _erf(x / math.sqrt(2)))


def _softplus(x, beta=1.0, threshold=20.0):
    linear = x * beta > threshold
    return np.where(linear, x, np.log1p(np.exp(np.where(linear, 0, beta * x))) / beta)


def _integer_power(base, exponent):
    """Integer powers as PyTorch computes them: a negative exponent gives 0, except for
    bases 1 and -1 (C's integer division of 1 by the power)."""

    def one(b, e):
        if e >= 0:
            return b**e
        return 1 if b == 1 else ((-1) ** (-e) if b == -1 else 0)

    return np.vectorize(one, otypes=[base.dtype])(base, exponent)


def _logical_or_arithmetic(logical, arithmetic):
    return lambda a, b: logical(a, b) if a.dtype == np.bool_ else arithmetic(a, b)


SEMANTICS = {
    "exp": np.exp,
    "log": np.log,
    "log1p": np.log1p,
    "expm1": np.expm1,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "sin": np.sin,
    "cos": np.cos,
    "tanh": np.tanh,
    "sigmoid": lambda x: 0.5 * (1 + np.tanh(0.5 * x)),
    "silu": lambda x: x * 0.5 * (1 + np.tanh(0.5 * x)),
    "reciprocal": lambda x: 1.0 / x,
    "gelu": _gelu,
    "softplus": _softplus,
    "neg": np.negative,
    "abs": lambda x: x if x.dtype == np.bool_ else np.abs(x),
    "relu": lambda x: np.where(x > 0, x, 0),
    "leaky_relu": lambda x, negative_slope=0.01: np.where(x > 0, x, x * negative_slope),
    "floor": np.floor,
    "ceil": np.ceil,
    "round": np.round,  # half to even, as torch.round
    "sign": lambda x: x if x.dtype == np.bool_ else np.sign(x),
    "logical_not": np.logical_not,
    "bitwise_not": lambda x: np.logical_not(x) if x.dtype == np.bool_ else ~x,
    "add": _logical_or_arithmetic(np.logical_or, np.add),
    "sub": np.subtract,
    "mul": _logical_or_arithmetic(np.logical_and, np.multiply),
    "div": lambda a, b: a / b,
    "floordiv": np.floor_divide,
    "remainder": np.remainder,
    "pow": lambda a, b: np.power(a, b) if a.dtype.kind == "f" else _integer_power(a, b),
    "maximum": np.maximum,
    "minimum": np.minimum,
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "bitwise_and": np.bitwise_and,
    "bitwise_or": np.bitwise_or,
    "bitwise_xor": np.bitwise_xor,
    "where": np.where,
    "cast": lambda x, dtype: x.astype(resolve_dtype(dtype).numpy),
    # issue 18's ops (erfinv and nan_to_num: their own references)
    "exp2": lambda x: 2.0**x,
    "log2": lambda x: np.log(x) / math.log(2.0),
    "log10": lambda x: np.log(x) / math.log(10.0),
    "asin": np.arcsin,
    "acos": np.arccos,
    "atan": np.arctan,
    "sinh": np.sinh,
    "cosh": np.cosh,
    "tan": np.tan,
    "asinh": np.arcsinh,
    "acosh": np.arccosh,
    "atanh": np.arctanh,
    "trunc": np.trunc,
    "isnan": lambda x: np.isnan(x) if x.dtype.kind == "f" else np.zeros(x.shape, bool),
    "isinf": lambda x: np.isinf(x) if x.dtype.kind == "f" else np.zeros(x.shape, bool),
    "isfinite": lambda x: np.isfinite(x) if x.dtype.kind == "f" else np.ones(x.shape, bool),
    "atan2": np.arctan2,
    "copysign": np.copysign,
    "fmod": np.fmod,
    "logaddexp": np.logaddexp,
    # integers arrive as int64: a shift of an int32 by 32..63 leaves 0 in its low 32 bits
    "bitwise_left_shift": lambda a, b: np.where((b < 0) | (b > 63), 0, a << np.clip(b, 0, 63)),
    "bitwise_right_shift": lambda a, b: a >> np.where((b < 0) | (b > 63), 63, b),
    "clamp": lambda x, low, high: np.minimum(np.maximum(x, low), high),
    "clamp_min": np.maximum,
    "clamp_max": np.minimum,
}


def _kind(value):
    return resolve_dtype(value.dtype) if isinstance(value, np.ndarray) else value


def _lift(value, compute: str) -> np.ndarray:
    """``value`` as the op computes it: cast to the promoted dtype, then widened."""
    array = np.asarray(value).astype(resolve_dtype(compute).numpy)
    if array.dtype.kind == "b":
        return array
    return array.astype(np.int64 if array.dtype.kind in "iu" else np.float64)


def expected_values(op, values, attrs) -> tuple[np.ndarray, str]:
    """(value in float64 for float results, exact otherwise; result dtype name)."""
    compute, result_dtype = expected_dtypes(op, [_kind(value) for value in values], attrs)
    lifted = [_lift(value, compute) for value in values]
    if op.name == "where":
        lifted[0] = np.asarray(values[0]).astype(bool)
    semantics = SEMANTICS.get(op.name, op.ref)  # an op declared after this table: its own ref
    with np.errstate(all="ignore"):
        result = np.asarray(semantics(*lifted, **attrs))
    if resolve_dtype(result_dtype).is_float:
        return result.astype(np.float64), result_dtype
    return result.astype(resolve_dtype(result_dtype).numpy), result_dtype
