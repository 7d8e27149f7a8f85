"""Sample inputs for every elementwise op, built from its registry declaration.

The registry says which input kinds an op accepts (``categories``), where its inputs make
sense (``domains``: one ``(lo, hi)`` or ``(lo, hi, "nonzero")`` per input, ``(-3, 3)`` when
absent) and which attribute values to try (``attr_samples``). This module turns that into
NumPy arrays and Python numbers, and builds the op through the public API, so every test of
every op reads the one declaration.
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
            for position, (shape, dtype) in enumerate(zip(shapes, self.input_dtypes()))
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
        for right, result in zip(header, cells[1:]):
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
