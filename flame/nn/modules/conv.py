"""``Conv1d``, ``Conv2d``, ``ConvTranspose1d`` and ``ConvTranspose2d``, as PyTorch's: the same
constructor arguments and checks, attributes (``kernel_size``, ``stride``, ... as tuples),
``state_dict`` keys and shapes, default initialisation and ``repr``.

``padding_mode`` ``'reflect'``, ``'replicate'`` and ``'circular'`` pad the input with
``F.pad`` first and convolve without padding, as PyTorch does; transposed convolutions take
``'zeros'`` only (PyTorch's rule).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat

from flame.nn.convolution import conv1d, conv2d, conv_transpose1d, conv_transpose2d
from flame.nn.functional import pad
from flame.nn.modules.linear import empty_parameter, reset_fan_in_uniform
from flame.nn.modules.module import Module
from flame.tensor import Tensor

__all__ = ["Conv1d", "Conv2d", "ConvTranspose1d", "ConvTranspose2d"]

_PADDING_STRINGS = {"same", "valid"}
_PADDING_MODES = {"zeros", "reflect", "replicate", "circular"}


def _ntuple(count: int, name: str):
    """PyTorch's ``_single``/``_pair``: an iterable as a tuple, anything else repeated."""

    def parse(value):
        if isinstance(value, Iterable):
            return tuple(value)
        return tuple(repeat(value, count))

    parse.__name__ = name
    return parse


_single = _ntuple(1, "_single")
_pair = _ntuple(2, "_pair")


def _reverse_repeat_tuple(values, times: int) -> tuple:
    """``(1, 2)`` -> ``(2, 2, 1, 1)``: per-dim padding in ``F.pad``'s order (last dim first)."""
    return tuple(value for value in reversed(values) for _ in range(times))


class _ConvNd(Module):
    """What the convolutions share: checks, parameters, initialisation, ``repr``, and the
    forward of the plain ones (``_convolve``: their functional op)."""

    _convolve = None

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # noqa: A002
        padding = self.padding
        if self.padding_mode != "zeros":
            input = pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = (0,) * len(self.kernel_size)
        return self._convolve(input, weight, bias, self.stride, padding, self.dilation, self.groups)

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return self._conv_forward(input, self.weight, self.bias)

    __constants__ = [
        "stride", "padding", "dilation", "groups", "padding_mode", "output_padding",
        "in_channels", "out_channels", "kernel_size",
    ]  # fmt: skip

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: tuple,
        stride: tuple,
        padding,
        dilation: tuple,
        transposed: bool,
        output_padding: tuple,
        groups: int,
        bias: bool,
        padding_mode: str,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if groups <= 0:
            raise ValueError("groups must be a positive integer")
        if in_channels % groups != 0:
            raise ValueError("in_channels must be divisible by groups")
        if out_channels % groups != 0:
            raise ValueError("out_channels must be divisible by groups")
        if isinstance(padding, str):
            if padding not in _PADDING_STRINGS:
                raise ValueError(
                    f"Invalid padding string {padding!r}, should be one of {_PADDING_STRINGS}"
                )
            if padding == "same" and any(step != 1 for step in stride):
                raise ValueError("padding='same' is not supported for strided convolutions")
        if padding_mode not in _PADDING_MODES:
            raise ValueError(
                f"padding_mode must be one of {_PADDING_MODES}, but got "
                f"padding_mode='{padding_mode}'"
            )
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = kernel_size
        self.stride = stride
        self.padding = padding
        self.dilation = dilation
        self.transposed = transposed
        self.output_padding = output_padding
        self.groups = groups
        self.padding_mode = padding_mode
        self._reversed_padding_repeated_twice = _pad_widths(padding, kernel_size, dilation)
        if transposed:
            shape = (in_channels, out_channels // groups, *kernel_size)
        else:
            shape = (out_channels, in_channels // groups, *kernel_size)
        self.weight = empty_parameter(shape, device, dtype)
        if bias:
            self.bias = empty_parameter((out_channels,), device, dtype)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        reset_fan_in_uniform(self.weight, self.bias)

    def extra_repr(self) -> str:
        text = "{in_channels}, {out_channels}, kernel_size={kernel_size}, stride={stride}"
        if self.padding != (0,) * len(self.padding):
            text += ", padding={padding}"
        if self.dilation != (1,) * len(self.dilation):
            text += ", dilation={dilation}"
        if self.output_padding != (0,) * len(self.output_padding):
            text += ", output_padding={output_padding}"
        if self.groups != 1:
            text += ", groups={groups}"
        if self.bias is None:
            text += ", bias=False"
        if self.padding_mode != "zeros":
            text += ", padding_mode={padding_mode}"
        return text.format(**self.__dict__)


def _pad_widths(padding, kernel_size: tuple, dilation: tuple) -> list:
    """The widths ``F.pad`` takes for a non-zero ``padding_mode`` (last dim first); for
    ``'same'`` the odd one out goes after, as PyTorch."""
    if not isinstance(padding, str):
        return list(_reverse_repeat_tuple(padding, 2))
    widths = [0, 0] * len(kernel_size)
    if padding == "same":
        axes = range(len(kernel_size) - 1, -1, -1)
        for spacing, size, axis in zip(dilation, kernel_size, axes):
            total = spacing * (size - 1)
            widths[2 * axis] = total // 2
            widths[2 * axis + 1] = total - total // 2
    return widths


class Conv1d(_ConvNd):
    """1-d convolution: input [N, C_in, L] (or [C_in, L]), weight [C_out, C_in/groups, k]."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
    ):
        padding = padding if isinstance(padding, str) else _single(padding)
        super().__init__(
            in_channels, out_channels, _single(kernel_size), _single(stride), padding,
            _single(dilation), False, _single(0), groups, bias, padding_mode, device, dtype,
        )  # fmt: skip

    _convolve = staticmethod(conv1d)


class Conv2d(_ConvNd):
    """2-d convolution: input [N, C_in, H, W] (or [C_in, H, W]), weight
    [C_out, C_in/groups, kH, kW]."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
    ):
        padding = padding if isinstance(padding, str) else _pair(padding)
        super().__init__(
            in_channels, out_channels, _pair(kernel_size), _pair(stride), padding,
            _pair(dilation), False, _pair(0), groups, bias, padding_mode, device, dtype,
        )  # fmt: skip

    _convolve = staticmethod(conv2d)


class _ConvTransposeNd(_ConvNd):
    """What the transposed convolutions share: ``padding_mode='zeros'`` only, and the
    ``output_size=`` argument of ``forward``."""

    def __init__(self, in_channels, out_channels, kernel_size, stride, padding, dilation,
                 output_padding, groups, bias, padding_mode, device=None, dtype=None):  # fmt: skip
        if padding_mode != "zeros":
            raise ValueError(f'Only "zeros" padding mode is supported for {type(self).__name__}')
        if isinstance(padding, str) or any(isinstance(value, str) for value in padding):
            raise ValueError(
                f"{type(self).__name__}: padding must be an int or a tuple of ints, got "
                f"{padding!r} ('same' and 'valid' are for the convolutions only)"
            )
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation, True,
            output_padding, groups, bias, padding_mode, device, dtype,
        )  # fmt: skip

    def _output_padding(self, input: Tensor, output_size, spatial: int) -> tuple:  # noqa: A002
        """``output_padding``, or the one that gives ``output_size`` (PyTorch's rule: the
        size must lie in [min, min + stride - 1] per dim, min the size with none)."""
        if output_size is None:
            return _single(self.output_padding)
        leading = 2 if input.ndim == spatial + 2 else 1
        output_size = list(output_size)
        if len(output_size) == leading + spatial:
            output_size = output_size[leading:]
        if len(output_size) != spatial:
            raise ValueError(
                f"ConvTranspose{spatial}D: for {input.ndim}D input, output_size must have "
                f"{spatial} or {leading + spatial} elements (got {len(output_size)})"
            )
        min_sizes, max_sizes = [], []
        for axis in range(spatial):
            reach = self.dilation[axis] * (self.kernel_size[axis] - 1)
            size = input.shape[axis + leading]
            smallest = (size - 1) * self.stride[axis] - 2 * self.padding[axis] + reach + 1
            min_sizes.append(smallest)
            max_sizes.append(smallest + self.stride[axis] - 1)
        for size, smallest, largest in zip(output_size, min_sizes, max_sizes):
            if size < smallest or size > largest:
                raise ValueError(
                    f"requested an output size of {output_size}, but valid sizes range from "
                    f"{min_sizes} to {max_sizes} (for an input of {list(input.shape[2:])})"
                )
        return tuple(size - smallest for size, smallest in zip(output_size, min_sizes))

    def forward(self, input: Tensor, output_size=None) -> Tensor:  # noqa: A002
        output_padding = self._output_padding(input, output_size, len(self.kernel_size))
        return self._convolve(
            input, self.weight, self.bias, self.stride, self.padding, output_padding,
            self.groups, self.dilation,
        )  # fmt: skip


class ConvTranspose1d(_ConvTransposeNd):
    """Transposed 1-d convolution: input [N, C_in, L] (or [C_in, L]), weight
    [C_in, C_out/groups, k]."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        output_padding=0,
        groups: int = 1,
        bias: bool = True,
        dilation=1,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
    ):
        padding = padding if isinstance(padding, str) else _single(padding)
        super().__init__(
            in_channels, out_channels, _single(kernel_size), _single(stride), padding,
            _single(dilation), _single(output_padding), groups, bias, padding_mode, device,
            dtype,
        )  # fmt: skip

    _convolve = staticmethod(conv_transpose1d)


class ConvTranspose2d(_ConvTransposeNd):
    """Transposed 2-d convolution: input [N, C_in, H, W] (or [C_in, H, W]), weight
    [C_in, C_out/groups, kH, kW]."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        output_padding=0,
        groups: int = 1,
        bias: bool = True,
        dilation=1,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
    ):
        padding = padding if isinstance(padding, str) else _pair(padding)
        super().__init__(
            in_channels, out_channels, _pair(kernel_size), _pair(stride), padding,
            _pair(dilation), _pair(output_padding), groups, bias, padding_mode, device, dtype,
        )  # fmt: skip

    _convolve = staticmethod(conv_transpose2d)
