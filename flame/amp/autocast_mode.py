"""``flame.autocast``: PyTorch's mixed-precision policy, decided when an op is built.

Inside an autocast region, ops on PyTorch's lower-precision list (matmul, linear, conv,
attention) cast their floating inputs to the region's dtype, and ops on its float32 list
(softmax, norms, losses, reductions that accumulate) cast float16/bfloat16 inputs up to
float32. Front-end functions call ``lower_precision`` / ``full_precision`` on their inputs;
outside a region both return the tensors unchanged. The state is a context variable, as the
backend and the matmul precision are: a thread or task that enters a region never changes
what another one builds.
"""

from __future__ import annotations

import contextvars

from flame.ir import dtypes

# (enabled, dtype); None outside every region
_state: contextvars.ContextVar[tuple[bool, dtypes.DType] | None] = contextvars.ContextVar(
    "flame_autocast", default=None
)


def current() -> tuple[bool, dtypes.DType] | None:
    return _state.get()


def active_dtype() -> dtypes.DType | None:
    """The dtype lower-precision ops cast to now, or None when autocast is off."""
    state = _state.get()
    return state[1] if state is not None and state[0] else None


def lower_precision(*tensors):
    """The inputs of a lower-precision op (matmul, linear, conv, attention): floating
    tensors cast to the region's dtype; other values unchanged."""
    target = active_dtype()
    if target is None:
        return tensors
    return tuple(_cast(t, target, lambda d: d.is_float and d is not target) for t in tensors)


def full_precision(*tensors):
    """The inputs of a float32 op (softmax, norms, losses): float16/bfloat16 tensors cast
    to float32; other values unchanged."""
    if active_dtype() is None:
        return tensors
    return tuple(
        _cast(t, dtypes.float32, lambda d: d in (dtypes.float16, dtypes.bfloat16))
        for t in tensors
    )


def _cast(value, target, wanted):
    from flame.tensor import Tensor

    if isinstance(value, Tensor) and wanted(value.dtype):
        return value.to(target)
    return value
