"""Reductions, views and the composites of flame.nn.functional: values on the reference
backend against NumPy/PyTorch (CPU tier), fused kernels on the GPU against the float64
reference (gpu tier), and the kernel counts the fusion pass promises."""

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
from flame.runtime.reference import evaluate

F = fl.nn.functional


def _array(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


# (name, builder(x) -> tensor, numpy(x) -> array, input shape)
CASES = [
    ("sum_last", lambda x: x.sum(-1), lambda a: a.sum(-1), (6, 33)),
    ("sum_middle", lambda x: x.sum(1), lambda a: a.sum(1), (4, 17, 9)),
    ("sum_all", lambda x: fl.sum(x), lambda a: a.sum(), (5, 7)),
    ("sum_axes_keepdim", lambda x: x.sum((0, 2), keepdim=True), lambda a: a.sum((0, 2), keepdims=True), (3, 4, 5)),
    ("mean_neg_axis", lambda x: x.mean(-2), lambda a: a.mean(-2), (3, 8, 5)),
    ("max_last", lambda x: x.amax(-1), lambda a: a.max(-1), (7, 40)),
    ("min_first", lambda x: x.amin(0), lambda a: a.min(0), (9, 6)),
    ("prod", lambda x: (x * 0.1 + 1).prod(1), lambda a: (a * np.float32(0.1) + 1).prod(1), (4, 6)),
    ("var", lambda x: x.var(1), lambda a: a.var(1, ddof=1), (5, 50)),
    ("std_correction0", lambda x: x.std(0, correction=0), lambda a: a.std(0), (30, 4)),
    ("logsumexp", lambda x: fl.logsumexp(x * 10, 1), lambda a: np.log(np.exp(a * 10).sum(1)), (4, 20)),
    ("argmax", lambda x: x.argmax(1), lambda a: a.argmax(1), (6, 31)),
    ("argmin_all", lambda x: x.argmin(), lambda a: a.argmin(), (4, 5)),
    ("any", lambda x: (x > 1.5).any(1), lambda a: (a > 1.5).any(1), (8, 9)),
    ("all", lambda x: (x > -2).all(0), lambda a: (a > -2).all(0), (8, 9)),
    ("softmax", lambda x: F.softmax(x, -1), None, (8, 100)),
    ("softmax_dim0", lambda x: F.softmax(x, 0), None, (30, 7)),
    ("log_softmax", lambda x: F.log_softmax(x, 1), None, (8, 100)),
    ("layer_norm", lambda x: F.layer_norm(x, (64,)), None, (6, 64)),
    ("rms_norm", lambda x: F.rms_norm(x, (64,)), None, (6, 64)),
    ("group_norm", lambda x: F.group_norm(x, 2), None, (2, 4, 3, 3)),
    ("transpose_add", lambda x: x.T + x.sum(1), lambda a: a.T + a.sum(1), (5, 5)),
    ("slice_flip", lambda x: x[1:, ::-2] * 2, lambda a: a[1:, ::-2] * 2, (6, 9)),
    ("reshape_permute", lambda x: x.reshape(3, 4, 5).permute(2, 0, 1).exp(), lambda a: np.exp(a.reshape(3, 4, 5).transpose(2, 0, 1)), (12, 5)),
    ("index_none_ellipsis", lambda x: x[..., None, 2] + 1, lambda a: a[..., None, 2] + 1, (3, 4, 5)),
    ("squeeze_unsqueeze", lambda x: x.unsqueeze(0).squeeze(0).flatten(), lambda a: a.reshape(-1), (3, 4)),
    ("narrow", lambda x: x.narrow(1, 2, 3).sum(0), lambda a: a[:, 2:5].sum(0), (4, 7)),
]  # fmt: skip


def _torch_reference(name, array):
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(array.astype(np.float64))
    functional = torch.nn.functional
    table = {
        "softmax": lambda: functional.softmax(t, -1),
        "softmax_dim0": lambda: functional.softmax(t, 0),
        "log_softmax": lambda: functional.log_softmax(t, 1),
        "layer_norm": lambda: functional.layer_norm(t, (64,)),
        "rms_norm": lambda: functional.rms_norm(t, (64,), eps=1.1920928955078125e-07),
        "group_norm": lambda: functional.group_norm(t, 2),
    }
    return table[name]().numpy()


@pytest.mark.parametrize("name,build,numpy_fn,shape", CASES, ids=[c[0] for c in CASES])
def test_reference_matches_numpy_or_torch(name, build, numpy_fn, shape, rng, reference_backend):
    array = _array(rng, shape)
    result = build(fl.tensor(array)).numpy()
    expected = numpy_fn(array) if numpy_fn else _torch_reference(name, array)
    assert result.shape == np.shape(expected)
    np.testing.assert_allclose(result, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,build,numpy_fn,shape", CASES, ids=[c[0] for c in CASES])
def test_kernels_compile_with_nvrtc(name, build, numpy_fn, shape, rng, nvrtc):
    with fl.backend("cuda"):
        out = build(fl.from_numpy(_array(rng, shape)))
    graph = run_pipeline(Graph((out.node,)), verify_each=True)
    for group in graph.groups:
        if group.kind == "library":
            continue
        spec = lower_group(group, _layout_of).spec
        assert nvrtc_compile(render(spec), spec.name, "sm_90")[:4] == b"\x7fELF"


@pytest.mark.parametrize(
    "name,build,expected_kernels",
    [
        ("softmax", lambda x: F.softmax(x, -1), 1),
        ("layer_norm", lambda x: F.layer_norm(x, (64,), fl.ones(64), fl.zeros(64)), 1),
        ("rms_norm", lambda x: F.rms_norm(x, (64,), fl.ones(64)), 1),
        ("sum_of_squares_prologue", lambda x: (x * x).mean(-1), 1),
        ("epilogue_after_sum", lambda x: (x.sum(-1) * 2).exp(), 1),
        ("argmax", lambda x: x.argmax(1), 1),
        ("transpose_view_add", lambda x: x.T * 2 + 1, 1),
    ],
)
def test_fusion_kernel_counts(name, build, expected_kernels, rng):
    with fl.backend("cuda"):
        out = build(fl.from_numpy(_array(rng, (16, 64))))
    graph = run_pipeline(Graph((out.node,)))
    assert len(graph.groups) == expected_kernels, [g.kind for g in graph.groups]


def test_bad_axes_and_shapes_fail_at_the_users_line(reference_backend):
    x = fl.ones(2, 3)
    with pytest.raises(IndexError, match=r"dim 2 is out of range \[-2, 1\]"):
        x.sum(2)
    with pytest.raises(fl.ShapeError, match=r"\[2, 3\].*\[4, 2\]") as caught:
        x.reshape(4, 2)
    assert "test_reductions_views.py" in str(caught.value)
    with pytest.raises(IndexError, match="out of bounds"):
        x[5]
    np.testing.assert_array_equal(x.numpy(), np.ones((2, 3)))  # still usable


@pytest.mark.gpu
@pytest.mark.parametrize("name,build,numpy_fn,shape", CASES, ids=[c[0] for c in CASES])
def test_gpu_matches_float64_reference(name, build, numpy_fn, shape, rng):
    array = _array(rng, shape)
    out = build(fl.tensor(array))
    expected = evaluate([out.node], precision=np.float64, realized=False)[0]
    result = out.numpy()
    np.testing.assert_allclose(result.astype(np.float64), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols", [(3, 5000), (2, 70000), (1000, 7)])
def test_gpu_long_and_short_rows(rows, cols, rng):
    array = _array(rng, (rows, cols))
    x = fl.tensor(array)
    softmax, norm = F.softmax(x, -1), F.layer_norm(x, (cols,))
    fl.realize(softmax, norm)
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(array.astype(np.float64))
    np.testing.assert_allclose(softmax.numpy(), torch.softmax(t, -1).numpy(), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(
        norm.numpy(), torch.nn.functional.layer_norm(t, (cols,)).numpy(), rtol=1e-3, atol=1e-4
    )


@pytest.mark.gpu
def test_gpu_reductions_of_half_types_accumulate_in_float32(rng):
    array = rng.uniform(0, 1, (4, 40000)).astype(np.float32)
    for dtype in (fl.float16, fl.bfloat16):
        x = fl.tensor(array).to(dtype)
        total = x.float().sum(1).numpy()
        half_sum = x.sum(1).float().numpy()
        np.testing.assert_allclose(half_sum, total, rtol=1e-2)


@pytest.mark.gpu
def test_gpu_integer_sum_is_int64(rng):
    x = fl.tensor(np.full((3, 1000), 2**30, dtype=np.int32))
    result = x.sum(1)
    assert result.dtype is fl.int64
    np.testing.assert_array_equal(result.numpy(), np.full(3, 1000 * 2**30, dtype=np.int64))


@pytest.mark.gpu
def test_gpu_cross_entropy_matches_torch(rng):
    torch = pytest.importorskip("torch")
    logits = _array(rng, (64, 1000)) * 3
    target = rng.integers(0, 1000, 64)
    target[3] = -100
    for smoothing in (0.0, 0.1):
        loss = F.cross_entropy(fl.tensor(logits), fl.tensor(target), label_smoothing=smoothing)
        expected = torch.nn.functional.cross_entropy(
            torch.from_numpy(logits.astype(np.float64)),
            torch.from_numpy(target),
            label_smoothing=smoothing,
        )
        np.testing.assert_allclose(loss.item(), expected.item(), rtol=1e-5)
