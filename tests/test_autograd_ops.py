"""Every op's backward rule, checked from the registry.

Elementwise ops come from ``elementwise_ops()`` (every differentiable one that takes floats,
at every declared attribute sample); movement, reduce, joining, linalg and indexing ops, and
the composites built on them, from the hand-written ``STRUCTURAL`` table. Each is checked
against float64 central differences on the reference interpreter and against PyTorch autograd
in float32; the ``gpu`` tier runs the same gradient graphs on the CUDA backend against the
float64 oracle. A coverage test keeps the two tables in step with the registry.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from gradcheck import (
    check_against_finite_differences,
    check_against_torch,
    flame_vjp,
    float64_values,
)
from opinfo import build, cases

import flame as fl
from flame.codegen.lower import lower_group
from flame.ir.graph import Graph
from flame.ir.node import toposort
from flame.ir.ops import OPS
from flame.ir.passes import run_pipeline
from flame.runtime.executor import _layout_of

KINK_MARGIN = 1e-3  # samples stay this far from points where an op is not differentiable


# --- elementwise ops, from the registry ---------------------------------------------------------


def _kink_distance(name, arrays, attrs):
    """How far each element is from a point where ``name`` is not smooth (None: nowhere)."""
    x = arrays[-2] if name == "where" else arrays[0]
    if name in ("abs", "sign", "relu", "leaky_relu"):
        return np.abs(x)
    if name in ("floor", "ceil"):
        return np.abs(x - np.round(x))
    if name == "round":
        return np.abs(np.abs(x - np.floor(x)) - 0.5)
    if name == "remainder":
        quotient = x / arrays[1]
        return np.abs(quotient - np.round(quotient)) * np.abs(arrays[1])
    if name in ("maximum", "minimum"):
        return np.abs(x - arrays[1])
    if name == "softplus":
        return np.abs(x * attrs["beta"] - attrs["threshold"])
    return None


def smooth_arrays(case, rng, attrs, shape=(3, 4)) -> list[np.ndarray]:
    """Random inputs in the op's domains, nudged away from its kinks."""
    arrays = case.arrays(rng, [shape] * case.op.arity)
    for _ in range(20):
        distance = _kink_distance(case.op.name, arrays, attrs)
        if distance is None or distance.min() >= KINK_MARGIN:
            return arrays
        arrays[0] = np.where(distance < KINK_MARGIN, arrays[0] + 0.01, arrays[0])
    raise AssertionError(f"could not sample {case.id} away from its kinks")


def _differentiable_elementwise():
    params = []
    for case in cases(dtypes=(fl.float32,)):
        if not case.op.differentiable or case.op.name == "cast":
            continue  # cast rounds to narrower floats: see test_cast_gradients_match_torch
        for attrs in case.attr_samples():
            suffix = "-".join(str(value) for value in attrs.values())
            params.append(pytest.param(case, attrs, id=f"{case.op.name}-{suffix}".rstrip("-")))
    return params


ELEMENTWISE = _differentiable_elementwise()


def _float_positions(case) -> list[int]:
    return [index for index, dtype in enumerate(case.input_dtypes()) if dtype.is_float]


def _elementwise_builder(case, attrs):
    return lambda *tensors: build(case.op.name, list(tensors), attrs)


def _torch_elementwise(name, attrs):
    import torch
    import torch.nn.functional as functional

    special = {
        "gelu": lambda x: functional.gelu(x, approximate=attrs["approximate"]),
        "softplus": lambda x: functional.softplus(x, attrs["beta"], attrs["threshold"]),
        "leaky_relu": lambda x: functional.leaky_relu(x, attrs["negative_slope"]),
        "silu": functional.silu,
        "copy": torch.clone,
    }
    return special.get(name) or getattr(torch, name)


@pytest.mark.parametrize(("case", "attrs"), ELEMENTWISE)
def test_elementwise_vjp_matches_finite_differences(case, attrs, rng):
    arrays = smooth_arrays(case, rng, attrs)
    builder = _elementwise_builder(case, attrs)
    check_against_finite_differences(builder, arrays, _float_positions(case), rng)


@pytest.mark.parametrize(("case", "attrs"), ELEMENTWISE)
def test_elementwise_vjp_matches_torch(case, attrs, rng):
    pytest.importorskip("torch")
    arrays = smooth_arrays(case, rng, attrs)
    torch_fn = _torch_elementwise(case.op.name, attrs)
    builder = _elementwise_builder(case, attrs)
    check_against_torch(builder, torch_fn, arrays, _float_positions(case), rng)


def test_cast_gradients_match_torch(rng):
    """float32 -> float16/bfloat16 -> float32 passes the cotangent through (rounded)."""
    torch = pytest.importorskip("torch")
    array = rng.standard_normal((3, 4)).astype(np.float32)
    for narrow, torch_narrow in ((fl.float16, torch.float16), (fl.bfloat16, torch.bfloat16)):
        check_against_torch(
            lambda x, narrow=narrow: (x.to(narrow) * 3.0).float() * x,
            lambda x, narrow=torch_narrow: (x.to(narrow) * 3.0).float() * x,
            [array], [0], rng, rtol=1e-2, atol=1e-2,
        )  # fmt: skip


def test_cast_to_integer_stops_the_gradient(reference_backend):
    x = fl.tensor(np.array([0.3, 1.7, -2.2], dtype=np.float32))
    gradient = fl.grad(lambda t: fl.sum(t.int().float() * t))(x)
    np.testing.assert_array_equal(gradient.numpy(), [0.0, 1.0, -2.0])


# --- movement, reduce, joining, linalg, indexing and composites: hand-written cases ------------


# Samplers: each returns ``rng -> array``, so a case lists its inputs in one short tuple.
def normal(*shape):
    return lambda rng: rng.standard_normal(shape).astype(np.float32)


def positive(*shape):
    return lambda rng: rng.uniform(0.5, 2.0, shape).astype(np.float32)


def distinct(*shape):
    """Values at least 0.06 apart: max/min have no ties to share the gradient between."""
    count = int(np.prod(shape))

    def sample(rng):
        values = rng.permutation(count) * 0.1 + rng.uniform(-0.02, 0.02, count) - count * 0.05
        return values.reshape(shape).astype(np.float32)

    return sample


def integers(high, *shape, low=0):
    return lambda rng: rng.integers(low, high, shape).astype(np.int64)


def fixed(values):
    return lambda rng: np.asarray(values)


def mask(*shape):
    return lambda rng: rng.random(shape) < 0.5


@dataclass(frozen=True)
class Structural:
    """One hand-written gradient case: FLAME and PyTorch spellings of the same function."""

    name: str
    flame: object
    torch: object  # None: PyTorch has no equivalent (checked by finite differences only)
    samplers: tuple  # one ``rng -> array`` per input; float32 inputs are differentiated
    numeric: bool = True  # False: the gradient is a convention, not the derivative

    def inputs(self, rng) -> list[np.ndarray]:
        return [sample(rng) for sample in self.samplers]

    def positions(self, arrays) -> list[int]:
        return [index for index, array in enumerate(arrays) if array.dtype == np.float32]


def _torch():
    import torch

    return torch


def _tf():
    import torch.nn.functional as functional

    return functional


def matmul(a, b):
    return a @ b


def conv_weight_grad(x, g):
    """The weight gradient of a 3x3, stride 2, padding 1 conv2d, as an op of its own."""
    from flame.tensor import apply_op

    return apply_op(
        "conv_weight_grad", x, g, stride=(2, 2), padding=((1, 1), (1, 1)), dilation=(1, 1),
        groups=1, kernel_size=(3, 3),
    )  # fmt: skip


def attention_op(q, k, v):
    """The fused attention op itself, in float32 (the front end sends only 16-bit floats to
    it; its references and rules hold for any float)."""
    from flame.autograd import functions
    from flame.ir.ops.attention import stats_slots, unpack
    from flame.tensor import apply_op

    packed = apply_op("attention", q, k, v, scale=0.5, causal=True, slots=stats_slots(q.dtype))
    return unpack(functions(), packed, [(*q.shape[:3], v.shape[3])])[0]


S = Structural
NF = fl.nn.functional
STRUCTURAL = [
    S("expand", lambda x: fl.expand(x, (2, 3, 4)), lambda x: x.expand(2, 3, 4), (normal(3, 1),)),
    S("broadcast", lambda a, b: a * b + b, lambda a, b: a * b + b, (normal(2, 3, 4), normal(3, 1))),
    S("broadcast_scalar", lambda a, b: a - b, lambda a, b: a - b, (normal(3, 4), normal())),
    S("reshape", lambda x: fl.reshape(x, (4, 6)), lambda x: x.reshape(4, 6), (normal(2, 3, 4),)),
    S("permute", lambda x: fl.permute(x, (2, 0, 1)), lambda x: x.permute(2, 0, 1),
      (normal(2, 3, 4),)),
    S("transpose", lambda x: fl.transpose(x, 0, 2), lambda x: x.transpose(0, 2),
      (normal(2, 3, 4),)),
    S("slice_steps", lambda x: x[1:, ::2], lambda x: x[1:, ::2], (normal(4, 5),)),
    S("slice_negative_step", lambda x: x[::-2, 1:4], lambda x: x.flip(0)[::2, 1:4],
      (normal(5, 5),)),
    S("narrow", lambda x: fl.narrow(x, 1, 1, 2), lambda x: x.narrow(1, 1, 2), (normal(3, 4),)),
    S("flip", lambda x: fl.flip(x, (0, 2)), lambda x: x.flip(0, 2), (normal(2, 3, 4),)),
    S("squeeze", lambda x: fl.unsqueeze(fl.squeeze(x, 1), 0),
      lambda x: x.squeeze(1).unsqueeze(0), (normal(3, 1, 4),)),
    S("sum", lambda x: fl.sum(x, 1), lambda x: x.sum(1), (normal(3, 4),)),
    S("sum_keepdim", lambda x: fl.sum(x, (0, 2), keepdim=True),
      lambda x: x.sum((0, 2), keepdim=True), (normal(2, 3, 4),)),
    S("prod", lambda x: fl.prod(x, 1), lambda x: x.prod(1), (positive(3, 4),)),
    S("amax", lambda x: fl.amax(x, 1), lambda x: x.amax(1), (distinct(3, 4),)),
    S("amin", lambda x: fl.amin(x, (0, 1)), lambda x: x.amin((0, 1)), (distinct(3, 4),)),
    S("max_values", lambda x: fl.max(x, 0).values, lambda x: x.max(0).values, (distinct(3, 4),)),
    S("mean", lambda x: fl.mean(x, -1), lambda x: x.mean(-1), (normal(3, 4),)),
    S("var", lambda x: fl.var(x, 1), lambda x: x.var(1), (normal(3, 4),)),
    S("std", lambda x: fl.std(x), lambda x: x.std(), (normal(3, 4),)),
    S("logsumexp", lambda x: fl.logsumexp(x, 1), lambda x: x.logsumexp(1), (normal(3, 4),)),
    S("cat", lambda *xs: fl.cat(xs, 1), lambda *xs: _torch().cat(xs, 1),
      (normal(2, 3), normal(2, 1), normal(2, 2))),
    S("stack", lambda *xs: fl.stack(xs, 1), lambda *xs: _torch().stack(xs, 1),
      (normal(2, 3), normal(2, 3))),
    S("pad", lambda x: fl.pad(x, (1, 2, 0, 1)), lambda x: _tf().pad(x, (1, 2, 0, 1)),
      (normal(2, 3),)),
    S("triu", lambda x: fl.triu(x, 1), lambda x: x.triu(1), (normal(3, 4),)),
    S("tril", lambda x: fl.tril(x), lambda x: x.tril(), (normal(3, 4),)),
    S("repeat", lambda x: fl.repeat(x, 2, 1, 3), lambda x: x.repeat(2, 1, 3), (normal(2, 3),)),
    S("matmul", matmul, matmul, (normal(3, 4), normal(4, 5))),
    S("matmul_vector_left", matmul, matmul, (normal(4), normal(4, 5))),
    S("matmul_vector_right", matmul, matmul, (normal(3, 4), normal(4))),
    S("matmul_dot", matmul, matmul, (normal(4), normal(4))),
    S("matmul_batch_broadcast", matmul, matmul, (normal(2, 3, 4), normal(4, 5))),
    S("matmul_left_broadcast", matmul, matmul, (normal(3, 4), normal(2, 4, 5))),
    S("bmm", fl.bmm, lambda a, b: _torch().bmm(a, b), (normal(2, 3, 4), normal(2, 4, 2))),
    S("gather", lambda x, i: fl.gather(x, 1, i), lambda x, i: x.gather(1, i),
      (normal(4, 5), integers(5, 3, 6))),
    S("index_select", lambda x, i: fl.index_select(x, 1, i), lambda x, i: x.index_select(1, i),
      (normal(3, 4), fixed([3, 0, 3, 1]))),
    S("take_along_dim", lambda x, i: fl.take_along_dim(x, i, 1),
      lambda x, i: _torch().take_along_dim(x, i, 1), (normal(1, 5), integers(5, 4, 3, low=-5))),
    S("take_along_flat", lambda x, i: fl.take_along_dim(x, i),
      lambda x, i: _torch().take_along_dim(x, i), (normal(3, 4), integers(12, 2, 5))),
    S("embedding", fl.embedding, lambda i, w: _tf().embedding(i, w),
      (integers(5, 3, 4), normal(5, 3))),
    # the padding row gets no gradient although the forward reads it (PyTorch's convention)
    S("embedding_padding", lambda i, w: fl.embedding(i, w, padding_idx=2),
      lambda i, w: _tf().embedding(i, w, padding_idx=2), (integers(5, 3, 4), normal(5, 3)),
      numeric=False),
    S("index_tensor", fl.index_tensor, lambda x, i: x[i],
      (normal(4, 2, 3), fixed([[0, -1, 3], [3, 2, -4]]))),
    S("getitem_list", lambda x: x[[2, 0, 2]], lambda x: x[[2, 0, 2]], (normal(3, 4),)),
    S("scatter_add", lambda x, i, s: fl.scatter_add(x, 0, i, s),
      lambda x, i, s: x.scatter_add(0, i, s), (normal(3, 4), integers(3, 5, 4), normal(5, 4))),
    S("scatter_amax", lambda x, i, s: fl.scatter_reduce(x, 0, i, s, "amax"),
      lambda x, i, s: x.scatter_reduce(0, i, s, "amax"),
      (normal(3, 4), integers(3, 5, 4), normal(5, 4)), numeric=False),
    # src larger than index: only its leading part is added (PyTorch's backward rejects this)
    S("scatter_add_large_src", lambda x, i, s: fl.scatter_add(x, 1, i, s), None,
      (normal(3, 4), integers(4, 2, 3), normal(3, 5))),
    S("softmax", lambda x: NF.softmax(x, 1), lambda x: x.softmax(1), (normal(3, 5),)),
    S("log_softmax", lambda x: NF.log_softmax(x, 0), lambda x: x.log_softmax(0), (normal(3, 5),)),
    S("layer_norm", lambda x, w, b: NF.layer_norm(x, (5,), w, b),
      lambda x, w, b: _tf().layer_norm(x, (5,), w, b), (normal(3, 5), normal(5), normal(5))),
    S("rms_norm", lambda x, w: NF.rms_norm(x, (5,), w), lambda x, w: _tf().rms_norm(x, (5,), w),
      (normal(3, 5), normal(5))),
    S("group_norm", lambda x, w, b: NF.group_norm(x, 2, w, b),
      lambda x, w, b: _tf().group_norm(x, 2, w, b), (normal(2, 4, 3), normal(4), normal(4))),
    S("cross_entropy", lambda x, t: NF.cross_entropy(x, t, label_smoothing=0.1, ignore_index=1),
      lambda x, t: _tf().cross_entropy(x, t, label_smoothing=0.1, ignore_index=1),
      (normal(4, 5), fixed([0, 1, 4, 2]))),
    S("mse_loss", NF.mse_loss, lambda a, b: _tf().mse_loss(a, b), (normal(3, 4), normal(3, 4))),
    S("masked_fill", lambda x, m: fl.masked_fill(x, m, 2.0), lambda x, m: x.masked_fill(m, 2.0),
      (normal(3, 4), mask(1, 4))),
    S("clamp", lambda x: fl.clamp(x, -0.5, 0.5), lambda x: x.clamp(-0.5, 0.5), (distinct(3, 4),)),
    S("conv2d", lambda x, w: NF.conv2d(x, w, stride=(1, 2), padding=1, groups=2),
      lambda x, w: _tf().conv2d(x, w, stride=(1, 2), padding=1, groups=2),
      (normal(2, 4, 5, 6), normal(6, 2, 3, 3))),
    S("conv_transpose2d", lambda x, w: NF.conv_transpose2d(x, w, stride=2, output_padding=1),
      lambda x, w: _tf().conv_transpose2d(x, w, stride=2, output_padding=1),
      (normal(2, 3, 3, 4), normal(3, 2, 3, 3))),
    S("conv_weight_grad", conv_weight_grad,
      lambda x, g: _torch().nn.grad.conv2d_weight(x, (4, 3, 3, 3), g, stride=2, padding=1),
      (normal(2, 3, 7, 6), normal(2, 4, 4, 3))),
    S("attention", attention_op,
      lambda q, k, v: _tf().scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5),
      (normal(1, 2, 3, 8), normal(1, 2, 4, 8), normal(1, 2, 4, 8))),
    S("cumsum", lambda x: x.cumsum(1), lambda x: x.cumsum(1), (normal(3, 4),)),
    S("cumprod", lambda x: x.cumprod(1), lambda x: x.cumprod(1), (normal(3, 4),)),
    S("logcumsumexp", lambda x: x.logcumsumexp(0), lambda x: x.logcumsumexp(0), (normal(3, 4),)),
]  # fmt: skip
STRUCTURAL_BY_NAME = {case.name: case for case in STRUCTURAL}
KNOWN_BUGS: dict[str, str] = {}
# Bugs of the compiled path only (the reference interpreter runs the graph as built).
FUSION_BUGS = {
    **KNOWN_BUGS,
}


def _names(predicate=lambda case: True, bugs=KNOWN_BUGS):
    return [
        pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=bugs[name]))
        if name in bugs else name
        for name, case in STRUCTURAL_BY_NAME.items() if predicate(case)
    ]  # fmt: skip


NAMES = _names()


@pytest.mark.parametrize("name", _names(lambda case: case.numeric))
def test_structural_vjp_matches_finite_differences(name, rng):
    case = STRUCTURAL_BY_NAME[name]
    arrays = case.inputs(rng)
    check_against_finite_differences(case.flame, arrays, case.positions(arrays), rng)


@pytest.mark.parametrize("name", _names(lambda case: case.torch is not None))
def test_structural_vjp_matches_torch(name, rng):
    pytest.importorskip("torch")
    case = STRUCTURAL_BY_NAME[name]
    arrays = case.inputs(rng)
    check_against_torch(case.flame, case.torch, arrays, case.positions(arrays), rng)


def test_max_ties_share_the_gradient_as_in_torch(rng):
    """At ties the derivative is not defined; FLAME splits it evenly, as PyTorch's amax."""
    pytest.importorskip("torch")
    tied = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]], dtype=np.float32)
    check_against_torch(lambda x: fl.amax(x, 1), lambda x: x.amax(1), [tied], [0], rng)
    check_against_torch(lambda x: fl.amin(x), lambda x: x.amin(), [tied], [0], rng)
    pair = [np.array([1.0, 2.0, -1.0], np.float32), np.array([1.0, 0.0, -1.0], np.float32)]
    check_against_torch(fl.maximum, _torch_elementwise("maximum", {}), pair, [0, 1], rng)


def test_registry_ops_with_a_rule_are_all_checked(rng):
    """Every op that declares a vjp (and is not internal) appears in one of the graphs above;
    every differentiable op that takes floats has a rule."""
    seen = {case.op.name for case, _ in (param.values for param in ELEMENTWISE)} | {"cast"}
    with fl.backend("reference"):
        for case in STRUCTURAL:
            arrays = case.inputs(rng)
            out = case.flame(*(fl.from_numpy(array) for array in arrays))
            seen |= {node.op for node in toposort([out.node])}
    missing_rule = [
        op.name for op in OPS.values()
        if op.differentiable and op.kind != "leaf" and "f" in op.categories and op.vjp is None
    ]  # fmt: skip
    assert not missing_rule
    unchecked = [
        op.name for op in OPS.values()
        if op.vjp is not None and not op.internal and op.name not in seen
    ]  # fmt: skip
    assert not unchecked


# --- gpu tier: the same gradient graphs on the CUDA backend vs the float64 oracle --------------

GPU_TOLERANCE = {"rtol": 2e-4, "atol": 2e-5}


def _check_on_gpu(builder, arrays, positions, rng, rtol, atol):
    with fl.backend("cuda"):
        _, out, _, grads = flame_vjp(builder, arrays, positions, rng)
        expected = float64_values([out, *grads])
        fl.realize(out, *grads)
        for index, (tensor, value) in enumerate(zip([out, *grads], expected, strict=True)):
            np.testing.assert_allclose(
                tensor.numpy().astype(np.float64), value, rtol=rtol, atol=atol,
                err_msg=f"{'output' if index == 0 else f'cotangent {index - 1}'} on the GPU",
            )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(("case", "attrs"), ELEMENTWISE)
def test_gpu_elementwise_gradients_match_oracle(case, attrs, rng):
    arrays = smooth_arrays(case, rng, attrs, shape=(33, 65))
    builder = _elementwise_builder(case, attrs)
    _check_on_gpu(builder, arrays, _float_positions(case), rng, **GPU_TOLERANCE)


@pytest.mark.parametrize("name", _names(bugs=FUSION_BUGS))
def test_forward_and_backward_lower_together(name, rng, cuda_backend):
    """The passes and the code generator take forward and gradients as one graph (building
    and lowering kernels needs no GPU)."""
    case = STRUCTURAL_BY_NAME[name]
    arrays = case.inputs(rng)
    _, out, _, grads = flame_vjp(case.flame, arrays, case.positions(arrays), rng)
    graph = run_pipeline(Graph(tuple(tensor.node for tensor in [out, *grads])))
    assert graph.groups
    for group in graph.groups:
        if group.kind != "library":
            assert lower_group(group, _layout_of) is not None


# Cases whose float32 op has no GPU kernel, with where the GPU path is checked instead.
NO_GPU_KERNEL = {
    "attention": "float32 attention has no GPU kernel (cuDNN and FLAME's flash kernel take "
    "16-bit floats; scaled_dot_product_attention sends float32 to the math path); the "
    "16-bit op is checked on the GPU in tests/test_attention_ops.py",
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", _names(bugs=FUSION_BUGS))
def test_gpu_structural_gradients_match_oracle(name, rng):
    if name in NO_GPU_KERNEL:
        pytest.skip(NO_GPU_KERNEL[name])
    case = STRUCTURAL_BY_NAME[name]
    arrays = case.inputs(rng)
    _check_on_gpu(case.flame, arrays, case.positions(arrays), rng, **GPU_TOLERANCE)
