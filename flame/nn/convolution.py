"""``linear``, ``bilinear``, ``conv1d``, ``conv2d``, ``conv_transpose1d`` and
``conv_transpose2d`` with PyTorch's signatures: argument checks and normalization, then the
IR ops of flame/ir/ops/conv.py (``conv``; a transposed convolution is ``conv_data_grad`` of its
input), which cuDNN runs on the GPU. Two choices are FLAME's: float16/bfloat16 2-d
convolutions run channels-last (the input written in that order by the kernel that computes
it, the result handed on as an NCHW-shaped view), and a 1x1 convolution with stride 1, no
padding and one group is one batched matmul on the NCHW memory. ``unfold``/``fold`` live in
folding.py."""

from __future__ import annotations

from flame.amp.autocast_mode import lower_precision
from flame.contraction import einsum
from flame.ir.shapes import ShapeError
from flame.joining import pad
from flame.linalg import matmul
from flame.shaping import checked_tensor, shown, user_errors
from flame.tensor import Tensor, apply_op
from flame.views import permute, reshape, transpose

__all__ = [
    "bilinear", "conv1d", "conv2d", "conv_transpose1d", "conv_transpose2d", "linear",
]  # fmt: skip


# --- arguments ---------------------------------------------------------------------------------


def int_tuple(value, count: int, op: str, name: str) -> tuple[int, ...]:
    """An int or a sequence of ``count`` ints (or of one, repeated), as PyTorch's ``_pair``."""
    if isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be an int or a tuple of {count} ints, got {value!r}")
    if hasattr(value, "__index__"):
        return (value.__index__(),) * count
    try:
        values = tuple(item.__index__() for item in value)
    except (TypeError, AttributeError):
        raise TypeError(
            f"{op}: {name} must be an int or a tuple of {count} ints, got {value!r}"
        ) from None
    if len(values) == 1:
        return values * count
    if len(values) != count:
        raise ValueError(
            f"{op}: expected {name} to be a single integer value or a list of {count} values, "
            f"got {name}={list(values)}"
        )
    return values


def _positive(values: tuple[int, ...], op: str, name: str) -> None:
    if any(value <= 0 for value in values):
        raise ValueError(f"{op}: {name} must be positive, got {list(values)}")


def _non_negative(values: tuple[int, ...], op: str, name: str) -> None:
    if any(value < 0 for value in values):
        raise ValueError(f"{op}: negative {name} is not supported, got {list(values)}")


def _groups(groups, op: str) -> int:
    if isinstance(groups, bool) or not hasattr(groups, "__index__") or groups.__index__() <= 0:
        raise ValueError(f"{op}: groups must be a positive integer, got {groups!r}")
    return groups.__index__()


def _check_rank(op: str, input: Tensor, weight: Tensor, spatial: int) -> None:  # noqa: A002
    if input.ndim not in (spatial + 1, spatial + 2):
        raise ShapeError(
            f"{op}: expected a {spatial + 1}-d (unbatched) or {spatial + 2}-d (batched) input, "
            f"got input {shown(input)}"
        )
    if weight.ndim != spatial + 2:
        raise ShapeError(
            f"{op}: expected a {spatial + 2}-d weight, got weight {shown(weight)} "
            f"(input {shown(input)})"
        )


def _check_bias(op: str, bias, channels: int) -> None:
    if bias is not None and (bias.ndim != 1 or bias.shape[0] != channels):
        raise ShapeError(
            f"{op}: bias must be 1-d with {channels} entries (the output channels), "
            f"got bias {shown(bias)}"
        )


def _same_padding(op: str, kernel, dilation, stride) -> tuple[tuple[int, int], ...]:
    if any(step != 1 for step in stride):
        raise ValueError(f"{op}: padding='same' is not supported for strided convolutions")
    pairs = []
    for size, spacing in zip(kernel, dilation):
        total = spacing * (size - 1)
        pairs.append((total // 2, total - total // 2))  # the odd one out goes after, as PyTorch
    return tuple(pairs)


def _padding_pairs(op: str, padding, kernel, dilation, stride) -> tuple[tuple[int, int], ...]:
    """(before, after) per spatial dim, from an int, a tuple, ``'same'`` or ``'valid'``."""
    if isinstance(padding, str):
        if padding == "valid":
            return ((0, 0),) * len(kernel)
        if padding == "same":
            return _same_padding(op, kernel, dilation, stride)
        raise ValueError(
            f"{op}: padding must be 'same', 'valid', an int or a tuple, got {padding!r}"
        )
    values = int_tuple(padding, len(kernel), op, "padding")
    _non_negative(values, op, "padding")
    return tuple((value, value) for value in values)


def _output_sizes(op, input: Tensor, sizes, pairs, kernel, dilation, stride) -> tuple[int, ...]:  # noqa: A002
    result = []
    for size, (low, high), taps, spacing, step in zip(sizes, pairs, kernel, dilation, stride):
        reach = spacing * (taps - 1) + 1
        if size + low + high < reach:
            raise ShapeError(
                f"{op}: input {shown(input)} padded by {low}+{high} is smaller than the "
                f"kernel's reach {reach} (kernel {taps}, dilation {spacing})"
            )
        result.append((size + low + high - reach) // step + 1)
    return tuple(result)


# --- im2col ------------------------------------------------------------------------------------


def kernel_taps(padded: Tensor, kernel, dilation, stride, out_sizes) -> list[Tensor]:
    """One strided view of ``padded`` [N, C, H, W] per kernel tap, each [N, C, Ho, Wo]: tap
    (i, j) of output (y, x) reads ``padded[..., y*sh + i*dh, x*sw + j*dw]``."""
    taps = []
    for row in range(kernel[0]):
        for col in range(kernel[1]):
            top, left = row * dilation[0], col * dilation[1]
            bottom = top + stride[0] * (out_sizes[0] - 1) + 1
            right = left + stride[1] * (out_sizes[1] - 1) + 1
            taps.append(padded[:, :, top : bottom : stride[0], left : right : stride[1]])
    return taps


def _pad_spatial(x: Tensor, pairs, value: float = 0.0) -> Tensor:
    widths = [width for pair in reversed(pairs) for width in pair]  # F.pad: last dim first
    if not any(widths):
        return x
    return pad(x, widths, value=value)


def _channels_last(x: Tensor) -> bool:
    """FLAME's layout choice: 16-bit 2-d convolutions run on channels-last memory."""
    from flame.backends import cudnn

    return cudnn.channels_last and x.ndim == 4 and x.dtype.name in ("float16", "bfloat16")


def _to_channels_last(x: Tensor) -> Tensor:
    """x [N, C, H, W] as a channels-last value [N, H, W, C] with memory of its own: the
    kernel computing x writes it in that order (the permute folds into its index map). A
    weight [O, C, kH, kW] becomes the filter [O, kH, kW, C] the same way."""
    return permute(x, (0, 2, 3, 1)).clone()


def _conv(op: str, x: Tensor, weight: Tensor, bias, stride, pairs, dilation, groups: int):
    """The ``conv`` op over a batched ``x`` (arguments checked and normalized), plus bias;
    ``op`` names the user's function in errors. The result is NCHW to the caller whatever
    layout the op computes in (a channels-last result is seen through a permuted view)."""
    _output_sizes(op, x, x.shape[2:], pairs, weight.shape[2:], dilation, stride)
    attrs = {
        "stride": tuple(stride), "padding": tuple(pairs), "dilation": tuple(dilation),
        "groups": groups,
    }  # fmt: skip
    pointwise = set(weight.shape[2:]) == {1} and set(stride) == {1} and groups == 1
    if pointwise and not any(before or after for before, after in pairs):
        # a 1x1 convolution is one batched GEMM on NCHW memory (cuBLAS), no layout change:
        # [O, C] @ [N, C, H*W] -> [N, O, H*W]
        batch, channels = x.shape[:2]
        columns = reshape(x, (batch, channels, -1))
        result = matmul(reshape(weight, (weight.shape[0], channels)), columns)
        result = reshape(result, (batch, weight.shape[0], *x.shape[2:]))
    elif _channels_last(x):
        result = apply_op(
            "conv", _to_channels_last(x), _to_channels_last(weight), channels_last=True, **attrs
        )
        result = permute(result, (0, 3, 1, 2))
    else:
        result = apply_op("conv", x, weight, **attrs)
    if bias is not None:
        result = result + reshape(bias, (bias.shape[0],) + (1,) * (x.ndim - 2))
    return result


def _batched(input: Tensor, spatial: int) -> tuple[Tensor, bool]:  # noqa: A002
    if input.ndim == spatial + 1:
        return reshape(input, (1, *input.shape)), True
    return input, False


def _unbatched(result: Tensor, unbatched: bool) -> Tensor:
    return reshape(result, result.shape[1:]) if unbatched else result


# --- linear ------------------------------------------------------------------------------------


@user_errors
def linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:  # noqa: A002
    """``input @ weight.T + bias``: input [*, in_features], weight [out_features, in_features]
    (or [in_features]), bias [out_features]."""
    checked_tensor("linear", input)
    checked_tensor("linear", weight)
    input, weight, bias = lower_precision(input, weight, bias)
    if weight.ndim not in (1, 2):
        raise ShapeError(f"linear: weight must be 1-d or 2-d, got weight {shown(weight)}")
    if input.ndim == 0 or input.shape[-1] != weight.shape[-1]:
        raise ShapeError(
            f"linear: input {shown(input)} has {input.shape[-1] if input.ndim else 0} features "
            f"in its last dim, weight {shown(weight)} expects {weight.shape[-1]}"
        )
    result = matmul(input, transpose(weight, 0, 1) if weight.ndim == 2 else weight)
    return result if bias is None else result + bias


@user_errors
def bilinear(input1: Tensor, input2: Tensor, weight: Tensor, bias: Tensor | None = None):
    """``out[..., o] = sum_ij input1[..., i] weight[o, i, j] input2[..., j] + bias[o]``."""
    checked_tensor("bilinear", input1)
    checked_tensor("bilinear", input2)
    input1, input2, weight, bias = lower_precision(input1, input2, weight, bias)
    if (
        weight.ndim != 3
        or input1.shape[:-1] != input2.shape[:-1]
        or input1.shape[-1:] != weight.shape[1:2]
        or input2.shape[-1:] != weight.shape[2:3]
    ):
        raise ShapeError(
            f"bilinear: input1 {shown(input1)} and input2 {shown(input2)} must share their "
            f"leading dims and match weight {shown(weight)} [out, in1, in2]"
        )
    lead = input1.shape[:-1]
    left = reshape(input1, (-1, input1.shape[-1]))
    right = reshape(input2, (-1, input2.shape[-1]))
    result = einsum("bi,oij,bj->bo", left, weight, right)
    result = reshape(result, (*lead, weight.shape[0]))
    return result if bias is None else result + bias


# --- convolution -------------------------------------------------------------------------------


def _check_conv(op: str, input, weight, bias, groups: int, spatial: int) -> None:  # noqa: A002
    checked_tensor(op, input)
    checked_tensor(op, weight)
    _check_rank(op, input, weight, spatial)
    out_channels, channels = weight.shape[0], input.shape[-spatial - 1]
    if out_channels % groups:
        raise ValueError(
            f"{op}: out_channels {out_channels} of weight {shown(weight)} is not divisible by "
            f"groups={groups}"
        )
    if channels % groups or channels != weight.shape[1] * groups:
        raise ShapeError(
            f"{op}: input {shown(input)} has {channels} channels, but weight {shown(weight)} "
            f"with groups={groups} expects {weight.shape[1] * groups}"
        )
    _check_bias(op, bias, out_channels)


@user_errors
def conv2d(
    input: Tensor,  # noqa: A002 (PyTorch's name)
    weight: Tensor,
    bias: Tensor | None = None,
    stride=1,
    padding=0,
    dilation=1,
    groups: int = 1,
) -> Tensor:
    """2-d convolution (cross-correlation, as PyTorch's) of input [N, C, H, W] (or [C, H, W])
    with weight [out, C/groups, kH, kW]; padding an int, a pair, ``'same'`` or ``'valid'``."""
    groups = _groups(groups, "conv2d")
    _check_conv("conv2d", input, weight, bias, groups, 2)
    input, weight, bias = lower_precision(input, weight, bias)
    stride = int_tuple(stride, 2, "conv2d", "stride")
    dilation = int_tuple(dilation, 2, "conv2d", "dilation")
    _positive(stride, "conv2d", "stride")
    _positive(dilation, "conv2d", "dilation")
    pairs = _padding_pairs("conv2d", padding, weight.shape[2:], dilation, stride)
    x, unbatched = _batched(input, 2)
    return _unbatched(_conv("conv2d", x, weight, bias, stride, pairs, dilation, groups), unbatched)


@user_errors
def conv1d(
    input: Tensor,  # noqa: A002
    weight: Tensor,
    bias: Tensor | None = None,
    stride=1,
    padding=0,
    dilation=1,
    groups: int = 1,
) -> Tensor:
    """1-d convolution of input [N, C, L] (or [C, L]) with weight [out, C/groups, k]: conv2d
    with a unit height."""
    groups = _groups(groups, "conv1d")
    _check_conv("conv1d", input, weight, bias, groups, 1)
    input, weight, bias = lower_precision(input, weight, bias)
    (stride,) = int_tuple(stride, 1, "conv1d", "stride")
    (dilation,) = int_tuple(dilation, 1, "conv1d", "dilation")
    _positive((stride, dilation), "conv1d", "stride and dilation")
    pairs = _padding_pairs("conv1d", padding, weight.shape[2:], (dilation,), (stride,))
    x, unbatched = _batched(input, 1)
    result = _conv("conv1d", x, weight, bias, (stride,), pairs, (dilation,), groups)
    return _unbatched(result, unbatched)


# --- transposed convolution --------------------------------------------------------------------


def _conv_transpose(x, weight, bias, stride, padding, output_padding, groups, dilation):
    """The transposed convolution of a batched ``x`` (arguments checked and normalized): the
    input gradient of the convolution whose weight is ``weight`` [in, out/groups, *k], i.e.
    one ``conv_data_grad``. ``output_padding`` extends the result at the end; the padding
    pair says where its rows sit (after ``padding`` rows cut at the start)."""
    sizes, pairs = [], []
    for size, taps, step, spacing, low, extra in zip(
        x.shape[2:], weight.shape[2:], stride, dilation, padding, output_padding
    ):
        sizes.append((size - 1) * step - 2 * low + spacing * (taps - 1) + extra + 1)
        if extra < step:
            pairs.append((low, low))
        elif extra <= low:
            pairs.append((low, low - extra))
        else:
            raise ValueError(
                f"conv_transpose: output_padding {extra} >= stride {step} needs padding >= "
                f"output_padding, got padding {low}"
            )
    attrs = {
        "stride": tuple(stride), "padding": tuple(pairs), "dilation": tuple(dilation),
        "groups": groups, "input_size": tuple(sizes),
    }  # fmt: skip
    if _channels_last(x):
        result = apply_op(
            "conv_data_grad", _to_channels_last(x), _to_channels_last(weight),
            channels_last=True, **attrs,
        )  # fmt: skip
        result = permute(result, (0, 3, 1, 2))
    else:
        result = apply_op("conv_data_grad", x, weight, **attrs)
    if bias is not None:
        result = result + reshape(bias, (bias.shape[0],) + (1,) * (x.ndim - 2))
    return result


def _check_conv_transpose(op: str, input, weight, bias, groups: int, spatial: int) -> None:  # noqa: A002
    checked_tensor(op, input)
    checked_tensor(op, weight)
    _check_rank(op, input, weight, spatial)
    channels = input.shape[-spatial - 1]
    if weight.shape[0] % groups:
        raise ValueError(
            f"{op}: in_channels {weight.shape[0]} of weight {shown(weight)} is not divisible "
            f"by groups={groups}"
        )
    if channels != weight.shape[0]:
        raise ShapeError(
            f"{op}: input {shown(input)} has {channels} channels, but weight {shown(weight)} "
            f"[in, out/groups, ...] expects {weight.shape[0]}"
        )
    _check_bias(op, bias, weight.shape[1] * groups)


def _transpose_arguments(op, spatial, stride, padding, output_padding, dilation):
    stride = int_tuple(stride, spatial, op, "stride")
    padding = int_tuple(padding, spatial, op, "padding")
    output_padding = int_tuple(output_padding, spatial, op, "output_padding")
    dilation = int_tuple(dilation, spatial, op, "dilation")
    _positive(stride, op, "stride")
    _positive(dilation, op, "dilation")
    _non_negative(padding, op, "padding")
    _non_negative(output_padding, op, "output_padding")
    for extra, step, spacing in zip(output_padding, stride, dilation):
        if extra >= step and extra >= spacing:
            raise ValueError(
                f"{op}: output padding must be smaller than either stride or dilation, got "
                f"output_padding={list(output_padding)}, stride={list(stride)}, "
                f"dilation={list(dilation)}"
            )
    return stride, padding, output_padding, dilation


def _check_transposed_size(op, input, weight, stride, padding, output_padding, dilation):  # noqa: A002
    spatial = len(stride)
    for axis in range(spatial):
        size = input.shape[input.ndim - spatial + axis]
        reach = dilation[axis] * (weight.shape[2 + axis] - 1)
        out = (size - 1) * stride[axis] - 2 * padding[axis] + reach + output_padding[axis] + 1
        if out <= 0:
            raise ShapeError(
                f"{op}: input {shown(input)} with weight {shown(weight)}, stride "
                f"{list(stride)} and padding {list(padding)} gives an empty output"
            )


@user_errors
def conv_transpose2d(
    input: Tensor,  # noqa: A002
    weight: Tensor,
    bias: Tensor | None = None,
    stride=1,
    padding=0,
    output_padding=0,
    groups: int = 1,
    dilation=1,
) -> Tensor:
    """The transposed 2-d convolution (the gradient of conv2d with respect to its input):
    input [N, C, H, W] (or [C, H, W]), weight [C, out/groups, kH, kW]; the output's height is
    ``(H-1)*stride - 2*padding + dilation*(kH-1) + output_padding + 1``."""
    op = "conv_transpose2d"
    groups = _groups(groups, op)
    _check_conv_transpose(op, input, weight, bias, groups, 2)
    input, weight, bias = lower_precision(input, weight, bias)
    arguments = _transpose_arguments(op, 2, stride, padding, output_padding, dilation)
    _check_transposed_size(op, input, weight, *arguments)
    stride, padding, output_padding, dilation = arguments
    x, unbatched = _batched(input, 2)
    result = _conv_transpose(x, weight, bias, stride, padding, output_padding, groups, dilation)
    return _unbatched(result, unbatched)


@user_errors
def conv_transpose1d(
    input: Tensor,  # noqa: A002
    weight: Tensor,
    bias: Tensor | None = None,
    stride=1,
    padding=0,
    output_padding=0,
    groups: int = 1,
    dilation=1,
) -> Tensor:
    """The transposed 1-d convolution: conv_transpose2d with a unit height."""
    op = "conv_transpose1d"
    groups = _groups(groups, op)
    _check_conv_transpose(op, input, weight, bias, groups, 1)
    input, weight, bias = lower_precision(input, weight, bias)
    arguments = _transpose_arguments(op, 1, stride, padding, output_padding, dilation)
    _check_transposed_size(op, input, weight, *arguments)
    x, unbatched = _batched(input, 1)
    result = _conv_transpose(x, weight, bias, *arguments[:3], groups, arguments[3])
    return _unbatched(result, unbatched)
