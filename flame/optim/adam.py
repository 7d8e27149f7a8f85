"""Adam and AdamW (PyTorch's definitions, including ``amsgrad`` and ``maximize``)."""

from __future__ import annotations

import math

from flame import functional as F
from flame.foreach import foreach
from flame.optim._common import grad_of, in_float32, scalars, zeros_state
from flame.optim.optimizer import Optimizer

# the per-step values every parameter of a group reads, in the order the rules index them
_LR, _BETA1, _BETA2, _EPS, _L2, _DECAY, _STEP_SIZE, _BC2_SQRT, _SIGN = range(9)


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
        by_step: dict[int, list] = {}
        amsgrad = group["amsgrad"]
        for param in params:
            state = self.state.setdefault(param)
            if not state:
                state["step"] = 0.0
                state["exp_avg"] = zeros_state(param)
                state["exp_avg_sq"] = zeros_state(param)
                if amsgrad:
                    state["max_exp_avg_sq"] = zeros_state(param)
            step = state["step"] = state["step"] + 1
            by_step.setdefault(int(step), []).append((param, state))
        for step, members in by_step.items():
            self._apply(group, members, step)

    def _apply(self, group, members, step):
        lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
        values = [0.0] * 9
        values[_LR], values[_BETA1], values[_BETA2], values[_EPS] = lr, beta1, beta2, group["eps"]
        values[_L2] = 0.0 if self.decoupled else wd
        values[_DECAY] = 1.0 - lr * wd if self.decoupled else 1.0
        values[_STEP_SIZE] = lr / (1.0 - beta1**step)
        values[_BC2_SQRT] = math.sqrt(1.0 - beta2**step)
        values[_SIGN] = -1.0 if group["maximize"] else 1.0
        params = [param for param, _ in members]
        states = [state for _, state in members]
        h = scalars(values, params[0], self._uploads)
        lists = [params, [grad_of(p) for p in params]]
        lists += [[s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]]
        if group["amsgrad"]:
            lists.append([s["max_exp_avg_sq"] for s in states])
            foreach(adam_amsgrad_rule, *lists, scalars=h, into=(0, 2, 3, 4))
        else:
            foreach(adam_rule, *lists, scalars=h, into=(0, 2, 3))


class AdamW(Adam):
    """Adam with decoupled weight decay: ``p *= 1 - lr * weight_decay`` before the update."""

    decoupled = True

    def __init__(
        self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
        amsgrad=False, *, maximize=False,
    ):  # fmt: skip
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize)
