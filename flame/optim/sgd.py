"""SGD with momentum, dampening, Nesterov momentum and weight decay (PyTorch's definition)."""

from __future__ import annotations

from flame.optim._common import (
    apply_rule,
    grad_of,
    guarded,
    in_float32,
    lr_tensor,
    new_scalar,
    scalars,
    tracing,
    write_values,
    zeros_state,
)
from flame.optim.optimizer import Optimizer
from flame.tensor import Tensor

# per-step values: learning rate, L2 weight decay, momentum, the buffer's two coefficients
# (first step: 0 and 1, so the buffer starts as the gradient), the sign (maximize)
_LR, _WD, _MOMENTUM, _KEEP, _TAKE, _SIGN = range(6)


def sgd_rule(p, g, h):
    p, g = in_float32(p, g)
    g = g * h[_SIGN] + p * h[_WD]
    return p - h[_LR] * g


def sgd_momentum_rule(p, g, buf, h):
    p, g, buf = in_float32(p, g, buf)
    g = g * h[_SIGN] + p * h[_WD]
    buf = buf * h[_KEEP] + g * h[_TAKE]
    return p - h[_LR] * buf, buf


def sgd_nesterov_rule(p, g, buf, h):
    p, g, buf = in_float32(p, g, buf)
    g = g * h[_SIGN] + p * h[_WD]
    buf = buf * h[_KEEP] + g * h[_TAKE]
    return p - h[_LR] * (g + h[_MOMENTUM] * buf), buf


class SGD(Optimizer):
    _skips_on_device = True  # GradScaler: see Optimizer._skip_if

    def __init__(
        self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
        *, maximize=False,
    ):  # fmt: skip
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov, maximize=maximize,
        )  # fmt: skip
        super().__init__(params, defaults)
        # id(param) -> the flag a traced first step of its buffer reads (``_first_values``)
        self._started: dict[int, Tensor] = {}

    def _check_group(self, group):
        super()._check_group(group)
        if group["momentum"] < 0 or group["weight_decay"] < 0:
            raise ValueError("SGD: momentum and weight_decay must be >= 0")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("SGD: Nesterov momentum requires a momentum and zero dampening")

    def _hyper_values(self, group) -> list:
        lr = 0.0 if isinstance(group["lr"], Tensor) else group["lr"]  # a tensor: on the device
        sign = -1.0 if group["maximize"] else 1.0
        momentum = group["momentum"]
        return [lr, group["weight_decay"], momentum, momentum, 1 - group["dampening"], sign]

    def _device_values(self, group, like) -> Tensor:
        """The per-step values of a started buffer, on the device: the group's values there
        (``_hyper``) with a tensor learning rate read in place of its entry."""
        hyper = self._hyper(group, like)
        lr = lr_tensor(group, like)
        if lr is None:
            return hyper
        from flame.joining import cat

        return cat([lr.reshape((1,)), hyper[1:]])

    def _update(self, group, params):
        momentum = group["momentum"]
        grads = [grad_of(p) for p in params]
        sign = -1.0 if group["maximize"] else 1.0
        on_device = tracing() or isinstance(group["lr"], Tensor)
        if momentum == 0:
            if on_device:
                h = self._device_values(group, params[0])
            else:
                values = [group["lr"], group["weight_decay"], 0.0, 0.0, 0.0, sign]
                h = scalars(values, params[0], self._uploads)
            rule, h = guarded(self, sgd_rule, h, (0,))
            apply_rule(rule, params, grads, scalars=h, into=(0,))
            return
        # a parameter's first step starts its buffer at the gradient (PyTorch's rule)
        fresh, started = [], []
        for param, grad in zip(params, grads):
            state = self.state.setdefault(param)
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = zeros_state(param)
                fresh.append((param, grad))
            else:
                started.append((param, grad))
        if on_device and group["dampening"] == 0:
            # a new buffer is zeros, so ``buf * momentum + grad`` is the first step's rule too
            started, fresh = started + fresh, []
        for members, first in ((fresh, True), (started, False)):
            if not members:
                continue
            if on_device:
                h = self._device_values(group, members[0][0])
                if first:
                    h = self._first_values(h, [p for p, _ in members])
            else:
                keep, take = (0.0, 1.0) if first else (momentum, 1 - group["dampening"])
                values = [group["lr"], group["weight_decay"], momentum, keep, take, sign]
                h = scalars(values, members[0][0], self._uploads)
            self._step_buffers(group, members, h)

    def _step_buffers(self, group, members, h) -> None:
        rule = sgd_nesterov_rule if group["nesterov"] else sgd_momentum_rule
        ps = [p for p, _ in members]
        buffers = [self.state[p]["momentum_buffer"] for p in ps]
        guarded_rule, h = guarded(self, rule, h, (0, 2))
        apply_rule(guarded_rule, ps, [g for _, g in members], buffers, scalars=h, into=(0, 2))

    def _first_values(self, h: Tensor, params) -> Tensor:
        """The values of new buffers' first step (keep 0, take 1) on the device. Traced
        (flame.compile), the step is repeated at every call: there a 0-d flag, 0 until the
        program's first call writes 1, picks the first step's values or the later ones."""
        from flame.joining import stack

        if not tracing():
            keep, take = h[_KEEP] * 0.0, h[_TAKE] * 0.0 + 1.0
        else:
            flag = new_scalar(0.0, params[0])
            for param in params:
                self._started[id(param)] = flag
            keep, take = h[_KEEP] * flag, 1.0 - (1.0 - h[_TAKE]) * flag
            flag.fill_(1.0)
        return stack([h[_LR], h[_WD], h[_MOMENTUM], keep, take, h[_SIGN]])

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # compiled steps' flags follow the loaded buffers
            for param in group["params"]:
                flag = self._started.get(id(param))
                if flag is not None:
                    started = "momentum_buffer" in (self.state.get(param) or {})
                    write_values(flag, 1.0 if started else 0.0)
