"""``global_norm`` as one op over every tensor (flame/ir/ops/multi_tensor.py): on the GPU a
multi-tensor kernel of per-chunk partial results and a one-block kernel that combines them
(flame/runtime/library_norm.py), two launches for any number of gradients.

CPU tier: values on the reference backend against NumPy in float64 and against
``torch.nn.utils.clip_grad_norm_`` (many shapes, dtypes, a transposed view, norm types 1, 2,
3, inf; NaN/inf propagate; empty tensors and lists), the planned graph of a clip of 100
gradients has one norm call, NVRTC compiles every kernel. gpu tier: the same values on the
GPU, strided and broadcast inputs, many chunks, a compiled training step captured in a CUDA
graph."""

from __future__ import annotations

import math

import numpy as np
import pytest

import flame as fl
from flame.codegen.multi_tensor import CHUNK, lower_global_norm, norm_kind
from flame.codegen.render import render
from flame.ir.graph import Graph
from flame.ir.node import toposort
from flame.ir.passes import run_pipeline
from flame.nn import utils

NORM_TYPES = [1.0, 2.0, 3.0, math.inf]
DTYPES = {
    "float32": fl.float32,
    "float16": fl.float16,
    "bfloat16": fl.bfloat16,
    "float64": fl.float64,
}
SHAPES = [(5, 7), (13,), (1,), (3, 0), (2, 3, 4), (257,), ()]


def _gradients(rng, shapes=SHAPES, dtypes=tuple(DTYPES)):
    """(flame tensors, the float64 values they hold) of every shape in every dtype, and a
    transposed view."""
    tensors, values = [], []
    for index, shape in enumerate(shapes):
        dtype = DTYPES[dtypes[index % len(dtypes)]]
        tensor = fl.tensor(rng.standard_normal(shape).astype(np.float32)).to(dtype).realize()
        tensors.append(tensor)
    square = fl.tensor(rng.standard_normal((6, 9)).astype(np.float32)).realize()
    tensors.append(square.T)  # a view, read through its strides
    values = [t.to(fl.float32).numpy().astype(np.float64) for t in tensors]
    return tensors, values


def _expected(values, norm_type: float) -> float:
    flat = np.concatenate([v.reshape(-1) for v in values]) if values else np.zeros(0)
    magnitude = np.abs(flat)
    if math.isinf(norm_type):
        return float(magnitude.max())
    return float(np.sum(magnitude**norm_type) ** (1.0 / norm_type))


@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=str)
def test_values_match_numpy_in_float64(norm_type, rng, reference_backend):
    shapes = SHAPES if not math.isinf(norm_type) else [s for s in SHAPES if 0 not in s]
    tensors, values = _gradients(rng, shapes)
    total = utils.global_norm(tensors, norm_type)
    assert total.node.op == "global_norm" and len(total.node.inputs) == len(tensors)
    assert total.dtype == fl.float32 and total.shape == ()
    np.testing.assert_allclose(total.item(), _expected(values, norm_type), rtol=2e-6)


@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=str)
def test_the_op_equals_the_per_tensor_reductions(norm_type, rng, reference_backend):
    shapes = [(4, 5), (9,), (1,), (33, 3)]
    tensors, _ = _gradients(rng, shapes)
    fused = utils.global_norm(tensors, norm_type)
    per_tensor = utils._per_tensor_norm(tensors, norm_type)
    assert not any(node.op == "global_norm" for node in toposort([per_tensor.node]))
    np.testing.assert_allclose(fused.item(), per_tensor.item(), rtol=1e-6)


@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=str)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_clip_matches_torch(norm_type, dtype, rng, reference_backend):
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle of this test")
    shapes = [(5, 7), (13,), (1,), (64, 3), (2, 3, 4)]
    params, copies = [], []
    for shape in shapes:
        grad = (rng.standard_normal(shape) * 3).astype(np.float32)
        param = fl.tensor(np.zeros(shape, np.float32)).to(DTYPES[dtype])
        param.grad = fl.tensor(grad).to(DTYPES[dtype])
        params.append(param)
        copy = torch.zeros(shape, dtype=getattr(torch, dtype), requires_grad=True)
        copy.grad = torch.tensor(grad).to(getattr(torch, dtype))
        copies.append(copy)
    total = utils.clip_grad_norm_(params, 0.5, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(copies, 0.5, norm_type)
    rtol = 1e-5 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(total.item(), expected.item(), rtol=rtol)
    for param, copy in zip(params, copies):
        np.testing.assert_allclose(
            param.grad.to(fl.float32).numpy(), copy.grad.float().numpy(), rtol=rtol, atol=1e-6
        )


def test_a_transposed_gradient_counts_each_element_once(rng, reference_backend):
    base = rng.standard_normal((7, 11)).astype(np.float32)
    view = fl.tensor(base).T
    total = utils.global_norm([view, view[::2]], 2.0)
    expected = np.sqrt(np.sum(base.astype(np.float64) ** 2) + np.sum(base.T[::2] ** 2.0))
    np.testing.assert_allclose(total.item(), expected, rtol=2e-6)


@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=str)
def test_nan_and_inf_propagate(norm_type, reference_backend):
    finite = fl.tensor(np.ones(5, np.float32))
    with_nan = fl.tensor(np.array([1.0, np.nan, 2.0], np.float32)).to(fl.bfloat16)
    with_inf = fl.tensor(np.array([-np.inf, 2.0], np.float32)).to(fl.float16)
    assert math.isnan(utils.global_norm([finite, with_nan], norm_type).item())
    assert math.isnan(utils.global_norm([with_nan, finite], norm_type).item())  # either order
    assert utils.global_norm([finite, with_inf], norm_type).item() == math.inf
    with pytest.raises(fl.nn.utils.GradError, match="not finite"):
        params = [fl.tensor(np.zeros(3, np.float32))]
        params[0].grad = fl.tensor(np.array([1.0, np.nan, 0.0], np.float32))
        utils.clip_grad_norm_(params, 1.0, norm_type, error_if_nonfinite=True)


def test_empty_lists_and_tensors(reference_backend):
    assert utils.global_norm([], 2.0).item() == 0.0
    empty = [fl.tensor(np.zeros((0, 3), np.float32)), fl.tensor(np.zeros(0, np.float16))]
    for norm_type in (1.0, 2.0, 3.0):
        assert utils.global_norm(empty, norm_type).item() == 0.0
        mixed = [*empty, fl.tensor(np.array([3.0, -4.0], np.float32))]
        expected = (3**norm_type + 4**norm_type) ** (1 / norm_type)
        np.testing.assert_allclose(utils.global_norm(mixed, norm_type).item(), expected, rtol=1e-6)
    with pytest.raises(RuntimeError, match=r"global_norm: .*infinity norm.*float32\[0, 3\]"):
        utils.global_norm(empty, math.inf)  # as PyTorch's _foreach_norm refuses


def test_bad_input_is_named(reference_backend):
    with pytest.raises(ValueError, match="norm_type must be positive"):
        utils.global_norm([fl.tensor(np.ones(2, np.float32))], -1.0)
    with pytest.raises(TypeError, match="global_norm: expected flame.Tensor"):
        utils.global_norm([np.ones(2)], 2.0)
    with fl.backend("cuda"):
        on_gpu = fl.tensor(np.ones(2, np.float32))
    with pytest.raises((TypeError, ValueError, RuntimeError), match="global_norm"):
        utils.global_norm([fl.tensor(np.ones(2, np.float32)), on_gpu], 2.0)


def test_integer_values_are_cast_first(reference_backend):
    values = fl.tensor(np.array([3, -4], np.int32))
    assert utils.global_norm([values, fl.tensor(np.zeros(1, np.float32))], 2.0).item() == 5.0


def test_a_differentiated_norm_keeps_the_per_tensor_reductions(rng, reference_backend):
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle of this test")
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in [(3, 4), (5,)]]
    leaves = [fl.tensor(array).requires_grad_() for array in arrays]
    total = utils.global_norm(leaves, 3.0)
    assert not any(node.op == "global_norm" for node in toposort([total.node]))
    total.backward()
    copies = [torch.tensor(array, requires_grad=True) for array in arrays]
    torch.linalg.vector_norm(torch.cat([c.reshape(-1) for c in copies]), 3.0).backward()
    for leaf, copy in zip(leaves, copies):
        np.testing.assert_allclose(leaf.grad.numpy(), copy.grad.numpy(), rtol=1e-5)
    with fl.no_grad():  # no gradient asked for: the one op
        ops = [node.op for node in toposort([utils.global_norm(leaves, 3.0).node])]
        assert ops.count("global_norm") == 1 and "reduce_sum" not in ops


def test_a_compiled_clip_equals_the_lazy_one(rng, reference_backend):
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in [(6, 5), (7,), (1,)]]

    def clip(*grads):
        params = [fl.tensor(np.zeros(g.shape, np.float32)) for g in grads]
        for param, grad in zip(params, grads):
            param.grad = grad
        total = utils.clip_grad_norm_(params, 0.25)
        return total, [param.grad for param in params]

    compiled = fl.compile(clip)
    for scale in (1.0, 3.0):  # a second call replays with new values
        grads = [fl.tensor(array * scale) for array in arrays]
        total, clipped = compiled(*grads)
        want_total, want = clip(*[fl.tensor(array * scale) for array in arrays])
        np.testing.assert_allclose(total.item(), want_total.item(), rtol=1e-6)
        for got, expected in zip(clipped, want):
            np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-6)


# --- the plan on the CUDA backend (nothing runs: graphs are planned without a GPU) -------------


def _hundred_gradients(rng):
    """100 gradients as a backward makes them: weight gradients from products (library
    calls), bias gradients from sums over the batch, of 50 layers of different widths, in
    float32 and bfloat16."""
    grads = []
    for layer in range(50):
        width = 16 + layer
        dtype = fl.bfloat16 if layer % 3 == 0 else fl.float32
        inputs = fl.tensor(rng.standard_normal((8, width)).astype(np.float32)).to(dtype)
        grad_out = fl.tensor(rng.standard_normal((8, width + 1)).astype(np.float32)).to(dtype)
        grads.append((grad_out.T @ inputs).detach())
        grads.append(grad_out.sum(0).to(dtype).detach())
    return grads


def _groups(tensors):
    return run_pipeline(Graph(tuple(t.node for t in tensors))).groups


def _norm_calls(groups) -> list:
    return [g for g in groups if g.kind == "library" and g.nodes[0].op == "global_norm"]


def test_the_norm_of_100_gradients_is_one_library_call(rng, cuda_backend):
    grads = _hundred_gradients(rng)
    baseline = len(_groups(grads))  # the kernels that compute the gradients
    groups = _groups([utils.global_norm(grads, 2.0)])
    assert len(groups) == baseline + 1
    (call,) = _norm_calls(groups)
    assert len(call.nodes[0].inputs) == 100
    per_tensor = _groups([utils._per_tensor_norm(grads, 2.0)])
    assert not _norm_calls(per_tensor) and len(per_tensor) >= baseline + 100  # it replaces


def _clipped(grads, norm):
    """What clip_grad_norm_ builds, with the norm function given."""
    total = norm(grads, 2.0)
    scale = fl.clamp(1.0 / (total + 1e-6), max=1.0)
    return [total, *(grad * scale.to(grad.dtype) for grad in grads)]


def test_a_clip_of_100_gradients_plans_o1_kernels_beside_the_gradients(rng, cuda_backend):
    """Beside the gradients' own kernels and the scaling of each (which a training step
    fuses into the optimizer's update), the norm and the clip factor cost O(1) kernels,
    where one reduction per gradient cost 100 more."""
    grads = _hundred_gradients(rng)
    baseline = len(_groups(grads))
    params = []
    for grad in grads:
        param = fl.zeros(grad.shape, dtype=grad.dtype)
        param.grad = grad
        params.append(param)
    total = utils.clip_grad_norm_(params, 1.0)
    groups = _groups([total, *(p.grad for p in params)])
    assert len(_norm_calls(groups)) == 1
    assert len(groups) <= baseline + 100 + 2, len(groups) - baseline
    assert len(_groups(_clipped(grads, utils.global_norm))) == len(groups)
    per_tensor = _groups(_clipped(grads, utils._per_tensor_norm))
    assert len(per_tensor) >= len(groups) + 99


@pytest.mark.parametrize("kind", ["l1", "l2", "linf", "lp"])
def test_the_kernels_compile_with_nvrtc(kind, nvrtc):
    from flame.runtime.compiler import nvrtc_compile

    for stage in ("partials", "finish"):
        spec = lower_global_norm(kind, stage)
        source = render(spec)
        assert spec.name in source
        assert nvrtc_compile(source, spec.name, "sm_90")[:4] == b"\x7fELF"


def test_norm_kinds_and_their_code():
    assert [norm_kind(p) for p in (1.0, 2.0, 3.0, 0.5, math.inf)] == [
        "l1",
        "l2",
        "lp",
        "lp",
        "linf",
    ]
    assert "sqrtf" in render(lower_global_norm("l2", "finish"))
    assert "powf(total, inverse_p)" in render(lower_global_norm("lp", "finish"))
    assert "a != a" in render(lower_global_norm("linf", "partials"))  # NaN wins a max
    with pytest.raises(ValueError, match="unknown norm kind"):
        lower_global_norm("l7", "partials")


# --- gpu tier ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=str)
def test_gpu_values_match_numpy(norm_type, rng):
    shapes = [(CHUNK * 2 + 3,), (257, 129), (1,), (5, 7), (3,), (CHUNK + 8,)]
    if not math.isinf(norm_type):
        shapes.append((0, 4))
    with fl.backend("cuda"):
        tensors, values = _gradients(rng, shapes)
        big = fl.tensor(rng.standard_normal((40, 70)).astype(np.float32)).realize()
        tensors += [big[:, ::3], big[1:2].expand(5, 70), big.T[3:]]  # gaps, broadcast, offset
        values += [
            big.numpy()[:, ::3],
            np.broadcast_to(big.numpy()[1:2], (5, 70)),
            big.numpy().T[3:],
        ]
        total = utils.global_norm(tensors, norm_type)
        assert total.node.op == "global_norm"
        got = total.item()
    np.testing.assert_allclose(
        got, _expected([v.astype(np.float64) for v in values], norm_type), rtol=1e-5
    )


@pytest.mark.gpu
@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=str)
def test_gpu_nan_inf_and_empty(norm_type):
    with fl.backend("cuda"):
        finite = fl.tensor(np.ones(CHUNK + 5, np.float32))
        with_nan = fl.tensor(np.array([1.0, np.nan], np.float32)).to(fl.bfloat16)
        with_inf = fl.tensor(np.array([np.inf, 1.0], np.float32)).to(fl.float16)
        assert math.isnan(utils.global_norm([finite, with_nan], norm_type).item())
        assert utils.global_norm([with_inf, finite], norm_type).item() == math.inf
        if not math.isinf(norm_type):
            assert utils.global_norm([fl.zeros((0, 3))], norm_type).item() == 0.0


@pytest.mark.gpu
def test_gpu_compiled_training_step_with_clip_is_captured(rng):
    """A compiled step with clip_grad_norm_ is captured in one CUDA graph and gives the
    reference backend's losses and weights."""
    nn = fl.nn
    F = fl.nn.functional
    data = rng.standard_normal((8, 16)).astype(np.float32)
    labels = rng.integers(0, 4, 8)
    results = {}
    for backend in ("reference", "cuda"):
        with fl.backend(backend):
            fl.manual_seed(0)
            model = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 4))
            optimizer = fl.optim.AdamW(model.parameters(), lr=1e-2)

            @fl.compile(cuda_graph=backend == "cuda")
            def step(x, y, model=model, optimizer=optimizer):
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                total = utils.clip_grad_norm_(model.parameters(), 0.05)
                optimizer.step()
                return loss, total

            history = []
            for _ in range(4):
                model.zero_grad(set_to_none=True)
                loss, total = step(fl.tensor(data), fl.tensor(labels))
                history.append((loss.item(), total.item()))
            results[backend] = (history, [p.numpy() for p in model.parameters()], step.cache_info())
    np.testing.assert_allclose(results["cuda"][0], results["reference"][0], rtol=1e-4, atol=1e-6)
    for got, want in zip(results["cuda"][1], results["reference"][1]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    info = results["cuda"][2]
    assert not info.graph_failures, info.graph_failures
    assert info.graph_captures >= 1
