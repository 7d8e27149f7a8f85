"""Adam and AdamW (PyTorch's definitions, including ``amsgrad`` and ``maximize``)."""

from __future__ import annotations

import math

from flame import functional as F
from flame.foreach import foreach
from flame.optim._common import grad_of, guarded, in_float32, scalars, zeros_state
from flame.optim.optimizer import Optimizer
from flame.tensor import Tensor, realize

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
            step = state["step"]
            if self._skip_if is None and not isinstance(step, Tensor):
                step = state["step"] = step + 1
                by_step.setdefault(int(step), []).append((param, state))
            else:  # counted on the device: keyed by the count (shared by a group's members)
                key = ("device", id(step) if isinstance(step, Tensor) else step)
                by_step.setdefault(key, []).append((param, state))
        for step, members in by_step.items():
            if isinstance(step, tuple):
                self._apply(group, members, None, self._device_steps(group, members))
            else:
                self._apply(group, members, step)

    def _device_steps(self, group, members) -> Tensor:
        """The step count of a step GradScaler may skip, counted on the device: the count
        does not advance where the found-inf flag is set, so the bias corrections are made
        there too, in float32 (``1 - beta**t`` as ``-expm1(t log beta)``, accurate to a few
        ulp). Returns the per-step values with those two entries; the new count is stored
        in the members' state (one tensor shared by them)."""
        from flame import functional as F
        from flame.backend import backend as use_backend
        from flame.creation import tensor
        from flame.joining import cat
        from flame.views import reshape

        params = [param for param, _ in members]
        count = members[0][1]["step"]
        if not isinstance(count, Tensor):
            with use_backend(params[0].backend):
                count = tensor(float(count))
        taken = 1.0 if self._skip_if is None else 1.0 - self._skip_if
        count = count + taken
        (beta1, beta2), lr = group["betas"], group["lr"]
        logs = [math.log(beta) if beta > 0 else -math.inf for beta in (beta1, beta2)]
        h = scalars(self._values(group, 1), params[0], self._uploads)
        step_size = lr / -F.expm1(count * logs[0])
        bc2_sqrt = F.sqrt(-F.expm1(count * logs[1]))
        parts = [h[:_STEP_SIZE], reshape(step_size, (1,)), reshape(bc2_sqrt, (1,))]
        h = cat([*parts, h[_BC2_SQRT + 1 :]])
        realize(h, count)
        for _, state in members:
            state["step"] = count
        return h

    def _values(self, group, step) -> list:
        lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
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
            foreach(rule, *lists, scalars=h, into=(0, 2, 3, 4))
        else:
            rule, h = guarded(self, adam_rule, h, (0, 2, 3))
            foreach(rule, *lists, scalars=h, into=(0, 2, 3))


class AdamW(Adam):
    """Adam with decoupled weight decay: ``p *= 1 - lr * weight_decay`` before the update."""

    decoupled = True

    def __init__(
        self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
        amsgrad=False, *, maximize=False,
    ):  # fmt: skip
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize)
