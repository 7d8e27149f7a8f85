"""cat/stack/pad/triu/tril/repeat and the in-kernel random ops (bernoulli, dropout):
reference backend against NumPy/PyTorch (CPU tier), GPU against the reference (gpu tier)."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
from flame.codegen.lower import lower_group
from flame.codegen.render import render
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.runtime.compiler import nvrtc_compile
from flame.runtime.executor import _layout_of

F = fl.nn.functional

CASES = [
    ("cat_dim1", lambda a, b: fl.cat([a, b * 2], 1), lambda a, b: np.concatenate([a, b * 2], 1)),
    ("cat_promotes", lambda a, b: fl.cat([a, b.half()], 0), lambda a, b: np.concatenate([a, b.astype(np.float16).astype(np.float32)], 0)),
    ("stack", lambda a, b: fl.stack([a, b], 1), lambda a, b: np.stack([a, b], 1)),
    ("pad", lambda a, b: F.pad(a, (1, 2, 0, 1), value=-1.5), lambda a, b: np.pad(a, ((0, 1), (1, 2)), constant_values=-1.5)),
    ("triu", lambda a, b: a.triu(1) + b, lambda a, b: np.triu(a, 1) + b),
    ("tril", lambda a, b: fl.tril(a, -1), lambda a, b: np.tril(a, -1)),
    ("repeat", lambda a, b: a.repeat(2, 1, 3), lambda a, b: np.tile(a, (2, 1, 3))),
]  # fmt: skip


@pytest.mark.parametrize("name,build,expected", CASES, ids=[c[0] for c in CASES])
def test_reference_matches_numpy(name, build, expected, rng, reference_backend):
    a, b = rng.standard_normal((2, 4, 5)).astype(np.float32)
    result = build(fl.tensor(a), fl.tensor(b)).numpy()
    np.testing.assert_allclose(result, expected(a, b), rtol=1e-6)


@pytest.mark.parametrize("name,build,expected", CASES, ids=[c[0] for c in CASES])
def test_generated_kernels_compile(name, build, expected, rng, nvrtc):
    a, b = rng.standard_normal((2, 4, 5)).astype(np.float32)
    with fl.backend("cuda"):
        out = build(fl.from_numpy(a), fl.from_numpy(b))
    graph = run_pipeline(Graph((out.node,)), verify_each=True)
    kinds = [group.kind for group in graph.groups]
    assert kinds, name
    for group in graph.groups:
        if group.kind != "library":
            spec = lower_group(group, _layout_of).spec
            assert nvrtc_compile(render(spec), spec.name, "sm_90")


def test_cat_and_pad_errors_name_the_shapes(reference_backend):
    with pytest.raises(fl.ShapeError, match=r"\[2, 3\].*\[2, 4\].*dim 0"):
        fl.cat([fl.ones(2, 3), fl.ones(2, 4)], 0)
    with pytest.raises(fl.ShapeError, match="stack"):
        fl.stack([fl.ones(2), fl.ones(3)])
    with pytest.raises(ValueError, match="constant"):
        F.pad(fl.ones(2), (1, 1), mode="reflect")


def test_dropout_is_reproducible_and_scaled(reference_backend):
    x = fl.ones(20000)
    first = F.dropout(x, 0.25, seed=7).numpy()
    assert np.array_equal(first, F.dropout(x, 0.25, seed=7).numpy())
    assert not np.array_equal(first, F.dropout(x, 0.25, seed=8).numpy())
    assert abs((first == 0).mean() - 0.25) < 0.02
    np.testing.assert_allclose(first[first != 0], 1 / 0.75, rtol=1e-6)
    assert F.dropout(x, 0.25, training=False) is x


def test_bernoulli_probabilities(reference_backend):
    p = fl.tensor(np.linspace(0, 1, 11, dtype=np.float32)).reshape(11, 1).expand(11, 4000)
    draws = fl.bernoulli(p, seed=2).numpy()
    np.testing.assert_allclose(draws.mean(1), np.linspace(0, 1, 11), atol=0.03)
    assert draws[0].max() == 0 and draws[-1].min() == 1


@pytest.mark.gpu
@pytest.mark.parametrize("name,build,expected", CASES, ids=[c[0] for c in CASES])
def test_gpu_matches_numpy(name, build, expected, rng):
    a, b = rng.standard_normal((2, 4, 5)).astype(np.float32)
    np.testing.assert_allclose(build(fl.tensor(a), fl.tensor(b)).numpy(), expected(a, b), rtol=1e-6)


@pytest.mark.gpu
def test_gpu_random_matches_reference_bits():
    x = fl.randn(3, 1000, seed=11)
    dropped = F.dropout(x * 2.0, 0.5, seed=12)
    with fl.backend("reference"):
        expected = F.dropout(fl.randn(3, 1000, seed=11) * 2.0, 0.5, seed=12).numpy()
    got = dropped.numpy()
    assert np.array_equal(got == 0, expected == 0)  # the same mask: Philox is exact
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
