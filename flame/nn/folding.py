"""``unfold`` (im2col) and ``fold`` (col2im) with PyTorch's signatures, written with public
FLAME ops: every kernel tap is one strided view of the padded input (``kernel_taps``), stacked
for ``unfold``; ``fold`` places each tap's block back, zero-inserted by the stride, and sums
them."""

from __future__ import annotations

from flame.ir.shapes import ShapeError, prod
from flame.joining import pad, stack
from flame.nn.convolution import (
    _batched,
    _non_negative,
    _output_sizes,
    _pad_spatial,
    _positive,
    _unbatched,
    int_tuple,
    kernel_taps,
)
from flame.shaping import checked_tensor, shown, user_errors
from flame.tensor import Tensor
from flame.views import reshape

__all__ = ["fold", "unfold"]


def _window_arguments(op, kernel_size, dilation, padding, stride):
    kernel = int_tuple(kernel_size, 2, op, "kernel_size")
    dilation = int_tuple(dilation, 2, op, "dilation")
    padding = int_tuple(padding, 2, op, "padding")
    stride = int_tuple(stride, 2, op, "stride")
    _positive(kernel, op, "kernel_size")
    _positive(dilation, op, "dilation")
    _positive(stride, op, "stride")
    _non_negative(padding, op, "padding")
    return kernel, dilation, tuple((value, value) for value in padding), stride


@user_errors
def unfold(input: Tensor, kernel_size, dilation=1, padding=0, stride=1) -> Tensor:  # noqa: A002
    """Sliding blocks of input [N, C, H, W] (or [C, H, W]) as columns: [N, C*kH*kW, L], L the
    number of blocks (channel-major, then the kernel taps in row-major order, as PyTorch)."""
    checked_tensor("unfold", input)
    if input.ndim not in (3, 4):
        raise ShapeError(
            f"unfold: expected a 3-d (unbatched) or 4-d (batched) input, got input {shown(input)}"
        )
    kernel, dilation, pairs, stride = _window_arguments(
        "unfold", kernel_size, dilation, padding, stride
    )
    x, unbatched = _batched(input, 2)
    out_sizes = _output_sizes("unfold", input, x.shape[2:], pairs, kernel, dilation, stride)
    taps = kernel_taps(_pad_spatial(x, pairs), kernel, dilation, stride, out_sizes)
    columns = stack(taps, 2) if len(taps) > 1 else taps[0]
    batch, channels = x.shape[0], x.shape[1]
    columns = reshape(columns, (batch, channels * prod(kernel), prod(out_sizes)))
    return _unbatched(columns, unbatched)


@user_errors
def fold(input: Tensor, output_size, kernel_size, dilation=1, padding=0, stride=1) -> Tensor:  # noqa: A002
    """The adjoint of ``unfold``: columns [N, C*kH*kW, L] (or [C*kH*kW, L]) summed back into
    [N, C, H, W] at the blocks they came from (overlaps add up)."""
    checked_tensor("fold", input)
    op = "fold"
    out_size = int_tuple(output_size, 2, op, "output_size")
    kernel, dilation, pairs, stride = _window_arguments(op, kernel_size, dilation, padding, stride)
    if input.ndim not in (2, 3):
        raise ShapeError(
            f"fold: expected a 2-d (unbatched) or 3-d (batched) input, got input {shown(input)}"
        )
    x = input if input.ndim == 3 else reshape(input, (1, *input.shape))
    taps = prod(kernel)
    if x.shape[1] % taps:
        raise ShapeError(
            f"fold: expected size {x.shape[1]} of dim 1 of input {shown(input)} to be divisible "
            f"by the product of kernel_size {list(kernel)} ({taps})"
        )
    padded_size = tuple(size + low + high for size, (low, high) in zip(out_size, pairs))
    blocks = []
    for size, taps_axis, spacing, step in zip(padded_size, kernel, dilation, stride):
        blocks.append((size - spacing * (taps_axis - 1) - 1) // step + 1)
    if any(count <= 0 for count in blocks) or x.shape[2] != prod(blocks):
        raise ShapeError(
            f"fold: expected size {x.shape[2]} of dim 2 of input {shown(input)} to match the "
            f"number of sliding blocks {' * '.join(map(str, blocks))} = {prod(blocks)} "
            f"(output_size {list(out_size)}, kernel_size {list(kernel)})"
        )
    result = _fold(x, out_size, padded_size, kernel, dilation, pairs, stride, tuple(blocks))
    return result if input.ndim == 3 else reshape(result, result.shape[1:])


def _zero_inserted(x: Tensor, stride) -> Tensor:
    """[N, C, H, W] -> [N, C, (H-1)*sh + 1, (W-1)*sw + 1] with sh-1 (sw-1) zeros between
    neighbours: each entry padded into an [sh, sw] block, the trailing zeros cut."""
    if stride == (1, 1):
        return x
    batch, channels, height, width = x.shape
    blocks = reshape(x, (batch, channels, height, 1, width, 1))
    blocks = pad(blocks, (0, stride[1] - 1, 0, 0, 0, stride[0] - 1))
    spread = reshape(blocks, (batch, channels, height * stride[0], width * stride[1]))
    return spread[:, :, : (height - 1) * stride[0] + 1, : (width - 1) * stride[1] + 1]


def _fold(x, out_size, padded_size, kernel, dilation, pairs, stride, blocks) -> Tensor:
    """Each kernel tap's block of values, zero-inserted by the stride and padded to its
    place in the padded output; the taps summed, the padding cut."""
    batch, channels = x.shape[0], x.shape[1] // prod(kernel)
    columns = reshape(x, (batch, channels, prod(kernel), *blocks))
    total = None
    for index in range(prod(kernel)):
        row, col = divmod(index, kernel[1])
        spread = _zero_inserted(columns[:, :, index], stride)
        top, left = row * dilation[0], col * dilation[1]
        placed = _pad_spatial(
            spread,
            (
                (top, padded_size[0] - top - spread.shape[2]),
                (left, padded_size[1] - left - spread.shape[3]),
            ),
        )
        total = placed if total is None else total + placed
    (top, _), (left, _) = pairs
    return total[:, :, top : top + out_size[0], left : left + out_size[1]]
