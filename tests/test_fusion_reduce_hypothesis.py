"""Random programs mixing views, reductions and elementwise ops (Hypothesis).

CPU tier: the graph after the passes computes what the graph as built computes (reference
interpreter on both), every kernel of the fused plan compiles with NVRTC. GPU tier: the fused
GPU result equals the unfused float64 reference."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import flame as fl
from flame.codegen.lower import lower_group
from flame.codegen.render import render
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.runtime.compiler import nvrtc_compile
from flame.runtime.executor import _layout_of
from flame.runtime.reference import evaluate

# FLAME_HYPOTHESIS_EXAMPLES=300 for a longer search than the default CI run
CPU_EXAMPLES = int(os.environ.get("FLAME_HYPOTHESIS_EXAMPLES", "30"))
SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))

UNARY = {
    "tanh": lambda x: x.tanh(),
    "sigmoid": lambda x: x.sigmoid(),
    "squash_exp": lambda x: x.tanh().exp(),
    "abs": lambda x: x.abs(),
    "neg_half": lambda x: x * -0.5,
}
BINARY = {
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "sub": lambda a, b: a - b,
    "maximum": lambda a, b: fl.maximum(a, b),
}


@st.composite
def programs(draw):
    """A list of steps over a value stack; every step keeps shapes valid by construction."""
    rank = draw(st.integers(2, 3))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=rank, max_size=rank)))
    steps = []
    for _ in range(draw(st.integers(2, 8))):
        kind = draw(st.sampled_from(["unary", "binary", "reduce", "view", "view", "reduce"]))
        if kind == "unary":
            steps.append(("unary", draw(st.sampled_from(sorted(UNARY)))))
        elif kind == "binary":
            steps.append(("binary", draw(st.sampled_from(sorted(BINARY))), draw(st.booleans())))
        elif kind == "reduce":
            op = draw(st.sampled_from(["sum", "amax", "mean"]))
            steps.append(("reduce", op, draw(st.integers(0, 5)), draw(st.booleans())))
        else:
            steps.append(("view", draw(st.sampled_from(["transpose", "slice", "flatten", "flip"]))))
    return shape, steps, draw(st.integers(0, 2**16))


def build(shape, steps, seed):
    rng = np.random.default_rng(seed)
    x = fl.tensor(rng.standard_normal(shape).astype(np.float32))
    value = x
    outputs = []
    for step in steps:
        value = _apply(step, value, x)
        if rng.random() < 0.3:
            outputs.append(value)
    return outputs + [value]


def _apply(step, value, original):
    kind = step[0]
    if kind == "unary":
        return UNARY[step[1]](value)
    if kind == "binary":
        other = original if step[2] and original.shape == value.shape else value.tanh()
        return BINARY[step[1]](value, other)
    if kind == "reduce":
        if value.ndim == 0:
            return value
        axis = step[2] % value.ndim
        return getattr(fl, step[1])(value, axis, keepdim=step[3]) + value.amax() * 0.0
    return _view(step[1], value)


def _view(name, value):
    if value.ndim < 2:
        return value.reshape(-1) if value.ndim else value
    if name == "transpose":
        return value.transpose(0, -1)
    if name == "slice":
        return value[::2] if value.shape[0] > 1 else value[:, ::-1]
    if name == "flip":
        return value.flip(-1)
    return value.flatten()


@settings(max_examples=CPU_EXAMPLES, **SETTINGS)
@given(programs())
# two sums over size-1 axes of one [3, 1, 1] value landed in one row kernel, which could not
# lower the second (a reduction reading the first's per-row value); they are reshapes now
@example(
    program=((3, 1, 1), [("reduce", "sum", 2, True), ("reduce", "sum", 1, False)]
             + [("unary", "abs")] * 5, 1)
)  # fmt: skip
def test_passes_preserve_values_and_kernels_compile(program):
    shape, steps, seed = program
    with fl.backend("cuda"):  # building touches no GPU
        outputs = build(shape, steps, seed)
    nodes = tuple(out.node for out in outputs)
    before = evaluate(list(nodes), precision=np.float64, realized=False)
    graph = run_pipeline(Graph(nodes), verify_each=True)
    after = evaluate(list(graph.outputs), precision=np.float64, realized=False)
    for expected, got in zip(before, after):
        np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)
    for group in graph.groups:
        if group.kind != "library":
            spec = lower_group(group, _layout_of).spec
            assert nvrtc_compile(render(spec), spec.name, "sm_90")[:4] == b"\x7fELF"


@pytest.mark.gpu
@settings(max_examples=60, **SETTINGS)
@given(programs())
# a reversed slice of a size-1-axis sum was written by the sum's kernel in row order
@example(
    program=((1, 2, 2), [("reduce", "sum", 0, True), ("view", "slice"), ("view", "flatten")], 0)
)
def test_gpu_fused_result_matches_float64_reference(program):
    shape, steps, seed = program
    outputs = build(shape, steps, seed)
    expected = evaluate([out.node for out in outputs], precision=np.float64, realized=False)
    fl.realize(*outputs)
    for out, reference in zip(outputs, expected):
        np.testing.assert_allclose(out.numpy().astype(np.float64), reference, rtol=1e-4, atol=1e-5)
