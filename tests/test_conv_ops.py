"""The convolution library ops (flame/ir/ops/conv.py) through F.conv1d/conv2d/conv_transpose1d/2d.

CPU tier (reference backend): values and input/weight/bias gradients of one table of
convolutions against PyTorch in float64 on the same float32 data; the three ops' vjp rules
against float64 central differences, to second order; the built graphs (a convolution is
one ``conv`` node, a transposed one ``conv_data_grad``, their backward no matmul); errors
at build time. GPU tier: the same table on the cuda backend (float32 with TF32, bfloat16,
float16; NCHW and channels-last inputs; cuDNN and the CuPy fallback) against the reference
backend on the same rounded inputs, a compiled training step replayed with
``cuda_graph=True``, and the cuDNN plan read back from the disk cache by a fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from gradcheck import check_against_finite_differences

import flame as fl
import flame.nn.functional as F
from flame.tensor import apply_op

REPO = Path(__file__).resolve().parents[1]


# --- the table ---------------------------------------------------------------------------------


class Case(NamedTuple):
    op: str  # the F function: conv1d, conv2d, conv_transpose1d, conv_transpose2d
    batch: int | None  # None: an unbatched input
    channels: int
    out_channels: int
    size: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: int | tuple = 1
    padding: int | tuple | str = 0
    dilation: int | tuple = 1
    groups: int = 1
    bias: bool = True
    output_padding: int | tuple = 0

    @property
    def transposed(self) -> bool:
        return self.op.startswith("conv_transpose")

    def input_shape(self) -> tuple[int, ...]:
        lead = () if self.batch is None else (self.batch,)
        return (*lead, self.channels, *self.size)

    def weight_shape(self) -> tuple[int, ...]:
        if self.transposed:
            return (self.channels, self.out_channels // self.groups, *self.kernel)
        return (self.out_channels, self.channels // self.groups, *self.kernel)

    def kwargs(self) -> dict:
        common = {"stride": self.stride, "padding": self.padding, "dilation": self.dilation}
        if self.transposed:
            common["output_padding"] = self.output_padding
        return {**common, "groups": self.groups}

    def __str__(self) -> str:
        parts = [
            self.op,
            "k" + "x".join(map(str, self.kernel)),
            f"s{self.stride}",
            f"p{self.padding}",
            f"d{self.dilation}",
            f"g{self.groups}",
            f"n{self.batch}",
            "x".join(map(str, self.size)),
            "bias" if self.bias else "nobias",
        ]
        if self.output_padding:
            parts.append(f"op{self.output_padding}")
        return "-".join(str(part).replace(" ", "") for part in parts)


C2, C1, T2, T1 = "conv2d", "conv1d", "conv_transpose2d", "conv_transpose1d"
CASES = [
    # conv2d: kernels 1/3/7, strides, int/tuple/'same'/'valid' padding, dilation, groups
    Case(C2, 1, 3, 4, (7, 9), (1, 1)),
    Case(C2, 3, 3, 5, (7, 9), (3, 3), padding=1),
    Case(C2, 3, 4, 6, (5, 13), (3, 3), stride=2, padding=1, bias=False),
    Case(C2, 1, 2, 3, (9, 11), (7, 7), padding=3),
    Case(C2, 1, 2, 4, (13, 9), (7, 7), stride=2, padding=(3, 2), bias=False),
    Case(C2, 3, 3, 4, (7, 9), (3, 3), padding="same", dilation=2),
    Case(C2, 1, 4, 6, (5, 13), (3, 3), padding="valid", groups=2),
    Case(C2, 3, 4, 4, (9, 7), (3, 3), padding=(1, 0), dilation=2, groups=2),
    Case(C2, 3, 4, 4, (7, 9), (3, 3), padding=1, groups=4),  # depthwise
    Case(C2, 1, 3, 6, (5, 13), (3, 3), stride=2, padding=1, groups=3, bias=False),  # depthwise x2
    Case(C2, 3, 4, 2, (7, 9), (1, 1), stride=2, groups=2, bias=False),
    Case(C2, 1, 2, 2, (7, 9), (7, 7), padding="same"),
    Case(C2, 3, 2, 3, (7, 9), (3, 1), stride=(2, 1), padding=(0, 1), dilation=(1, 2)),
    Case(C2, 1, 2, 3, (5, 13), (2, 4), padding="same"),  # asymmetric 'same'
    Case(C2, 1, 1, 2, (13, 15), (7, 7), dilation=2, padding="valid"),
    Case(C2, None, 3, 4, (7, 9), (3, 3), stride=2, padding=1),  # unbatched
    # conv1d
    Case(C1, 1, 3, 4, (9,), (1,)),
    Case(C1, 3, 3, 4, (13,), (3,), stride=2, padding=1, bias=False),
    Case(C1, 1, 2, 3, (11,), (7,), padding="same"),
    Case(C1, 3, 4, 6, (13,), (3,), padding="same", dilation=2, groups=2),
    Case(C1, 3, 4, 8, (9,), (3,), padding="valid", dilation=2, groups=4),  # depthwise x2
    Case(C1, 1, 2, 3, (17,), (7,), stride=2, padding=3),
    Case(C1, 3, 2, 2, (8,), (2,), padding="same", bias=False),
    Case(C1, None, 3, 4, (9,), (3,), padding=1),
    # conv_transpose2d: weight [in, out/groups, *k]
    Case(T2, 1, 3, 4, (5, 7), (3, 3)),
    Case(T2, 3, 3, 4, (5, 7), (3, 3), stride=2, padding=1, output_padding=1),
    Case(T2, 1, 4, 6, (7, 9), (1, 1), stride=2, groups=2, output_padding=1, bias=False),
    Case(T2, 1, 2, 3, (5, 7), (7, 7), padding=3),
    Case(T2, 3, 4, 4, (5, 7), (3, 3), stride=2, padding=(1, 0), dilation=2, groups=2),
    Case(T2, 3, 4, 4, (5, 7), (3, 3), stride=2, padding=1, groups=4),  # depthwise
    Case(T2, 1, 2, 3, (5, 7), (3, 3), padding=1, dilation=2, output_padding=1),
    Case(T2, 3, 2, 3, (5, 7), (3, 3), stride=(2, 1), padding=(1, 0), bias=False),
    # conv_transpose1d
    Case(T1, 1, 3, 4, (7,), (3,)),
    Case(T1, 3, 3, 2, (9,), (3,), stride=2, padding=1, output_padding=1, bias=False),
    Case(T1, 1, 4, 4, (7,), (7,), stride=2, padding=3, groups=2),
    Case(T1, 3, 4, 4, (5,), (3,), dilation=2, groups=4),  # depthwise
    Case(T1, 1, 2, 3, (13,), (1,), stride=2),
    Case(T1, None, 3, 4, (7,), (3,), stride=2, padding=1, output_padding=1),
]
CHANNELS_LAST = [case for case in CASES if not case.transposed][::3] + [
    case for case in CASES if case.transposed
][::5]


def _arrays(case: Case, rng) -> list[np.ndarray]:
    """Float32 input, weight and (when the case has one) bias."""
    arrays = [
        rng.standard_normal(case.input_shape()).astype(np.float32),
        rng.standard_normal(case.weight_shape()).astype(np.float32),
    ]
    if case.bias:
        arrays.append(rng.standard_normal(case.out_channels).astype(np.float32))
    return arrays


def _rounded(arrays, dtype) -> list[np.ndarray]:
    """The arrays rounded to ``dtype`` once (by the reference backend), so that every side of
    a comparison starts from the same values."""
    if dtype is fl.float32:
        return list(arrays)
    with fl.backend("reference"):
        return [fl.tensor(array).to(dtype).numpy() for array in arrays]


def _channel_axis(case: Case) -> int:
    return 0 if case.batch is None else 1


def flame_values(case: Case, arrays, seed=None, rng=None, layout="contiguous") -> dict:
    """Output and gradients (input, weight, bias) in float64 for the output cotangent ``seed``
    (drawn from ``rng`` when None, and returned as "seed"), on the current backend. With
    ``layout="channels_last"`` the input is a permuted view of channels-last memory."""
    axis = _channel_axis(case)
    storage = arrays[0]
    if layout == "channels_last":
        storage = np.ascontiguousarray(np.moveaxis(storage, axis, -1))
    primals = [fl.tensor(storage)] + [fl.tensor(array) for array in arrays[1:]]

    def function(*tensors):
        x = tensors[0]
        if layout == "channels_last":
            order = list(range(x.ndim - 1))
            order.insert(axis, x.ndim - 1)
            x = x.permute(*order)
        bias = tensors[2] if case.bias else None
        return getattr(F, case.op)(x, tensors[1], bias, **case.kwargs())

    out, pullback = fl.vjp(function, *primals)
    if seed is None:
        seed = rng.standard_normal(out.shape).astype(np.float32)
        seed = _rounded([seed], out.dtype)[0]
    grads = pullback(fl.tensor(seed))
    result = {"seed": seed, "out": out.numpy().astype(np.float64)}
    for name, grad in zip(("input", "weight", "bias"), grads):
        result[name] = grad.numpy().astype(np.float64)
    if layout == "channels_last":
        result["input"] = np.moveaxis(result["input"], -1, axis)
    return result


def torch_values(case: Case, arrays, seed) -> dict:
    """The same in PyTorch, float64."""
    torch = pytest.importorskip("torch", reason="PyTorch is the reference for these checks")
    tensors = [torch.from_numpy(np.asarray(array, np.float64)).requires_grad_() for array in arrays]
    bias = tensors[2] if case.bias else None
    out = getattr(torch.nn.functional, case.op)(tensors[0], tensors[1], bias, **case.kwargs())
    out.backward(torch.from_numpy(np.asarray(seed, np.float64)))
    result = {"out": out.detach().numpy()}
    for name, tensor in zip(("input", "weight", "bias"), tensors):
        result[name] = tensor.grad.numpy()
    return result


def assert_values_close(actual: dict, expected: dict, rtol: float, scaled_atol: float):
    """Every entry of ``expected`` within ``rtol`` and ``scaled_atol`` times its largest
    magnitude."""
    for name, want in expected.items():
        if name == "seed":
            continue
        got = actual[name]
        assert got.shape == want.shape, (name, got.shape, want.shape)
        atol = scaled_atol * max(float(np.abs(want).max(initial=0.0)), 1e-30)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=name)


# --- CPU tier: values and gradients against PyTorch ----------------------------------------------


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("case", CASES, ids=str)
def test_values_and_gradients_match_torch(case, rng, reference_backend):
    arrays = _arrays(case, rng)
    got = flame_values(case, arrays, rng=rng)
    want = torch_values(case, arrays, got["seed"])
    assert_values_close(got, want, rtol=1e-4, scaled_atol=1e-5)


@pytest.mark.parametrize("case", CHANNELS_LAST[:4], ids=str)
def test_channels_last_input_on_the_reference_backend(case, rng, reference_backend):
    arrays = _arrays(case, rng)
    got = flame_values(case, arrays, rng=rng, layout="channels_last")
    want = flame_values(case, arrays, seed=got["seed"])
    assert_values_close(got, want, rtol=1e-6, scaled_atol=1e-6)


# --- CPU tier: the ops' vjp rules against central differences (float64) -------------------------

CONV_ATTRS_2D = {
    "stride": (2, 1), "padding": ((1, 0), (0, 2)), "dilation": (1, 2), "groups": 2,
}  # fmt: skip
CONV_ATTRS_1D = {"stride": (2,), "padding": ((2, 1),), "dilation": (2,), "groups": 1}
CONV_ATTRS_3D = {
    "stride": (1, 2, 1), "padding": ((1, 0), (0, 1), (1, 1)), "dilation": (1, 1, 2), "groups": 2,
}  # fmt: skip
OP_CASES = [
    # (op, first shape, second shape, attributes)
    ("conv", (2, 4, 5, 4), (4, 2, 2, 3), CONV_ATTRS_2D),
    ("conv_data_grad", (2, 4, 3, 2), (4, 2, 2, 3), {**CONV_ATTRS_2D, "input_size": (5, 4)}),
    ("conv_weight_grad", (2, 4, 5, 4), (2, 4, 3, 2), {**CONV_ATTRS_2D, "kernel_size": (2, 3)}),
    ("conv", (1, 2, 7), (3, 2, 3), CONV_ATTRS_1D),
    ("conv_data_grad", (1, 3, 3), (3, 2, 3), {**CONV_ATTRS_1D, "input_size": (7,)}),
    ("conv_weight_grad", (1, 2, 7), (1, 3, 3), {**CONV_ATTRS_1D, "kernel_size": (3,)}),
    ("conv", (1, 2, 3, 4, 3), (2, 1, 2, 2, 2), CONV_ATTRS_3D),
]


def _op_id(case) -> str:
    op, first, second, _ = case
    return f"{op}-{len(first) - 2}d"


@pytest.mark.parametrize("case", OP_CASES, ids=_op_id)
def test_op_vjp_matches_finite_differences(case, rng):
    op, first, second, attrs = case
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in (first, second)]

    def build(a, b):
        return apply_op(op, a, b, **attrs)

    check_against_finite_differences(build, arrays, [0, 1], rng, rtol=1e-5, atol=1e-6)


SECOND_ORDER = [
    # (F function, input shape, weight shape, keyword arguments)
    (C2, (1, 2, 5, 4), (2, 1, 2, 3), {"stride": (2, 1), "padding": 1, "dilation": (1, 2),
                                      "groups": 2}),
    (T1, (1, 2, 4), (2, 3, 3), {"stride": 2, "padding": 1, "output_padding": 1}),
]  # fmt: skip


@pytest.mark.parametrize("wrt", ["input", "weight"])
@pytest.mark.parametrize("case", SECOND_ORDER, ids=lambda case: case[0])
def test_second_order_gradients_match_finite_differences(case, wrt, rng):
    """The gradient of sum(conv(x, w)^3)/3 with respect to x (or w) is itself built from the
    gradient ops; its vjp, checked here for x and w, needs the vjps of all three."""
    op, input_shape, weight_shape, kwargs = case
    arrays = [
        rng.standard_normal(shape).astype(np.float32) for shape in (input_shape, weight_shape)
    ]

    def loss(x, w):
        out = getattr(F, op)(x, w, None, **kwargs)
        return fl.sum(out * out * out) / 3.0

    def build(x, w):
        grads = fl.grad(loss, argnums=(0, 1))(x, w)
        return grads[0] if wrt == "input" else grads[1]

    check_against_finite_differences(build, arrays, [0, 1], rng, rtol=1e-5, atol=1e-5)


# --- CPU tier: the built graphs -----------------------------------------------------------------


def graph_nodes(*tensors) -> list:
    """Every node the tensors depend on, each once."""
    seen, nodes, stack = set(), [], [tensor.node for tensor in tensors]
    while stack:
        node = stack.pop()
        if id(node) not in seen:
            seen.add(id(node))
            nodes.append(node)
            stack.extend(node.inputs)
    return nodes


def graph_ops(*tensors) -> list[str]:
    return [node.op for node in graph_nodes(*tensors)]


def _leaves(rng, *shapes):
    return [fl.tensor(rng.standard_normal(shape).astype(np.float32)) for shape in shapes]


def test_conv2d_builds_one_conv_node_with_normalized_attributes(rng, reference_backend):
    x, w, b = _leaves(rng, (2, 4, 5, 13), (6, 2, 2, 4), (6,))
    y = F.conv2d(x, w, b, padding="same", groups=2)
    conv = [node for node in graph_nodes(y) if node.op == "conv"]
    assert len(conv) == 1
    assert conv[0].inputs[0] is x.node and conv[0].inputs[1] is w.node
    assert tuple(conv[0].attr("padding")) == ((0, 1), (1, 2))  # 'same' with even kernels
    assert tuple(conv[0].attr("stride")) == (1, 1) and conv[0].attr("groups") == 2
    assert "matmul" not in graph_ops(y) and "stack" not in graph_ops(y)
    assert F.conv1d(*_leaves(rng, (2, 3, 9), (4, 3, 3))).node.op == "conv"


@pytest.mark.parametrize("op", [T2, T1])
def test_transposed_convolution_builds_conv_data_grad(op, rng, reference_backend):
    spatial = 2 if op == T2 else 1
    x, w = _leaves(rng, (2, 4, *(5,) * spatial), (4, 3, *(3,) * spatial))
    y = getattr(F, op)(x, w, None, stride=2, padding=1, output_padding=1)
    assert y.node.op == "conv_data_grad"
    assert tuple(y.node.attr("input_size")) == (10,) * spatial
    assert "conv" not in graph_ops(y) and "matmul" not in graph_ops(y)


def test_backward_graphs_hold_the_gradient_ops_and_no_matmul(rng, reference_backend):
    x, w, b = _leaves(rng, (2, 4, 7, 9), (6, 2, 3, 3), (6,))
    seed = fl.tensor(rng.standard_normal((2, 6, 4, 5)).astype(np.float32))
    out, pullback = fl.vjp(lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1, groups=2),
                           x, w, b)  # fmt: skip
    grad_x, grad_w, grad_b = pullback(seed)
    assert grad_x.node.op == "conv_data_grad" and grad_w.node.op == "conv_weight_grad"
    ops = graph_ops(grad_x, grad_w, grad_b)
    assert "matmul" not in ops and "conv" not in ops
    # a transposed convolution's backward is conv (input) and conv_weight_grad (weight)
    (weight,) = _leaves(rng, (6, 2, 3, 3))
    _, pullback = fl.vjp(lambda x, w: F.conv_transpose2d(x, w, stride=2), out.detach(), weight)
    grad_out, grad_w = pullback(fl.tensor(np.ones((2, 2, 9, 11), np.float32)))
    assert grad_out.node.op == "conv" and grad_w.node.op == "conv_weight_grad"
    assert "matmul" not in graph_ops(grad_out, grad_w)


# --- CPU tier: errors at build time --------------------------------------------------------------


def _zeros(*shape, dtype=fl.float32):
    return fl.zeros(shape, dtype=dtype)


ERRORS = [
    # (id, build, error type, substrings of the message)
    ("channels", lambda: F.conv2d(_zeros(1, 3, 5, 5), _zeros(4, 2, 3, 3)), fl.ShapeError,
     ["conv2d", "[1, 3, 5, 5]", "[4, 2, 3, 3]", "3 channels"]),
    ("groups", lambda: F.conv2d(_zeros(1, 4, 5, 5), _zeros(4, 1, 3, 3), groups=2),
     fl.ShapeError, ["conv2d", "[1, 4, 5, 5]", "[4, 1, 3, 3]", "groups=2"]),
    ("depthwise", lambda: F.conv2d(_zeros(1, 4, 5, 5), _zeros(4, 2, 3, 3), groups=4),
     fl.ShapeError, ["conv2d", "[1, 4, 5, 5]", "[4, 2, 3, 3]", "groups=4"]),
    ("out-groups", lambda: F.conv1d(_zeros(1, 4, 9), _zeros(3, 2, 3), groups=2), ValueError,
     ["conv1d", "[3, 2, 3]", "groups=2"]),
    ("conv1d-channels", lambda: F.conv1d(_zeros(2, 3, 9), _zeros(4, 6, 3)), fl.ShapeError,
     ["conv1d", "[2, 3, 9]", "[4, 6, 3]"]),
    ("transposed-channels", lambda: F.conv_transpose2d(_zeros(1, 3, 5, 5), _zeros(4, 2, 3, 3)),
     fl.ShapeError, ["conv_transpose2d", "[1, 3, 5, 5]", "[4, 2, 3, 3]"]),
    ("too-small", lambda: F.conv2d(_zeros(1, 3, 2, 5), _zeros(4, 3, 3, 3)), fl.ShapeError,
     ["conv2d", "[1, 3, 2, 5]", "smaller than the kernel"]),
    ("too-small-dilated",
     lambda: F.conv2d(_zeros(1, 3, 5, 5), _zeros(4, 3, 3, 3), padding=1, dilation=4),
     fl.ShapeError, ["conv2d", "[1, 3, 5, 5]", "smaller than the kernel"]),
    ("too-small-1d", lambda: F.conv1d(_zeros(1, 3, 2), _zeros(4, 3, 7), padding=2),
     fl.ShapeError, ["conv1d", "[1, 3, 2]", "smaller than the kernel"]),
    ("weight-5d", lambda: F.conv2d(_zeros(1, 3, 5, 5), _zeros(4, 3, 3, 3, 1)), fl.ShapeError,
     ["conv2d", "4-d weight", "[4, 3, 3, 3, 1]"]),
    ("int", lambda: F.conv2d(_zeros(1, 3, 5, 5, dtype=fl.int32), _zeros(4, 3, 3, 3,
                                                                       dtype=fl.int32)),
     TypeError, ["conv", "int32[1, 3, 5, 5]"]),
    ("int-transposed", lambda: F.conv_transpose1d(_zeros(1, 4, 5, dtype=fl.int64),
                                                  _zeros(4, 2, 3, dtype=fl.int64)),
     TypeError, ["conv_data_grad", "int64[1, 4, 5]"]),
    ("dtypes", lambda: F.conv2d(_zeros(1, 3, 5, 5), _zeros(4, 3, 3, 3, dtype=fl.float16)),
     TypeError, ["conv", "float32[1, 3, 5, 5]", "float16[4, 3, 3, 3]"]),
    ("dtypes-transposed",
     lambda: F.conv_transpose2d(_zeros(1, 4, 5, 5), _zeros(4, 2, 3, 3, dtype=fl.bfloat16)),
     TypeError, ["conv_data_grad", "float32[1, 4, 5, 5]", "bfloat16[4, 2, 3, 3]"]),
    ("op-data-grad-size",
     lambda: apply_op("conv_data_grad", _zeros(1, 4, 3, 3), _zeros(4, 2, 3, 3), stride=(1, 1),
                      padding=((0, 0), (0, 0)), dilation=(1, 1), groups=1, input_size=(7, 7)),
     fl.ShapeError, ["conv_data_grad", "[7, 7]", "[5, 5]", "[3, 3]"]),
    ("op-weight-grad-batch",
     lambda: apply_op("conv_weight_grad", _zeros(2, 4, 5, 5), _zeros(3, 2, 3, 3), stride=(1, 1),
                      padding=((0, 0), (0, 0)), dilation=(1, 1), groups=1, kernel_size=(3, 3)),
     fl.ShapeError, ["conv_weight_grad", "float32[2, 4, 5, 5]", "float32[3, 2, 3, 3]"]),
    ("op-attributes",
     lambda: apply_op("conv", _zeros(1, 4, 5, 5), _zeros(2, 4, 3, 3), stride=(1,),
                      padding=((0, 0), (0, 0)), dilation=(1, 1), groups=1),
     ValueError, ["conv", "stride [1]", "one entry per spatial axis (2)"]),
]  # fmt: skip


@pytest.mark.parametrize("build, error, parts", [case[1:] for case in ERRORS],
                         ids=[case[0] for case in ERRORS])  # fmt: skip
def test_bad_input_fails_at_build_time(build, error, parts, reference_backend):
    with pytest.raises(error) as raised:
        build()
    message = str(raised.value)
    for part in parts:
        assert part in message, (part, message)


# --- gpu tier ------------------------------------------------------------------------------------

GPU_DTYPES = {
    # dtype name: (rtol, atol as a fraction of the largest magnitude)
    "float32": (2e-2, 2e-2),  # cuDNN may use TF32 tensor cores (10-bit mantissa)
    "bfloat16": (3e-2, 3e-2),
    "float16": (1e-2, 1e-2),
}


@pytest.fixture(params=[True, False], ids=["cudnn", "fallback"])
def cudnn_enabled(request):
    """``fl.backends.cudnn.enabled`` set for one test, restored after it."""
    with fl.backends.cudnn.flags(enabled=request.param):
        yield request.param


def _compare_with_reference(case, rng, dtype_name, layout):
    dtype = getattr(fl, dtype_name)
    arrays = _rounded(_arrays(case, rng), dtype)
    with fl.backend("cuda"):
        got = flame_values(case, arrays, rng=rng, layout=layout)
    with fl.backend("reference"):
        want = flame_values(case, arrays, seed=got["seed"])
    rtol, scaled_atol = GPU_DTYPES[dtype_name]
    assert_values_close(got, want, rtol=rtol, scaled_atol=scaled_atol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", list(GPU_DTYPES))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_gpu_matches_reference(case, dtype_name, cudnn_enabled, rng):
    _compare_with_reference(case, rng, dtype_name, "contiguous")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", list(GPU_DTYPES))
@pytest.mark.parametrize("case", CHANNELS_LAST, ids=str)
def test_gpu_channels_last_matches_reference(case, dtype_name, cudnn_enabled, rng):
    _compare_with_reference(case, rng, dtype_name, "channels_last")


def _conv_step(x, target, w, b):
    def loss(w, b):
        hidden = F.relu(F.conv2d(x, w, b, stride=2, padding=1))
        return F.mse_loss(hidden, target)

    return fl.value_and_grad(loss, argnums=(0, 1))(w, b)


@pytest.mark.gpu
def test_compiled_training_step_with_a_conv_replays(cudnn_enabled, rng, cuda_backend):
    graphed = fl.compile(_conv_step, cuda_graph=True)
    shapes = [(2, 3, 9, 8), (2, 4, 5, 4), (4, 3, 3, 3), (4,)]
    x, target, w, b = [
        fl.tensor(rng.standard_normal(shape).astype(np.float32)).realize() for shape in shapes
    ]
    for _ in range(2):
        got_loss, got_grads = graphed(x, target, w, b)
        want_loss, want_grads = _conv_step(x, target, w, b)
        # the same plans; cuDNN's weight gradient may sum in another order (atomics)
        np.testing.assert_allclose(got_loss.numpy(), want_loss.numpy(), rtol=1e-4)
        for got, want in zip(got_grads, want_grads):
            scale = float(np.abs(want.numpy()).max())
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5 * scale)
        w.copy_(w.numpy() - 0.1 * want_grads[0].numpy())  # in place: same address, new values
    info = graphed.cache_info()
    assert info.traces == 1
    if cudnn_enabled and fl.backends.cudnn.is_available():  # cuDNN's plans are captured
        assert info.graph_captures == 1 and info.graph_replays == 2, info
        assert not info.graph_failures, info.graph_failures
    else:  # the CuPy fallback's cuBLAS calls refuse a capture: the step runs uncaptured
        assert info.graph_captures == 1 or info.graph_failures, info


PLAN_SCRIPT = textwrap.dedent(
    """
    import json

    import numpy as np

    import flame as fl
    import flame.nn.functional as F
    from flame.runtime import library_cudnn

    with fl.backend("cuda"):
        x = fl.tensor(np.ones((1, 3, 8, 8), np.float32))
        w = fl.tensor(np.ones((4, 3, 3, 3), np.float32))
        F.conv2d(x, w, padding=1).numpy()
    print(json.dumps(library_cudnn.plan_counts()))
    """
)


@pytest.mark.gpu
def test_cudnn_plan_is_read_from_the_disk_cache_by_a_fresh_process(tmp_path):
    if not fl.backends.cudnn.is_available():
        pytest.skip("cuDNN is not available")
    environment = {**os.environ, "FLAME_CACHE_DIR": str(tmp_path / "cache")}
    counts = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", PLAN_SCRIPT], env=environment, cwd=REPO,
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        counts.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = counts
    assert first.get("built", 0) >= 1 and not first.get("disk"), first
    assert second.get("disk", 0) >= 1, second


# --- FLAME's layout choice: 16-bit 2-d convolutions on channels-last memory -------------------


@pytest.fixture
def layout_choice():
    """Sets ``fl.backends.cudnn.channels_last`` for one test and restores it."""
    saved = fl.backends.cudnn.channels_last
    yield lambda value: setattr(fl.backends.cudnn, "channels_last", value)
    fl.backends.cudnn.channels_last = saved


def _bf16_values(case: Case, arrays, seed):
    """flame_values on bfloat16 inputs (so the layout choice applies) and the conv ops built."""
    rounded = _rounded(arrays, fl.bfloat16)
    primals = [fl.tensor(array).to(fl.bfloat16) for array in rounded]

    def function(*tensors):
        bias = tensors[2] if case.bias else None
        return getattr(F, case.op)(tensors[0], tensors[1], bias, **case.kwargs())

    out, pullback = fl.vjp(function, *primals)
    grads = pullback(fl.tensor(seed).to(fl.bfloat16))
    ops = {
        (node.op, node.attr("channels_last", False))
        for node in graph_nodes(out, *grads)
        if node.op.startswith("conv")
    }
    values = [out.float().numpy()] + [grad.float().numpy() for grad in grads]
    return values, ops


def _pointwise(case: Case) -> bool:
    """A 1x1, stride-1, unpadded, ungrouped conv2d: one matmul, not a conv op."""
    return (
        not case.transposed and set(case.kernel) == {1} and case.stride in (1, (1, 1))
        and case.padding in (0, (0, 0), "valid", "same") and case.groups == 1
    )  # fmt: skip


LAYOUT_CASES = [case for case in CASES if len(case.input_shape()) == 4 and not _pointwise(case)][
    ::2
]


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=str)
def test_channels_last_choice_gives_the_same_values(case, rng, reference_backend, layout_choice):
    """The channels-last ops (input, result and gradient laid out [N, H, W, C]) give bit for
    bit the values of the channels-first ones, and are the ones built for bfloat16 while the
    choice is on; off, no conv op carries the attribute."""
    arrays = _arrays(case, rng)
    with fl.backend("reference"):
        probe = getattr(F, case.op)(
            fl.tensor(arrays[0]), fl.tensor(arrays[1]), None, **case.kwargs()
        )
    seed = _rounded([rng.standard_normal(probe.shape).astype(np.float32)], fl.bfloat16)[0]
    layout_choice(True)
    chosen, chosen_ops = _bf16_values(case, arrays, seed)
    layout_choice(False)
    plain, plain_ops = _bf16_values(case, arrays, seed)
    assert chosen_ops and all(last for _, last in chosen_ops), chosen_ops
    assert plain_ops and not any(last for _, last in plain_ops), plain_ops
    for got, want in zip(chosen, plain):
        np.testing.assert_array_equal(got, want)


def test_channels_last_ops_match_the_channels_first_references(rng):
    """The three ops' references with ``channels_last=True`` are the channels-first ones with
    the channel axis of the input, result, gradient, weight and weight gradient moved last
    (stride 2, padding, groups)."""
    from flame.ir.ops import conv

    x = rng.standard_normal((2, 4, 7, 6))
    w = rng.standard_normal((6, 2, 3, 3))
    attrs = {"stride": (2, 1), "padding": ((1, 1), (0, 2)), "dilation": (1, 2), "groups": 2}
    last = lambda array: np.moveaxis(array, 1, -1)  # noqa: E731
    y = conv._conv_ref(x, w, **attrs)
    got = conv._conv_ref(last(x), last(w), channels_last=True, **attrs)
    np.testing.assert_allclose(got, last(y))
    g = rng.standard_normal(y.shape)
    dx = conv._data_grad_ref(g, w, input_size=(7, 6), **attrs)
    got = conv._data_grad_ref(last(g), last(w), input_size=(7, 6), channels_last=True, **attrs)
    np.testing.assert_allclose(got, last(dx))
    dw = conv._weight_grad_ref(x, g, kernel_size=(3, 3), **attrs)
    got = conv._weight_grad_ref(last(x), last(g), kernel_size=(3, 3), channels_last=True, **attrs)
    np.testing.assert_allclose(got, last(dw))


@pytest.mark.parametrize("dtype", [fl.float32, fl.bfloat16])
def test_pointwise_conv2d_is_one_matmul(dtype, rng, reference_backend):
    """A 1x1 convolution (stride 1, no padding, one group) is a batched GEMM on the NCHW
    memory, forward and backward: no conv op, no layout change; values as PyTorch's."""
    torch = pytest.importorskip("torch", reason="PyTorch is the reference for these checks")
    x = _rounded([rng.standard_normal((2, 6, 5, 7)).astype(np.float32)], dtype)[0]
    w = _rounded([rng.standard_normal((4, 6, 1, 1)).astype(np.float32)], dtype)[0]
    primals = [fl.tensor(x).to(dtype), fl.tensor(w).to(dtype)]
    out, pullback = fl.vjp(lambda a, b: F.conv2d(a, b), *primals)
    grads = pullback(fl.ones(out.shape, dtype=dtype))
    ops = set(graph_ops(out, *grads))
    assert "matmul" in ops and not any(op.startswith("conv") for op in ops), ops
    tx, tw = (torch.from_numpy(np.asarray(a, np.float64)).requires_grad_() for a in (x, w))
    ty = torch.nn.functional.conv2d(tx, tw)
    ty.backward(torch.ones_like(ty))
    tolerance = 1e-5 if dtype is fl.float32 else 2e-2
    for got, want in ((out, ty), (grads[0], tx.grad), (grads[1], tw.grad)):
        want = want.detach().numpy()
        np.testing.assert_allclose(
            got.float().numpy(), want, rtol=tolerance, atol=tolerance * np.abs(want).max()
        )


def test_cudnn_flags_set_settings_for_a_block_and_restore_them():
    cudnn = fl.backends.cudnn
    before = (cudnn.enabled, cudnn.channels_last)
    with pytest.raises(RuntimeError, match="inside"):
        with cudnn.flags(enabled=not before[0]):
            assert (cudnn.enabled, cudnn.channels_last) == (not before[0], before[1])
            raise RuntimeError("inside")
    assert (cudnn.enabled, cudnn.channels_last) == before
    with cudnn.flags(channels_last=False):
        assert cudnn.channels_last is False and cudnn.enabled == before[0]
    assert (cudnn.enabled, cudnn.channels_last) == before
