"""``conv``, ``conv_data_grad`` and ``conv_weight_grad`` on the GPU.

cuDNN (``conv_fprop``, ``conv_dgrad``, ``conv_wgrad`` of its graph API, plans cached per
configuration by ``library_cudnn``) computes them for float16, bfloat16 and float32 (float32
may use TF32 tensor cores, as PyTorch's default ``torch.backends.cudnn.allow_tf32``). cuDNN's
tensors have at least two spatial axes, so a 1-d convolution runs with a unit height.
Inputs are read in place when their layout is dense (NCHW, or channels-last: a permuted view
of NHWC memory) and 16-byte aligned; other views are copied first. Results are C-contiguous
in the node's layout (NCHW, or NHWC for the channels-last ops).

Without cuDNN (not installed, ``flame.backends.cudnn.enabled = False``, float64), the
fallback is im2col with CuPy: one strided view per kernel tap stacked into columns, one
batched matmul (cuBLAS), and for the data gradient a strided scatter-add per tap. It costs
kernel-taps times the input's memory and computes 16-bit types in float32.
"""

from __future__ import annotations

import functools
import itertools
import warnings

import numpy as np

from flame.ir.node import Node
from flame.ir.ops.conv import channels_first_shape
from flame.runtime import library_cudnn as dnn
from flame.runtime.library import implements
from flame.runtime.library_scan import _narrowed, _widened

X, W, Y = 1, 2, 3  # tensor uids in every convolution plan
_REFUSED: set[tuple] = set()  # configurations cuDNN refused (they take the fallback)
CUDNN_TYPES = ("float16", "bfloat16", "float32")


def _attrs(node: Node) -> dict:
    return {name: node.attr(name) for name in ("stride", "padding", "dilation", "groups")}


def describe(node: Node) -> str:
    shapes = ", ".join(f"{child.dtype.name}{list(child.shape)}" for child in node.inputs)
    attrs = _attrs(node)
    return (
        f"{node.op}({shapes}, stride={list(attrs['stride'])}, padding={list(attrs['padding'])}, "
        f"dilation={list(attrs['dilation'])}, groups={attrs['groups']})"
    )


def _dense(array) -> bool:
    """Whether the strides describe a dense (gap-free, non-overlapping) layout of the array."""
    pairs = sorted(
        (stride // array.itemsize, size) for stride, size in zip(array.strides, array.shape)
        if size != 1
    )  # fmt: skip
    expected = 1
    for stride, size in pairs:
        if stride != expected:
            return False
        expected *= size
    return True


def _readable(array, dtype_name: str):
    """The array as the calls read it: dense (else copied), bfloat16 as uint16 bits (a buffer
    imported through DLPack may carry CuPy's own bfloat16 dtype)."""
    import cupy

    if dtype_name == "bfloat16" and array.dtype != np.uint16:
        array = array.view(np.uint16)
    if _dense(array) and array.data.ptr % 16 == 0:
        return array
    return cupy.ascontiguousarray(array) if not _dense(array) else array.copy()


def _as_2d(array, spatial: int):
    """(dims, element strides) with a unit height inserted for a 1-d convolution."""
    dims = list(array.shape)
    strides = [stride // array.itemsize for stride in array.strides]
    if spatial == 1:
        dims.insert(2, 1)
        strides.insert(2, strides[2] * dims[3] if dims[3] else 1)
    return dims, strides


def _conv_options(attrs: dict, spatial: int) -> dict:
    stride, dilation = list(attrs["stride"]), list(attrs["dilation"])
    before = [pair[0] for pair in attrs["padding"]]
    after = [pair[1] for pair in attrs["padding"]]
    if spatial == 1:
        stride, dilation, before, after = [1] + stride, [1] + dilation, [0] + before, [0] + after
    return {"pre_padding": before, "post_padding": after, "stride": stride, "dilation": dilation}


def _channels_first(array, channels_last: bool):
    """A channels-last array [N, *S, C] as the channels-first view cuDNN's descriptors and
    the fallback take (cuDNN reads the layout from the strides)."""
    import cupy

    return cupy.moveaxis(array, -1, 1) if channels_last else array


def _run_cudnn(node: Node, kind: str, first, second, out) -> None:
    """One cuDNN convolution: ``kind`` fprop (x, w -> y), dgrad (dy, w -> dx) or wgrad
    (x, dy -> dw); ``first``/``second`` are the inputs in that order, ``out`` the result,
    all channels-first views (of channels-last memory where the node says so)."""
    dtype = node.dtype.name
    spatial = len(node.shape) - 2
    options = _conv_options(_attrs(node), spatial)
    layouts = [_as_2d(array, spatial) for array in (first, second, out)]
    uids = {"fprop": (X, W, Y), "dgrad": (Y, W, X), "wgrad": (X, Y, W)}[kind]
    key = (kind, dtype, tuple((tuple(d), tuple(s)) for d, s in layouts), repr(options))
    describe_node = functools.partial(describe, node)  # formatted only for an error

    def define(graph):
        made = [
            dnn.tensor(graph, uid, f"t{uid}", array, dtype, dims, strides)
            for uid, array, (dims, strides) in zip(uids[:2], (first, second), layouts[:2])
        ]
        if kind == "fprop":
            result = graph.conv_fprop(image=made[0], weight=made[1], **options)
        elif kind == "dgrad":
            result = graph.conv_dgrad(loss=made[0], filter=made[1], **options)
        else:
            result = graph.conv_wgrad(image=made[0], loss=made[1], **options)
        dims, strides = layouts[2]
        result.set_output(True).set_dim(dims).set_stride(strides)
        result.set_data_type(dnn.data_type(dtype)).set_uid(uids[2])

    made = dnn.plan(key, dtype, define, describe_node)
    pointers = {uid: array.data.ptr for uid, array in zip(uids, (first, second, out))}
    dnn.execute(made, pointers, describe_node)


def _use_cudnn(node: Node) -> bool:
    return node.dtype.name in CUDNN_TYPES and dnn.usable()


def _empty(node: Node):
    import cupy

    storage = np.uint16 if node.dtype.name == "bfloat16" else node.dtype.numpy
    return cupy.empty(node.shape, dtype=storage)


def _last(node: Node) -> bool:
    return bool(node.attr("channels_last", False))


def _result(node: Node, computed):
    """A fallback's channels-first result in the node's layout (C-contiguous)."""
    import cupy

    if _last(node):
        return cupy.ascontiguousarray(cupy.moveaxis(computed, 1, -1))
    return computed


def _convolution(node: Node, arrays: list, kind: str, fallback):
    """One of the three ops: ``kind`` fprop (x, w), dgrad (dy, w) or wgrad (x, dy), through
    cuDNN or ``fallback(node, first, second)``; channels-last operands (weights and weight
    gradients [O, *K, C] there) are handed on as channels-first views."""
    first, second = (_readable(array, node.dtype.name) for array in arrays)
    out = _empty(node)
    if out.size == 0:
        return out
    if first.size == 0 or second.size == 0:
        out.fill(0)
        return out
    last = _last(node)
    first, second = _channels_first(first, last), _channels_first(second, last)
    view = _channels_first(out, last)
    if _use_cudnn(node) and dnn.configuration(node) not in _REFUSED:
        try:
            _run_cudnn(node, kind, first, second, view)
            return out
        except dnn.CudnnError as error:
            if "refused" not in str(error):
                raise
            _REFUSED.add(dnn.configuration(node))
            warnings.warn(f"{error}; the im2col fallback runs it instead", stacklevel=2)
    return _result(node, fallback(node, first, second))


@implements("conv")
def conv(node: Node, arrays: list):
    return _convolution(node, arrays, "fprop", _fallback_conv)


@implements("conv_data_grad")
def conv_data_grad(node: Node, arrays: list):
    return _convolution(node, arrays, "dgrad", _fallback_data_grad)


@implements("conv_weight_grad")
def conv_weight_grad(node: Node, arrays: list):
    return _convolution(node, arrays, "wgrad", _fallback_weight_grad)


# --- the CuPy fallback (im2col) ----------------------------------------------------------------


def _taps(kernel):
    return list(itertools.product(*map(range, kernel)))


def _tap_view(padded, tap, attrs, sizes):
    where = tuple(
        slice(index * spacing, index * spacing + step * (count - 1) + 1, step)
        for index, step, spacing, count in zip(tap, attrs["stride"], attrs["dilation"], sizes)
    )
    return padded[(Ellipsis, *where)]


def _columns(x, kernel, attrs, sizes):
    """[N, groups, C/groups * taps, prod(sizes)] from x [N, C, *S] (float32 or float64)."""
    import cupy

    groups = attrs["groups"]
    padded = cupy.pad(x, [(0, 0), (0, 0), *attrs["padding"]])
    views = [_tap_view(padded, tap, attrs, sizes) for tap in _taps(kernel)]
    stacked = cupy.stack(views, axis=2)  # [N, C, taps, *R]
    count = int(np.prod(sizes))
    per_group = x.shape[1] // groups * len(views)
    return stacked.reshape(x.shape[0], groups, per_group, count)


def _fallback_conv(node: Node, x, w):
    dtype = node.dtype.name
    attrs = _attrs(node)
    x, w = _widened(x, dtype), _widened(w, dtype)
    shape = channels_first_shape(node.shape, _last(node))
    groups, sizes = attrs["groups"], shape[2:]
    columns = _columns(x, w.shape[2:], attrs, sizes)
    matrix = w.reshape(groups, w.shape[0] // groups, -1)
    result = (matrix @ columns).reshape(shape)
    return _narrowed(result, dtype)


def _fallback_data_grad(node: Node, g, w):
    import cupy

    dtype = node.dtype.name
    attrs = _attrs(node)
    g, w = _widened(g, dtype), _widened(w, dtype)
    shape = channels_first_shape(node.shape, _last(node))
    groups, kernel, sizes = attrs["groups"], w.shape[2:], g.shape[2:]
    batch, channels = shape[:2]
    matrix = w.reshape(groups, w.shape[0] // groups, -1)  # [g, O/g, C/g * taps]
    grads = g.reshape(batch, groups, g.shape[1] // groups, -1)
    columns = cupy.swapaxes(matrix, 1, 2) @ grads  # [N, g, C/g * taps, R]
    taps = _taps(kernel)
    columns = columns.reshape(batch, channels, len(taps), *sizes)
    padded_size = [
        size + before + after for size, (before, after) in zip(shape[2:], attrs["padding"])
    ]
    padded = cupy.zeros((batch, channels, *padded_size), dtype=columns.dtype)
    for index, tap in enumerate(taps):
        _tap_view(padded, tap, attrs, sizes)[...] += columns[:, :, index]
    inside = tuple(
        slice(before, before + size) for size, (before, _) in zip(shape[2:], attrs["padding"])
    )
    return _narrowed(padded[(Ellipsis, *inside)], dtype)


def _fallback_weight_grad(node: Node, x, g):
    import cupy

    dtype = node.dtype.name
    attrs = _attrs(node)
    x, g = _widened(x, dtype), _widened(g, dtype)
    shape = channels_first_shape(node.shape, _last(node))  # [O, C/g, *K]
    groups, sizes = attrs["groups"], g.shape[2:]
    columns = _columns(x, shape[2:], attrs, sizes)  # [N, g, C/g * taps, R]
    grads = g.reshape(g.shape[0], groups, g.shape[1] // groups, -1)
    result = cupy.einsum("ngor,ngkr->gok", grads, columns)
    return _narrowed(result.reshape(shape), dtype)
