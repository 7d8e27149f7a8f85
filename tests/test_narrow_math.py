"""Transcendentals for 16-bit results (the ``f16`` expressions of flame/ir/ops): where a
result is float16/bfloat16, ``exp`` runs on the hardware exp2 and ``gelu`` on a short erf
approximation; float32 results keep the accurate library functions. The CPU tier checks which
expression each dtype renders, the helpers a kernel carries and that NVRTC compiles them; the
GPU tier checks the values against float64 over dense ranges."""

from __future__ import annotations

import math

import numpy as np
import pytest

import flame as fl
from flame.codegen.elementwise import lower_elementwise
from flame.codegen.render import render
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.runtime.compiler import nvrtc_compile
from flame.runtime.executor import _layout_of

NARROW = {"bfloat16": fl.bfloat16, "float16": fl.float16}


def _source(tensor) -> str:
    graph = run_pipeline(Graph((tensor.node,)))
    (group,) = graph.groups
    return render(lower_elementwise(group, _layout_of).spec)


def _input(dtype):
    values = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32)
    return fl.from_numpy(values).to(dtype)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_each_dtype_renders_its_expression_and_only_the_helpers_it_calls(
    reference_backend, name
):
    dtype = getattr(fl, name)
    narrow = name in NARROW
    gelu = _source(fl.gelu(_input(dtype) * 2.0))
    assert ("flame_gelu_none_16(v" in gelu) is narrow
    assert ("erff(" in gelu) is not narrow
    assert "flame_gelu_tanh" not in gelu  # helpers of the op's other forms stay out
    tanh_form = _source(fl.gelu(_input(dtype), approximate="tanh"))
    assert "flame_gelu_none" not in tanh_form
    assert ("flame_gelu_tanh_16(v" in tanh_form) is narrow
    exp = _source(fl.exp(_input(dtype) - 1.0))
    assert ("__expf(" in exp) is narrow
    assert ("= expf(" in exp) is not narrow
    for source in (gelu, tanh_form, exp):
        assert nvrtc_compile(source, "narrow_math", "sm_90")[:4] == b"\x7fELF"


def _ulp(values: np.ndarray, dtype) -> np.ndarray:
    """The spacing of ``dtype`` at each value's magnitude."""
    mantissa = 10 if dtype is fl.float16 else 7
    exponent = np.floor(np.log2(np.maximum(np.abs(values), 2.0**-14)))
    return 2.0 ** (exponent - mantissa)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(NARROW))
@pytest.mark.parametrize(
    ("op", "low", "high"),
    [("gelu", -8.0, 8.0), ("exp", -9.0, 9.0)],
)
def test_narrow_results_stay_within_an_ulp_of_float64(cuda_backend, name, op, low, high):
    dtype = NARROW[name]
    x = fl.from_numpy(np.linspace(low, high, 1 << 18, dtype=np.float32)).to(dtype).realize()
    inputs = x.float().numpy().astype(np.float64)  # the values the kernel reads
    if op == "gelu":
        exact = 0.5 * inputs * (1 + np.vectorize(math.erf)(inputs / math.sqrt(2)))
        got = fl.gelu(x)
    else:
        exact = np.exp(inputs)
        got = fl.exp(x)
    got = got.float().numpy().astype(np.float64)
    # one ulp of the 16-bit result (the rounding itself takes up to half of it); in gelu's
    # far negative tail, where |gelu| < 1e-4, the absolute error of the erf forms (< 5e-7)
    error = np.abs(got - exact)
    allowed = np.maximum(_ulp(exact, dtype), 5e-7)
    worst = int(np.argmax(error / allowed))
    assert error[worst] <= allowed[worst], (op, name, inputs[worst], got[worst], exact[worst])
