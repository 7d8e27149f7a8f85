"""``flame.autocast``: PyTorch's mixed-precision policy, decided when an op is built.

Inside an autocast region, ops on PyTorch's lower-precision list (matmul, linear, conv,
attention) cast their floating inputs to the region's dtype, and ops on its float32 list
(softmax, norms, losses, reductions that accumulate) cast float16/bfloat16 inputs up to
float32. Front-end functions call ``lower_precision`` / ``full_precision`` on their inputs;
outside a region both return the tensors unchanged. The state is a context variable, as the
backend and the matmul precision are: a thread or task that enters a region never changes
what another one builds.

Two context variables: ``_region`` holds the innermost region as the user wrote it
(enabled, dtype, device type) and the dtype of each device type then, for
``get_autocast_dtype``;
``_active`` holds only what the ops act on -- the dtype lower-precision ops cast to, None
when autocast is off -- so ``flame.compile`` keys its programs by it with no Python frame
(``key``: the variable's own getter) and a disabled region keys like no region at all.

One policy for every backend: PyTorch keeps a state per device type (``"cuda"``, ``"cpu"``);
FLAME keeps one, and ``device_type`` only picks the default dtype (float16 for ``"cuda"``,
bfloat16 for ``"cpu"``, as PyTorch; inside a region of that device type, the region's). A
region opened with either applies to FLAME ops on either backend (``"reference"`` or
``"cuda"``), and ``is_autocast_enabled`` answers the same for both.
"""

from __future__ import annotations

import contextvars
import functools

from flame.ir import dtypes

DEVICE_TYPES = ("cuda", "cpu")
DEFAULT_DTYPES = {"cuda": dtypes.float16, "cpu": dtypes.bfloat16}  # PyTorch's defaults
LOWER_DTYPES = (dtypes.float16, dtypes.bfloat16)
_ELIGIBLE = (dtypes.float32, *LOWER_DTYPES)  # float64 runs in float64, as in PyTorch

# (enabled, dtype, device_type, {device type: dtype}) of the innermost region; None outside
# every region
_region: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "flame_autocast", default=None
)
# the dtype lower-precision ops cast to now; None when autocast is off
_active: contextvars.ContextVar[dtypes.DType | None] = contextvars.ContextVar(
    "flame_autocast_dtype", default=None
)

# ``key() -> DType | None``: the part of the autocast state that changes what ops build; the
# context variable's own getter (``flame.compile`` asks for it on every call)
key = _active.get


def current() -> tuple[bool, dtypes.DType, str] | None:
    """The innermost region (enabled, dtype, device type), or None outside every region."""
    region = _region.get()
    return None if region is None else region[:3]


def active_dtype() -> dtypes.DType | None:
    """The dtype lower-precision ops cast to now, or None when autocast is off."""
    return _active.get()


def is_autocast_enabled(device_type: str | None = None) -> bool:
    """Whether ops built now are autocast (``device_type``, as PyTorch's optional argument,
    is checked and otherwise ignored: FLAME has one policy for every backend)."""
    if device_type is not None:
        _device_type(device_type)
    return _active.get() is not None


def get_autocast_dtype(device_type: str = "cuda") -> dtypes.DType:
    """The dtype of the innermost region of ``device_type`` (enabled or not, as PyTorch),
    else its default: float16 for ``"cuda"``, bfloat16 for ``"cpu"``."""
    device_type = _device_type(device_type)
    region = _region.get()
    return region[3][device_type] if region is not None else DEFAULT_DTYPES[device_type]


def _device_type(device_type) -> str:
    name = getattr(device_type, "type", device_type)  # a flame/torch device object
    if not isinstance(name, str) or name.split(":")[0] not in DEVICE_TYPES:
        raise ValueError(
            f"autocast: device_type must be one of {DEVICE_TYPES}, got {device_type!r}"
        )
    return name.split(":")[0]


class autocast:  # noqa: N801 (PyTorch's spelling)
    """``with flame.autocast(dtype=flame.bfloat16): ...`` or ``@flame.autocast()``.

    PyTorch's ``torch.autocast``: ops on the lower-precision list (matmul, bmm, einsum,
    linear, conv, attention) run in ``dtype``; ops on the float32 list (softmax,
    log_softmax, layer/group/rms norm, the losses, sum, prod, cumsum, cumprod) run in
    float32. Regions nest: an inner region overrides the outer one, ``enabled=False``
    turns autocast off inside it. ``dtype`` defaults to float16 for ``"cuda"`` and bfloat16
    for ``"cpu"``; other dtypes are refused. ``cache_enabled`` is accepted and ignored: a
    weight's cast is a node of the graph, and common-subexpression elimination already
    makes one cast of a weight read several times in a region. Without ``dtype``, the
    dtype is ``get_autocast_dtype(device_type)`` when the object is made, as PyTorch's.

    Wrap the forward pass and the loss only, as PyTorch advises: a backward built inside a
    region (``loss.backward()`` or ``value_and_grad`` within it) also sends its float32-list
    ops (the sums that undo broadcasting) through float32; its gradients keep the dtypes of
    the values they belong to.
    """

    def __init__(self, device_type: str = "cuda", dtype=None, enabled: bool = True,
                 cache_enabled: bool | None = None):  # fmt: skip
        self.device = _device_type(device_type)
        if not isinstance(enabled, bool):
            raise TypeError(f"autocast: enabled must be a bool, got {type(enabled).__name__}")
        fast = get_autocast_dtype(self.device) if dtype is None else dtypes.dtype(dtype)
        if fast not in LOWER_DTYPES:
            raise ValueError(
                f"autocast: dtype must be float16 or bfloat16, got {fast.name} (float32 "
                "everywhere is autocast(enabled=False))"
            )
        self.fast_dtype = fast
        self._enabled = enabled
        self.cache_enabled = cache_enabled
        self._tokens: list = []  # one pair per entry still open: the instance may nest

    def __enter__(self) -> autocast:
        outer = _region.get()
        by_device = dict(DEFAULT_DTYPES if outer is None else outer[3])
        by_device[self.device] = self.fast_dtype
        region = (self._enabled, self.fast_dtype, self.device, by_device)
        active = self.fast_dtype if self._enabled else None
        self._tokens.append((_region.set(region), _active.set(active)))
        return self

    def __exit__(self, *exc) -> None:
        region_token, active_token = self._tokens.pop()
        _active.reset(active_token)
        _region.reset(region_token)

    def __call__(self, fn):
        """As a decorator: ``fn`` runs in a region like this one at every call."""
        settings = (self.device, self.fast_dtype, self._enabled, self.cache_enabled)

        @functools.wraps(fn)
        def autocast_wrapped(*args, **kwargs):
            with autocast(*settings):
                return fn(*args, **kwargs)

        return autocast_wrapped


def lower_precision(*tensors):
    """The inputs of a lower-precision op (matmul, linear, conv, attention): float32,
    float16 and bfloat16 tensors cast to the region's dtype; float64 and other values
    unchanged (PyTorch: float64 is not eligible). Returns a tuple."""
    target = _active.get()
    if target is None:
        return tensors
    return tuple(_cast(t, target, lambda d: d in _ELIGIBLE and d is not target) for t in tensors)


def full_precision(*tensors):
    """The inputs of a float32 op (softmax, norms, losses): float16/bfloat16 tensors cast
    to float32; other values unchanged. Returns a tuple."""
    if _active.get() is None:
        return tensors
    return tuple(_cast(t, dtypes.float32, lambda d: d in LOWER_DTYPES) for t in tensors)


def _cast(value, target, wanted):
    from flame.tensor import Tensor

    if isinstance(value, Tensor) and wanted(value.dtype):
        return value.to(target)
    return value
