"""``flame.amp.GradScaler``: PyTorch's dynamic loss scaling, with no host synchronisation.

    scaler = fl.amp.GradScaler()
    with fl.autocast(dtype=fl.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)  # skipped, on the device, when a gradient holds inf or NaN
    scaler.update()         # the scale backs off after a skipped step, grows after
                            # ``growth_interval`` good ones

The scale and the growth tracker are 0-d float32 tensors on the device, written in place
(a compiled function that closes over the scale reads each new value, no retrace).
``unscale_`` multiplies every gradient by 1/scale in one multi-tensor kernel
(``flame.foreach``) and computes the found-inf flag as a device tensor (one reduction per
gradient and one that combines them). ``step`` hands the flag to the optimizer
(``Optimizer._skip_if``): FLAME's optimizers select the old parameter and state values where
it is set, inside their update kernel, and do not advance their step counts (flame/optim),
so a step never waits for the GPU. Other optimizers are stepped when the flag, read on the
host, is 0 (PyTorch's behaviour for optimizers without fused AMP support).

``device`` is checked ("cuda" or "cpu") and otherwise ignored: the scale lives on the
backend of the first tensors ``scale`` is given.
"""

from __future__ import annotations

from flame.amp.autocast_mode import _device_type

_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"

# per-update values the scale's update reads: growth factor, backoff factor, interval
_GROWTH, _BACKOFF, _INTERVAL = range(3)


def _unscale_rule(grad, h):
    return grad * h[0]


def _non_finite(grads):
    """A realized 0-d float32 tensor: 1.0 if some gradient holds inf or NaN, else 0.0."""
    from flame.functional import isfinite
    from flame.ir import dtypes
    from flame.joining import stack

    finite = [isfinite(grad).all() for grad in grads]
    every = finite[0] if len(finite) == 1 else stack(finite).all()
    return (1.0 - every.to(dtypes.float32)).realize()


class GradScaler:
    """PyTorch's ``torch.amp.GradScaler``: ``scale``, ``unscale_``, ``step``, ``update``,
    ``get_scale``, ``is_enabled``, ``state_dict``/``load_state_dict`` and the growth and
    backoff accessors."""

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):  # fmt: skip
        self._device = _device_type(device)
        self._enabled = bool(enabled)
        if self._enabled:
            if growth_factor <= 1.0:
                raise ValueError(f"GradScaler: growth_factor must be > 1, got {growth_factor}")
            if not 0.0 < backoff_factor < 1.0:
                raise ValueError(
                    f"GradScaler: backoff_factor must be in (0, 1), got {backoff_factor}"
                )
            if growth_interval < 1:
                raise ValueError(f"GradScaler: growth_interval must be >= 1, got {growth_interval}")
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._init_growth_tracker = 0
        self._scale = None  # 0-d float32, made on the first scale()'s backend
        self._growth_tracker = None  # 0-d float32: good steps in a row
        self._per_optimizer: dict[int, dict] = {}

    # --- the scale ---------------------------------------------------------------------------
    def _lazy_init(self, backend: str) -> None:
        # fl.tensor, not fl.full: a realized 0-d fl.full cannot be written in place on the
        # reference backend (its memory's strides are those of a broadcast constant)
        self._scale = _scalar(self._init_scale, backend).realize()
        self._growth_tracker = _scalar(float(self._init_growth_tracker), backend).realize()

    def scale(self, outputs):
        """``outputs`` (a tensor, or lists/tuples of them) times the scale; unchanged when
        disabled. A float16/bfloat16 loss stays in its dtype (the scale is 0-d)."""
        from flame.tensor import Tensor

        if not self._enabled:
            return outputs
        if isinstance(outputs, Tensor):
            if self._scale is None:
                self._lazy_init(outputs.backend)
            return outputs * self._scale
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(item) for item in outputs)
        if hasattr(outputs, "__iter__"):
            return map(self.scale, outputs)
        raise ValueError("GradScaler.scale: outputs must be a tensor or an iterable of tensors")

    def _state(self, optimizer) -> dict:
        return self._per_optimizer.setdefault(id(optimizer), {"stage": _READY, "found": None})

    # --- unscale_, step, update --------------------------------------------------------------
    def unscale_(self, optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, and record on the device
        whether one of them holds inf or NaN. Call it before clipping gradients; ``step``
        calls it when it was not."""
        if not self._enabled:
            return
        self._check_scale("unscale_")
        state = self._state(optimizer)
        if state["stage"] is _UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is _STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        state["found"] = self._unscale_grads(optimizer)
        state["stage"] = _UNSCALED

    def _unscale_grads(self, optimizer):
        from flame.foreach import foreach
        from flame.ir import dtypes
        from flame.runtime.storage import storage_of
        from flame.tensor import realize
        from flame.views import reshape

        grads = [
            param.grad
            for group in optimizer.param_groups for param in group["params"]
            if param.grad is not None
        ]  # fmt: skip
        if not grads:  # nothing to check: a flag that says so, on the scale's backend
            return (self._scale * 0.0).realize()
        for grad in grads:
            if grad.dtype is dtypes.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
        realize(*[grad for grad in grads if not grad.is_realized])
        unique, seen = [], set()
        for grad in grads:  # a gradient shared by two parameters is unscaled once
            storage = id(storage_of(grad.node))
            if storage not in seen:
                seen.add(storage)
                unique.append(grad)
        inverse = reshape(1.0 / self._scale, (1,)).realize()
        foreach(_unscale_rule, unique, scalars=inverse, into=(0,))
        return _non_finite(unique)

    def step(self, optimizer, *args, **kwargs):
        """``optimizer.step(*args, **kwargs)`` with the gradients unscaled, skipped where one
        holds inf or NaN (on the device for FLAME's optimizers)."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale("step")
        state = self._state(optimizer)
        if state["stage"] is _STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is _READY:
            self.unscale_(optimizer)
        found = state["found"]
        if getattr(optimizer, "_skips_on_device", False):
            optimizer._skip_if = found
            try:
                result = optimizer.step(*args, **kwargs)
            finally:
                optimizer._skip_if = None
        else:  # an optimizer that cannot skip on the device: read the flag (waits)
            result = None if float(found.item()) else optimizer.step(*args, **kwargs)
        state["stage"] = _STEPPED
        return result

    def update(self, new_scale=None) -> None:
        """The next scale: ``new_scale`` when given (a number or a 0-d tensor); else backed
        off if some step of this iteration found inf/NaN, grown after ``growth_interval``
        good steps in a row. Written in place, on the device."""
        if not self._enabled:
            return
        self._check_scale("update")
        if new_scale is not None:
            self._scale.copy_(_as_scalar(new_scale, self._scale))
        else:
            flags = [state["found"] for state in self._per_optimizer.values()]
            flags = [flag for flag in flags if flag is not None]
            if not flags:
                raise RuntimeError("No inf checks were recorded prior to update.")
            self._update_scale(flags)
        self._per_optimizer = {}

    def _update_scale(self, flags) -> None:
        """PyTorch's ``_amp_update_scale_``, as two in-place writes of elementwise values."""
        from flame.functional import isfinite, where

        found = flags[0]
        for flag in flags[1:]:
            found = found + flag
        skipped = found > 0.0
        good = self._growth_tracker + 1.0
        grow = good >= float(self._growth_interval)
        grown = self._scale * self._growth_factor
        grown = where(isfinite(grown), grown, self._scale)
        scale = where(skipped, self._scale * self._backoff_factor, where(grow, grown, self._scale))
        tracker = where(skipped | grow, 0.0, good)
        self._scale.copy_(scale)  # reads the old tracker, which is written next
        self._growth_tracker.copy_(tracker)

    def _check_scale(self, what: str) -> None:
        if self._scale is None:
            raise RuntimeError(
                f"Attempted {what} but _scale is None. This may indicate your script did not "
                "use scaler.scale(loss or outputs) earlier in the iteration."
            )

    # --- accessors and state -----------------------------------------------------------------
    def get_scale(self) -> float:
        """The current scale as a Python float (waits for the device, as in PyTorch)."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def is_enabled(self) -> bool:
        return self._enabled

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = int(new_interval)

    def _get_growth_tracker(self) -> int:
        if self._growth_tracker is None:
            return self._init_growth_tracker
        return int(self._growth_tracker.item())

    def state_dict(self) -> dict:
        """PyTorch's keys; empty when disabled."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(), "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
        }  # fmt: skip

    def load_state_dict(self, state_dict: dict) -> None:
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a "
                "disabled instance of GradScaler."
            )
        self._init_scale = float(_as_float(state_dict["scale"]))
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._init_growth_tracker = int(_as_float(state_dict["_growth_tracker"]))
        if self._scale is not None:
            backend = self._scale.backend
            self._scale.copy_(_scalar(self._init_scale, backend))
            self._growth_tracker.copy_(_scalar(float(self._init_growth_tracker), backend))


def _as_float(value) -> float:
    return float(value.item()) if hasattr(value, "item") else float(value)


def _scalar(value: float, backend: str):
    from flame.backend import backend as use_backend
    from flame.creation import tensor
    from flame.ir import dtypes

    with use_backend(backend):
        return tensor(value, dtype=dtypes.float32)


def _as_scalar(value, like):
    """``new_scale`` as a 0-d float32 tensor on ``like``'s backend."""
    from flame.ir import dtypes
    from flame.tensor import Tensor

    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError("GradScaler.update: new_scale must be a one-element tensor")
        return value.reshape(()).to(dtypes.float32)
    return _scalar(float(value), like.backend)
