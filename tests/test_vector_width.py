"""The vector width of an elementwise kernel follows its contiguous operands and outputs
(flame/codegen/elementwise.py, ``VEC_FROM_FLAT_READS``): a scalar read (an optimizer's int64
step count) or a broadcast operand (a float32 bias next to 16-bit activations) no longer
narrows the loads of the rest. Values on the GPU: the gpu tier's elementwise tests."""

from __future__ import annotations

import numpy as np
import pytest
from test_codegen import source_of

import flame as fl
from flame.codegen import elementwise
from flame.codegen.render import render
from flame.runtime.compiler import nvrtc_compile


def _data(shape, dtype=np.float32, seed=0):
    return fl.from_numpy(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


def _int64_scalar():
    return fl.from_numpy(np.array(7, dtype=np.int64))


def test_an_int64_scalar_keeps_float32_at_four_lanes(cuda_backend):
    x, m = _data((64, 256)), _data((64, 256), seed=1)
    _, kernel = source_of(x * 0.9 + m * _int64_scalar().float())
    assert kernel.spec.vec == 4


def test_a_float32_bias_keeps_half_at_eight_lanes(cuda_backend):
    x = _data((64, 256), np.float16)
    bias = _data((256,), seed=2)
    _, kernel = source_of((x.float() + bias).half())
    assert kernel.spec.vec == 8


def test_switch_off_sizes_by_every_read(cuda_backend, monkeypatch):
    monkeypatch.setattr(elementwise, "VEC_FROM_FLAT_READS", False)
    x = _data((64, 256), np.float16)
    _, kernel = source_of((x.float() + _data((256,), seed=2)).half())
    assert kernel.spec.vec == 4


@pytest.mark.parametrize("which", ["scalar", "bias"])
def test_the_wider_kernels_compile(which, nvrtc, cuda_backend):
    if which == "scalar":
        out = _data((64, 256)) * _int64_scalar().float()
    else:
        out = (_data((64, 256), np.float16).float() + _data((256,), seed=2)).half()
    _, kernel = source_of(out)
    assert nvrtc_compile(render(kernel.spec), kernel.spec.name, "sm_90")[:4] == b"\x7fELF"


@pytest.mark.gpu
@pytest.mark.parametrize("columns", [256, 260, 7])  # vectors; a width no vector divides
def test_values_on_the_gpu(columns):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((33, columns)).astype(np.float16)
    bias = rng.standard_normal(columns).astype(np.float32)
    m = rng.standard_normal((33, columns)).astype(np.float32)
    with fl.backend("cuda"):
        biased = (fl.from_numpy(x).float() + fl.from_numpy(bias)).half().numpy()
        stepped = (fl.from_numpy(m) * _int64_scalar().float() + 1.0).numpy()
    expected = (x.astype(np.float32) + bias).astype(np.float16)
    np.testing.assert_array_equal(biased, expected)
    np.testing.assert_allclose(stepped, m * 7.0 + 1.0, rtol=1e-6, atol=1e-6)  # FMA or not
