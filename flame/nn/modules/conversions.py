"""``nn.Module``'s dtype and device conversions (``to``, ``half``, ``bfloat16``, ``float``,
``double``, ``cuda``, ``cpu``, ``type``), as a base class of ``Module``: every parameter and
buffer (and gradient) gets new memory in the new dtype or device while the tensors keep their
identity, as in PyTorch.

Where FLAME differs: new memory means a compiled function that closed over the old parameters
must be traced again (pass the module to a new ``flame.compile``); ``load_state_dict`` writes
into the existing memory and needs nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flame.ir import dtypes
from flame.tensor import Tensor

if TYPE_CHECKING:
    from flame.nn.modules.module import Module


class Conversions:
    def _apply(self, fn, floating_only: bool = True) -> Module:
        """``param.data = fn(param)`` for every parameter and buffer (and their gradients):
        the tensors keep their identity (an optimizer built before still holds them)."""
        from flame.autograd import no_grad

        with no_grad():
            for module in self.modules():
                for param in module._parameters.values():
                    if param is None or (floating_only and not param.dtype.is_float):
                        continue
                    param.data = fn(param.data)
                    if param.grad is not None:
                        param.grad = fn(param.grad).realize()
                for name, buffer in module._buffers.items():
                    if buffer is None or (floating_only and not buffer.dtype.is_float):
                        continue
                    module._buffers[name] = fn(buffer).realize()
        return self

    def to(self, *args, **kwargs) -> Module:
        """``to(dtype)``, ``to(device)``, ``to(device, dtype)``, ``to(tensor)``; a dtype
        applies to floating parameters and buffers only, as PyTorch's."""
        dtype, device = _parse_to(*args, **kwargs)
        if dtype is not None and not dtype.is_float:
            raise TypeError(
                f"nn.Module.to only accepts floating point dtypes, but got desired dtype={dtype}"
            )

        def convert(tensor: Tensor) -> Tensor:
            moved = tensor if device is None else tensor.to(device)
            if dtype is not None and tensor.dtype.is_float and moved.dtype is not dtype:
                moved = moved.to(dtype)
            return moved

        return self._apply(convert, floating_only=False)

    def _cast(self, dtype) -> Module:
        return self._apply(lambda t: t.to(dtype) if t.dtype is not dtype else t)

    def half(self) -> Module:
        return self._cast(dtypes.float16)

    def bfloat16(self) -> Module:
        return self._cast(dtypes.bfloat16)

    def float(self) -> Module:  # noqa: A003
        return self._cast(dtypes.float32)

    def double(self) -> Module:
        return self._cast(dtypes.float64)

    def cuda(self, device=None) -> Module:
        return self.to("cuda")

    def cpu(self) -> Module:
        return self.to("cpu")

    def type(self, dst_type) -> Module:  # noqa: A003
        return self._apply(lambda t: t.to(dst_type), floating_only=False)


def _parse_to(*args, dtype=None, device=None, non_blocking=False, copy=False, memory_format=None):
    from flame.devices import _is_device

    for value in args:
        if isinstance(value, Tensor):
            dtype, device = value.dtype, value.device
        elif _is_device(value):
            device = value
        elif value is not None:
            dtype = value
    if dtype is not None:
        dtype = dtypes.dtype(dtype)
    return dtype, device
