"""Convolution as three library ops: ``conv`` (forward), ``conv_data_grad`` and
``conv_weight_grad``, for any number of spatial axes (1, 2 or 3).

Shapes, as PyTorch's: the input ``x`` is [N, C, *S], the weight ``w`` [O, C/groups, *K], the
result [N, O, *R] with ``R = (S + before + after - dilation*(K-1) - 1) // stride + 1``. The
attributes are normalized by the front end (``flame/nn/convolution.py``): ``stride`` and
``dilation`` one positive int per spatial axis, ``padding`` one ``(before, after)`` pair per
spatial axis (asymmetric pairs are how ``padding='same'`` with an even kernel is spelled),
``groups`` a positive int. The two gradient ops carry the size their result needs, which the
forward cannot be inverted to give (``input_size``: several input sizes share a result size
when the stride is > 1; ``kernel_size``).

The three ops close under differentiation, so higher-order gradients are more of them::

    y  = conv(x, w)               dx = conv_data_grad(g, w)      dw = conv_weight_grad(x, g)
    dx = conv_data_grad(g, w):    d/dg = conv(c, w)              d/dw = conv_weight_grad(c, g)
    dw = conv_weight_grad(x, g):  d/dx = conv_data_grad(g, c)    d/dg = conv(x, c)

A transposed convolution is ``conv_data_grad`` of its input (the gradient relationship), so
it needs no op of its own.

``channels_last=True``: the input, the result and the incoming gradient are laid out
[N, *spatial, C] instead, and the weight and the weight gradient [O, *K, C/groups]. The front
end chooses it for 16-bit 2-d convolutions (flame/nn/convolution.py): cuDNN's Hopper kernels
compute in that layout, so an NCHW tensor (or a [O, C, *K] filter) costs a transpose per call
inside cuDNN, while a channels-last one is written in that order by the FLAME kernel that
computes it (a permute folds into its index map: the weight's autocast cast writes the
filter [O, *K, C]) and read through a permuted view by the kernels after it.

The references sum over the kernel taps directly, in float64, whatever the dtype (the oracle
of the tests). On the GPU the ops run through cuDNN's graph API, or a CuPy fallback where
cuDNN is absent (``flame/runtime/library_conv.py``).
"""

from __future__ import annotations

import itertools

import numpy as np

from flame.ir.ops.registry import def_op, def_vjp
from flame.ir.shapes import ShapeError

FLOATS = ("float16", "bfloat16", "float32", "float64")
CONV_ATTRS = {"stride": (), "padding": (), "dilation": (), "groups": 1, "channels_last": False}


def channels_first_shape(shape, channels_last: bool) -> tuple[int, ...]:
    """[N, *S, C] -> [N, C, *S] where ``channels_last``; the shape as it is otherwise."""
    shape = tuple(shape)
    return (shape[0], shape[-1], *shape[1:-1]) if channels_last else shape


def channels_last_shape(shape, channels_last: bool) -> tuple[int, ...]:
    """[N, C, *S] -> [N, *S, C] where ``channels_last``."""
    shape = tuple(shape)
    return (shape[0], *shape[2:], shape[1]) if channels_last else shape


class _Logical:
    """A node's dtype with its shape seen channels-first (for the shared shape checks)."""

    def __init__(self, node, channels_last: bool):
        self.dtype = node.dtype
        self.shape = channels_first_shape(node.shape, channels_last)


def _shown(node) -> str:
    return f"{node.dtype.name}{list(node.shape)}"


def output_sizes(sizes, kernel, stride, padding, dilation) -> tuple[int, ...]:
    """The result's spatial sizes (may be <= 0 where the padded input is too small)."""
    return tuple(
        (size + before + after - spacing * (taps - 1) - 1) // step + 1
        for size, taps, step, (before, after), spacing in zip(
            sizes, kernel, stride, padding, dilation, strict=True
        )
    )


def _check_attrs(op: str, spatial: int, attrs) -> None:
    stride, padding, dilation = attrs["stride"], attrs["padding"], attrs["dilation"]
    if not 1 <= spatial <= 3:
        raise ShapeError(f"{op}: 1, 2 or 3 spatial axes are supported, got {spatial}")
    if len(stride) != spatial or len(dilation) != spatial or len(padding) != spatial:
        raise ValueError(
            f"{op}: stride {list(stride)}, padding {list(padding)} and dilation "
            f"{list(dilation)} must each have one entry per spatial axis ({spatial})"
        )
    if min(stride) < 1 or min(dilation) < 1 or min(min(pair) for pair in padding) < 0:
        raise ValueError(
            f"{op}: stride and dilation must be positive and padding non-negative, got "
            f"stride {list(stride)}, padding {list(padding)}, dilation {list(dilation)}"
        )
    if attrs["groups"] < 1:
        raise ValueError(f"{op}: groups must be positive, got {attrs['groups']}")


def _check_float(op: str, *nodes) -> None:
    first = nodes[0]
    for node in nodes:
        if node.dtype.name not in FLOATS:
            raise TypeError(f"{op}: needs float tensors, got {_shown(node)}")
        if node.dtype is not first.dtype:
            raise TypeError(
                f"{op}: operands must share one dtype, got "
                + " and ".join(_shown(node) for node in nodes)
            )


def _check_channels(op: str, channels: int, out_channels: int, weight_shape, groups: int, x):
    if out_channels % groups:
        raise ShapeError(
            f"{op}: {out_channels} output channels of weight {list(weight_shape)} are not "
            f"divisible by groups={groups}"
        )
    if channels != weight_shape[1] * groups:
        raise ShapeError(
            f"{op}: input {_shown(x)} has {channels} channels, but weight "
            f"{list(weight_shape)} with groups={groups} expects {weight_shape[1] * groups}"
        )


def _result_sizes(op: str, sizes, kernel, attrs, shown: str) -> tuple[int, ...]:
    result = output_sizes(sizes, kernel, attrs["stride"], attrs["padding"], attrs["dilation"])
    if min(result, default=1) < 1:
        raise ShapeError(
            f"{op}: {shown} padded by {list(attrs['padding'])} is smaller than the kernel "
            f"{list(kernel)} with dilation {list(attrs['dilation'])}"
        )
    return result


def _conv_rule(inputs, attrs):
    last = attrs.get("channels_last", False)
    logical = (_Logical(inputs[0], last), _Logical(inputs[1], last))
    dtype, shape = _conv_rule_first(logical, attrs)
    return dtype, channels_last_shape(shape, last)


def _data_grad_rule(inputs, attrs):
    last = attrs.get("channels_last", False)
    logical = (_Logical(inputs[0], last), _Logical(inputs[1], last))
    dtype, shape = _data_grad_rule_first(logical, attrs)
    return dtype, channels_last_shape(shape, last)


def _weight_grad_rule(inputs, attrs):
    last = attrs.get("channels_last", False)
    logical = (_Logical(inputs[0], last), _Logical(inputs[1], last))
    dtype, shape = _weight_grad_rule_first(logical, attrs)
    return dtype, channels_last_shape(shape, last)


def _conv_rule_first(inputs, attrs):
    x, w = inputs
    _check_float("conv", x, w)
    spatial = len(x.shape) - 2
    if spatial < 1 or len(w.shape) != len(x.shape):
        raise ShapeError(
            f"conv: expected input [N, C, *spatial] and weight [O, C/groups, *kernel] of one "
            f"rank, got input {_shown(x)} and weight {_shown(w)}"
        )
    _check_attrs("conv", spatial, attrs)
    _check_channels("conv", x.shape[1], w.shape[0], w.shape, attrs["groups"], x)
    sizes = _result_sizes("conv", x.shape[2:], w.shape[2:], attrs, f"input {_shown(x)}")
    return x.dtype, (x.shape[0], w.shape[0], *sizes)


def _data_grad_rule_first(inputs, attrs):
    g, w = inputs
    _check_float("conv_data_grad", g, w)
    spatial = len(g.shape) - 2
    input_size = tuple(attrs["input_size"])
    if spatial < 1 or len(w.shape) != len(g.shape) or len(input_size) != spatial:
        raise ShapeError(
            f"conv_data_grad: expected grad [N, O, *spatial], weight [O, C/groups, *kernel] and "
            f"{spatial} input sizes, got grad {_shown(g)}, weight {_shown(w)}, input_size "
            f"{list(input_size)}"
        )
    _check_attrs("conv_data_grad", spatial, attrs)
    if w.shape[0] != g.shape[1] or w.shape[0] % attrs["groups"]:
        raise ShapeError(
            f"conv_data_grad: grad {_shown(g)} has {g.shape[1]} channels, weight {_shown(w)} "
            f"has {w.shape[0]} output channels (groups={attrs['groups']})"
        )
    sizes = _result_sizes("conv_data_grad", input_size, w.shape[2:], attrs, "input")
    if sizes != tuple(g.shape[2:]):
        raise ShapeError(
            f"conv_data_grad: an input of spatial size {list(input_size)} gives a result of "
            f"{list(sizes)}, not the grad's {list(g.shape[2:])}"
        )
    return g.dtype, (g.shape[0], w.shape[1] * attrs["groups"], *input_size)


def _weight_grad_rule_first(inputs, attrs):
    x, g = inputs
    _check_float("conv_weight_grad", x, g)
    spatial = len(x.shape) - 2
    kernel = tuple(attrs["kernel_size"])
    if spatial < 1 or len(g.shape) != len(x.shape) or len(kernel) != spatial:
        raise ShapeError(
            f"conv_weight_grad: expected input [N, C, *spatial], grad [N, O, *spatial] and "
            f"{spatial} kernel sizes, got input {_shown(x)}, grad {_shown(g)}, kernel_size "
            f"{list(kernel)}"
        )
    _check_attrs("conv_weight_grad", spatial, attrs)
    groups = attrs["groups"]
    if x.shape[0] != g.shape[0] or x.shape[1] % groups or g.shape[1] % groups:
        raise ShapeError(
            f"conv_weight_grad: input {_shown(x)} and grad {_shown(g)} disagree on the batch "
            f"or are not divisible by groups={groups}"
        )
    sizes = _result_sizes("conv_weight_grad", x.shape[2:], kernel, attrs, f"input {_shown(x)}")
    if sizes != tuple(g.shape[2:]):
        raise ShapeError(
            f"conv_weight_grad: input {_shown(x)} with kernel {list(kernel)} gives a result of "
            f"{list(sizes)}, not the grad's {list(g.shape[2:])}"
        )
    return x.dtype, (g.shape[1], x.shape[1] // groups, *kernel)


# --- references: direct summation over the kernel taps, in float64 -----------------------------


def _tap_slices(tap, stride, dilation, sizes):
    """Per spatial axis, the strided slice of the padded input that kernel tap ``tap`` reads
    for every result position."""
    return tuple(
        slice(index * spacing, index * spacing + step * (count - 1) + 1, step)
        for index, step, spacing, count in zip(tap, stride, dilation, sizes, strict=True)
    )


def _grouped(array, groups: int):
    """[N, C, *S] -> [N, groups, C/groups, *S]."""
    return array.reshape(array.shape[0], groups, array.shape[1] // groups, *array.shape[2:])


def _first(array, channels_last: bool):
    """A channels-last array seen channels-first (a view)."""
    array = np.asarray(array, np.float64)
    return np.moveaxis(array, -1, 1) if channels_last else array


def _last(array, channels_last: bool):
    return np.ascontiguousarray(np.moveaxis(array, 1, -1)) if channels_last else array


def _conv_ref(x, w, stride=(), padding=(), dilation=(), groups=1, channels_last=False):
    x, w = _first(x, channels_last), _first(w, channels_last)
    kernel = w.shape[2:]
    sizes = output_sizes(x.shape[2:], kernel, stride, padding, dilation)
    padded = _grouped(np.pad(x, [(0, 0), (0, 0), *padding]), groups)
    weights = w.reshape(groups, w.shape[0] // groups, *w.shape[1:])  # [g, O/g, C/g, *K]
    result = np.zeros((x.shape[0], groups, w.shape[0] // groups, *sizes))
    for tap in itertools.product(*map(range, kernel)):
        patch = padded[(slice(None),) * 3 + _tap_slices(tap, stride, dilation, sizes)]
        result += np.einsum("ngc...,goc->ngo...", patch, weights[(Ellipsis, *tap)])
    return _last(result.reshape(x.shape[0], w.shape[0], *sizes), channels_last)


def _data_grad_ref(
    g, w, stride=(), padding=(), dilation=(), groups=1, input_size=(), channels_last=False
):
    g, w = _first(g, channels_last), _first(w, channels_last)
    kernel, sizes = w.shape[2:], g.shape[2:]
    padded_size = [size + before + after for size, (before, after) in zip(input_size, padding)]
    grads = _grouped(g, groups)
    weights = w.reshape(groups, w.shape[0] // groups, *w.shape[1:])
    padded = np.zeros((g.shape[0], groups, w.shape[1], *padded_size))
    for tap in itertools.product(*map(range, kernel)):
        where = (slice(None),) * 3 + _tap_slices(tap, stride, dilation, sizes)
        padded[where] += np.einsum("ngo...,goc->ngc...", grads, weights[(Ellipsis, *tap)])
    inside = tuple(slice(before, before + size) for size, (before, _) in zip(input_size, padding))
    result = padded[(slice(None),) * 3 + inside]
    return _last(result.reshape(g.shape[0], w.shape[1] * groups, *input_size), channels_last)


def _weight_grad_ref(
    x, g, stride=(), padding=(), dilation=(), groups=1, kernel_size=(), channels_last=False
):
    x, g = _first(x, channels_last), _first(g, channels_last)
    sizes = g.shape[2:]
    padded = _grouped(np.pad(x, [(0, 0), (0, 0), *padding]), groups)
    flat_grads = _grouped(g, groups).reshape(g.shape[0], groups, g.shape[1] // groups, -1)
    result = np.zeros((groups, g.shape[1] // groups, x.shape[1] // groups, *kernel_size))
    for tap in itertools.product(*map(range, kernel_size)):
        patch = padded[(slice(None),) * 3 + _tap_slices(tap, stride, dilation, sizes)]
        flat = patch.reshape(*patch.shape[:3], -1)
        result[(Ellipsis, *tap)] = np.einsum("ngcr,ngor->goc", flat, flat_grads)
    result = result.reshape(g.shape[1], x.shape[1] // groups, *kernel_size)
    return _last(result, channels_last)


def_op(
    "conv", "library", 2, ref=_conv_ref, shape_rule=_conv_rule, attrs=CONV_ATTRS,
    categories="f", doc="convolution (cross-correlation) of [N, C, *S] by [O, C/groups, *K]",
)  # fmt: skip
def_op(
    "conv_data_grad", "library", 2, ref=_data_grad_ref, shape_rule=_data_grad_rule,
    attrs={**CONV_ATTRS, "input_size": ()}, categories="f",
    doc="the input gradient of conv (a transposed convolution)",
)  # fmt: skip
def_op(
    "conv_weight_grad", "library", 2, ref=_weight_grad_ref, shape_rule=_weight_grad_rule,
    attrs={**CONV_ATTRS, "kernel_size": ()}, categories="f",
    doc="the weight gradient of conv",
)  # fmt: skip


# --- backward rules ---------------------------------------------------------------------------


def _build(op_name: str, *inputs, **attrs):
    from flame.tensor import apply_op

    return apply_op(op_name, *inputs, **attrs)


def _common(attrs) -> dict:
    common = {name: attrs.get(name, default) for name, default in CONV_ATTRS.items()}
    if not common["channels_last"]:
        del common["channels_last"]  # the attribute as the front end leaves it: absent
    return common


def _spatial(node, attrs) -> tuple[int, ...]:
    return tuple(channels_first_shape(node.shape, attrs.get("channels_last", False))[2:])


def _dense(F, g, attrs):
    """A channels-last gradient written in its own order before cuDNN reads it: the kernel
    that computes it (or a copy) writes [N, *S, C] memory, instead of cuDNN transposing an
    NCHW value read through a permuted view."""
    return F.copy(g) if attrs.get("channels_last", False) else g


def _conv_vjp(F, g, out, x, w, **attrs):
    common = _common(attrs)
    g = _dense(F, g, attrs)
    data = _build("conv_data_grad", g, w, input_size=_spatial(x, attrs), **common)
    weight = _build("conv_weight_grad", x, g, kernel_size=_spatial(w, attrs), **common)
    return data, weight


def _data_grad_vjp(F, c, out, g, w, **attrs):
    common = _common(attrs)
    c = _dense(F, c, attrs)
    return (
        _build("conv", c, w, **common),
        _build("conv_weight_grad", c, g, kernel_size=_spatial(w, attrs), **common),
    )


def _weight_grad_vjp(F, c, out, x, g, **attrs):
    common = _common(attrs)
    return (
        _build("conv_data_grad", g, c, input_size=_spatial(x, attrs), **common),
        _build("conv", x, c, **common),
    )


def_vjp("conv", _conv_vjp)
def_vjp("conv_data_grad", _data_grad_vjp)
def_vjp("conv_weight_grad", _weight_grad_vjp)
