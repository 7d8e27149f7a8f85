"""Adam and AdamW (PyTorch's definitions, including ``amsgrad`` and ``maximize``)."""

from __future__ import annotations

import math

from flame import functional as F
from flame.optim._common import (
    apply_rule,
    grad_of,
    guarded,
    in_float32,
    lr_tensor,
    new_scalar,
    scalars,
    tracing,
    zeros_state,
)
from flame.optim.optimizer import Optimizer
from flame.tensor import Tensor

# the per-step values every parameter of a group reads, in the order the rules index them
_LR, _BETA1, _BETA2, _EPS, _L2, _DECAY, _STEP_SIZE, _BC2_SQRT, _SIGN = range(9)
# and after them, in the group's values on the device (``Optimizer._hyper``)
_LOG_BETA1, _LOG_BETA2, _WD = range(9, 12)


def _moments(p, g, m, v, h):
    g = g * h[_SIGN] + p * h[_L2]  # maximize; Adam's L2 weight decay (0 for AdamW)
    m = m + (g - m) * (1 - h[_BETA1])  # torch's lerp, for weights below 1/2
    v = v * h[_BETA2] + g * g * (1 - h[_BETA2])
    return m, v


def adam_rule(p, g, m, v, h):
    p, g, m, v = in_float32(p, g, m, v)
    m, v = _moments(p, g, m, v, h)
    denom = F.sqrt(v) / h[_BC2_SQRT] + h[_EPS]
    p = p * h[_DECAY] - h[_STEP_SIZE] * (m / denom)  # decay: AdamW's 1 - lr * weight_decay
    return p, m, v


def adam_amsgrad_rule(p, g, m, v, vmax, h):
    p, g, m, v, vmax = in_float32(p, g, m, v, vmax)
    m, v = _moments(p, g, m, v, h)
    vmax = F.maximum(vmax, v)
    denom = F.sqrt(vmax) / h[_BC2_SQRT] + h[_EPS]
    p = p * h[_DECAY] - h[_STEP_SIZE] * (m / denom)
    return p, m, v, vmax


class Adam(Optimizer):
    decoupled = False
    _skips_on_device = True  # GradScaler: see Optimizer._skip_if and _device_steps

    def __init__(
        self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
        amsgrad=False, *, maximize=False,
    ):  # fmt: skip
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize,
        )  # fmt: skip
        super().__init__(params, defaults)

    def _check_group(self, group):
        super()._check_group(group)
        beta1, beta2 = group["betas"]
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"{type(self).__name__}: invalid betas {group['betas']}")
        if group["eps"] < 0 or group["weight_decay"] < 0:
            raise ValueError(f"{type(self).__name__}: eps and weight_decay must be >= 0")

    def _update(self, group, params):
        # on the device: the step counts (0-d tensors shared by the parameters stepped
        # together) and the values computed from them, when a GradScaler may skip the step,
        # the rate is a tensor, or the step is traced (flame.compile); else on the host
        on_device = self._skip_if is not None or tracing() or isinstance(group["lr"], Tensor)
        by_step: dict = {}
        amsgrad = group["amsgrad"]
        for param in params:
            state = self.state.setdefault(param)
            if not state:
                state["step"] = 0.0
                state["exp_avg"] = zeros_state(param)
                state["exp_avg_sq"] = zeros_state(param)
                if amsgrad:
                    state["max_exp_avg_sq"] = zeros_state(param)
            step = state["step"]
            if not on_device and not isinstance(step, Tensor):
                step = state["step"] = step + 1
                by_step.setdefault(int(step), []).append((param, state))
            else:  # keyed by the count (shared by a group's members)
                key = ("device", id(step)) if isinstance(step, Tensor) else ("host", float(step))
                by_step.setdefault(key, []).append((param, state))
        for step, members in by_step.items():
            if isinstance(step, tuple):
                self._apply(group, members, None, self._device_steps(group, members))
            else:
                self._apply(group, members, step)

    def _device_steps(self, group, members) -> Tensor:
        """Advances the members' step count on the device (in place; not where a
        GradScaler's found-inf flag is set) and returns the per-step values computed from
        it there. A count given as a number, or shared with parameters not stepped now,
        becomes a 0-d float32 tensor of the members' own (exact up to 2**24 steps)."""
        params = [param for param, _ in members]
        count = members[0][1]["step"]
        if not isinstance(count, Tensor):
            count = new_scalar(float(count), params[0])
        elif self._shared_beyond(group, count, members) and not tracing():
            count = count.clone().realize()
        for _, state in members:
            state["step"] = count
        count.add_(1.0 if self._skip_if is None else 1.0 - self._skip_if)
        return self._device_values(group, count, params[0])

    def _shared_beyond(self, group, count: Tensor, members) -> bool:
        """Whether parameters not stepped now share ``count`` (they had no gradient)."""
        sharing = sum(
            1 for param in group["params"] if (self.state.get(param) or {}).get("step") is count
        )
        return sharing != len(members)

    def _hyper_values(self, group) -> list:
        lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
        if isinstance(lr, Tensor):
            lr = 0.0  # read on the device
        values = self._values(group, 1, lr)
        logs = [math.log(beta) if beta > 0 else -math.inf for beta in (beta1, beta2)]
        return [*values, *logs, wd]

    def _device_values(self, group, count: Tensor, like: Tensor) -> Tensor:
        """The per-step values of step ``count`` (a 0-d device tensor), computed on the
        device from the group's values there (``_hyper``) in float32: ``1 - beta**t`` as
        ``-expm1(t log beta)``, accurate to a few ulp."""
        from flame.joining import stack

        hyper = self._hyper(group, like)
        lr = lr_tensor(group, like)
        if lr is None:
            lr = hyper[_LR]
        decay = 1.0 - lr * hyper[_WD] if self.decoupled else hyper[_DECAY]
        step_size = lr / -F.expm1(count * hyper[_LOG_BETA1])
        bc2_sqrt = F.sqrt(-F.expm1(count * hyper[_LOG_BETA2]))
        values = [lr, hyper[_BETA1], hyper[_BETA2], hyper[_EPS], hyper[_L2], decay, step_size]
        return stack([*values, bc2_sqrt, hyper[_SIGN]])

    def _values(self, group, step, lr=None) -> list:
        lr = group["lr"] if lr is None else lr
        (beta1, beta2), wd = group["betas"], group["weight_decay"]
        values = [0.0] * 9
        values[_LR], values[_BETA1], values[_BETA2], values[_EPS] = lr, beta1, beta2, group["eps"]
        values[_L2] = 0.0 if self.decoupled else wd
        values[_DECAY] = 1.0 - lr * wd if self.decoupled else 1.0
        values[_STEP_SIZE] = lr / (1.0 - beta1**step)
        values[_BC2_SQRT] = math.sqrt(1.0 - beta2**step)
        values[_SIGN] = -1.0 if group["maximize"] else 1.0
        return values

    def _apply(self, group, members, step, h=None):
        params = [param for param, _ in members]
        states = [state for _, state in members]
        if h is None:
            h = scalars(self._values(group, step), params[0], self._uploads)
        lists = [params, [grad_of(p) for p in params]]
        lists += [[s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]]
        if group["amsgrad"]:
            lists.append([s["max_exp_avg_sq"] for s in states])
            rule, h = guarded(self, adam_amsgrad_rule, h, (0, 2, 3, 4))
            apply_rule(rule, *lists, scalars=h, into=(0, 2, 3, 4))
        else:
            rule, h = guarded(self, adam_rule, h, (0, 2, 3))
            apply_rule(rule, *lists, scalars=h, into=(0, 2, 3))


class AdamW(Adam):
    """Adam with decoupled weight decay: ``p *= 1 - lr * weight_decay`` before the update."""

    decoupled = True

    def __init__(
        self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
        amsgrad=False, *, maximize=False,
    ):  # fmt: skip
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize)
