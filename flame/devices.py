"""Devices, as PyTorch names them: ``x.device``, ``x.to(device)``, ``x.cpu()``, ``x.cuda()``.

FLAME's backends are its devices: ``cuda`` is the GPU, and the NumPy reference backend is
the ``cpu`` device. Moving a tensor between them copies its values (it realizes it first);
moving it to the device it is on returns it as it is.
"""

from __future__ import annotations

import numpy as np

from flame.ir import dtypes
from flame.tensor import Tensor, _cast

_BACKEND_OF = {"cuda": "cuda", "cpu": "reference"}
_TYPE_OF = {"cuda": "cuda", "reference": "cpu"}


class device:  # noqa: N801 (PyTorch's name)
    """``fl.device("cuda")``, ``fl.device("cuda:0")``, ``fl.device("cpu")``."""

    __slots__ = ("type", "index")

    def __init__(self, spec, index: int | None = None):
        if isinstance(spec, device):
            spec, index = spec.type, spec.index
        text = str(spec)
        kind, _, number = text.partition(":")
        if kind not in _BACKEND_OF:
            raise ValueError(f"unknown device {text!r}: FLAME has 'cuda' and 'cpu' (the reference)")
        if number:
            index = int(number)
        if index not in (None, 0):
            raise ValueError(f"device {text!r}: FLAME uses one GPU, cuda:0")
        self.type, self.index = kind, (0 if kind == "cuda" else None)

    @property
    def backend(self) -> str:
        return _BACKEND_OF[self.type]

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __repr__(self) -> str:
        return f"device(type={self.type!r}" + (
            f", index={self.index})" if self.index is not None else ")"
        )

    def __eq__(self, other) -> bool:
        try:
            other = device(other)
        except (TypeError, ValueError):
            return NotImplemented
        return (self.type, self.index) == (other.type, other.index)

    def __hash__(self) -> int:
        return hash((self.type, self.index))


def move(tensor: Tensor, target: device) -> Tensor:
    """``tensor`` on ``target``'s backend (a copy of its values when that is another one)."""
    if target.backend == tensor.backend:
        return tensor
    from flame.backend import backend as use_backend
    from flame.creation import tensor as make_tensor

    values = np.asarray(tensor.numpy())
    with use_backend(target.backend):
        return make_tensor(values, dtype=tensor.dtype)


def _to(self: Tensor, *args, **options):
    """PyTorch's forms: ``to(dtype)``, ``to(device)``, ``to(device, dtype)``, ``to(other)``,
    ``to(dtype=..., device=...)``; ``non_blocking`` is accepted (copies are ordered on
    FLAME's stream anyway) and ``copy=True`` always returns a new tensor."""
    if not options and len(args) == 1 and type(args[0]) is dtypes.DType:
        # the dtype-only form, the fast path: Tensor.to's cast, one frame less to the
        # user's line
        target = args[0]
        return self if target is self.node.dtype else _cast(self, target)
    return _to_general(self, *args, **options)


def _to_general(
    self: Tensor, *args, dtype=None, device=None, non_blocking=False, copy=False, **kwargs
):
    if kwargs:
        raise TypeError(f"to(): unexpected keyword arguments {sorted(kwargs)}")
    for value in args:
        if isinstance(value, Tensor):
            dtype, device = value.dtype, value.device
        elif _is_device(value):
            device = value
        else:
            dtype = value
    result = self
    if device is not None:
        result = move(result, globals()["device"](device))
    if dtype is not None:
        target = dtypes.dtype(dtype)
        if target is not result.dtype:
            from flame.tensor import apply

            result = apply("cast", result, dtype=target)
    if copy and result is self:
        result = self * 1 if not self.dtype.is_bool else self | False
    return result


def _is_device(value) -> bool:
    """A device or a device's name (anything else is read as a dtype, whose error names it)."""
    if isinstance(value, device):
        return True
    return isinstance(value, str) and value.partition(":")[0] in _BACKEND_OF


Tensor.device = property(lambda self: device(_TYPE_OF[self.backend]))
Tensor.to = _to
Tensor.cpu = lambda self: move(self, device("cpu"))
Tensor.cuda = lambda self, device_index=None, non_blocking=False: move(self, device("cuda"))
Tensor.is_cuda = property(lambda self: self.backend == "cuda")
