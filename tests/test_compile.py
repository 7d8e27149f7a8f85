"""flame.compile: compiled == lazy == reference; signature cache; tracing errors."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl


def step(x, y, scale):
    return (fl.tanh(x * scale + y) * y.sigmoid()).sum(-1), x - y


def _inputs(rng, shape=(8, 16)):
    return [fl.tensor(rng.standard_normal(shape).astype(np.float32)) for _ in range(2)]


def test_compiled_matches_lazy_on_the_reference_backend(rng, reference_backend):
    compiled = fl.compile(step)
    x, y = _inputs(rng)
    got = compiled(x, y, 1.5)
    expected = step(x, y, 1.5)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)
    # a second call with other data replays the same program
    x2, y2 = _inputs(rng)
    again = compiled(x2, y2, 1.5)
    np.testing.assert_allclose(again[1].numpy(), x2.numpy() - y2.numpy(), rtol=1e-6)
    info = compiled.cache_info()
    assert (info.traces, info.hits, info.misses) == (1, 1, 1)


def test_signature_changes_retrace_with_a_reason(rng, reference_backend):
    compiled = fl.compile(step)
    x, y = _inputs(rng)
    compiled(x, y, 1.5)
    compiled(x, y, 2.5)  # static argument changed
    compiled(x.half(), y.half(), 2.5)  # dtype changed
    info = compiled.cache_info()
    assert info.traces == 3
    assert "argument 'scale'" in info.reasons[1] and "1.5" in info.reasons[1]
    assert "float16" in info.reasons[2]


def test_python_control_flow_on_a_traced_value_is_an_error(rng, reference_backend):
    def branchy(x):
        if x.sum() > 0:  # needs the value while tracing
            return x
        return -x

    with pytest.raises(fl.TraceError, match="test_compile.py"):
        fl.compile(branchy)(_inputs(rng)[0])


def test_unsupported_argument_type_is_an_error(reference_backend):
    with pytest.raises(TypeError, match="ndarray"):
        fl.compile(lambda x: x)(np.ones(3))


@pytest.mark.gpu
def test_compiled_matches_lazy_on_the_gpu_and_replays(rng):
    compiled = fl.compile(step)
    for _ in range(3):
        x, y = _inputs(rng, (64, 256))
        got = compiled(x, y, 0.5)
        expected = step(x, y, 0.5)
        for a, b in zip(got, expected):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
    assert compiled.cache_info().traces == 1
    assert compiled.cache_info().hits == 2


def test_deterministic_mode_is_part_of_the_signature(reference_backend):
    compiled = fl.compile(lambda x: (x * 2).sum(0))
    x = fl.tensor(np.ones((8, 4), np.float32)).realize()
    compiled(x)
    with fl.use_deterministic_algorithms(True):
        compiled(x)
        compiled(x)
    compiled(x)
    info = compiled.cache_info()
    assert info.traces == 2 and info.hits == 2
    assert info.reasons[-1] == "miss: deterministic algorithms on (a new plan)"


def test_a_compiled_function_called_inside_another_is_traced_through(reference_backend):
    inner = fl.compile(lambda x: x * 2)

    @fl.compile
    def outer(x, y):
        return inner(x) + inner(x * y) + 1

    for value in (1.0, 5.0, -3.0):
        x = fl.tensor(np.full(4, value, np.float32)).realize()
        y = fl.tensor(np.arange(4, dtype=np.float32)).realize()
        expected = value * 2 + value * np.arange(4) * 2 + 1
        np.testing.assert_allclose(outer(x, y).numpy(), expected)
    assert outer.cache_info().traces == 1 and outer.cache_info().hits == 2
    assert inner.cache_info().traces == 0  # never replayed on its own: part of outer's program
    np.testing.assert_allclose(inner(x).numpy(), np.full(4, -6.0))  # and alone it still works
