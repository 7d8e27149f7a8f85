"""SGD with momentum, dampening, Nesterov momentum and weight decay (PyTorch's definition)."""

from __future__ import annotations

from flame.foreach import foreach
from flame.optim._common import grad_of, guarded, in_float32, scalars, zeros_state
from flame.optim.optimizer import Optimizer

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

    def _check_group(self, group):
        super()._check_group(group)
        if group["momentum"] < 0 or group["weight_decay"] < 0:
            raise ValueError("SGD: momentum and weight_decay must be >= 0")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("SGD: Nesterov momentum requires a momentum and zero dampening")

    def _update(self, group, params):
        momentum = group["momentum"]
        grads = [grad_of(p) for p in params]
        sign = -1.0 if group["maximize"] else 1.0
        if momentum == 0:
            h = scalars(
                [group["lr"], group["weight_decay"], 0.0, 0.0, 0.0, sign], params[0], self._uploads
            )
            rule, h = guarded(self, sgd_rule, h, (0,))
            foreach(rule, params, grads, scalars=h, into=(0,))
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
        rule = sgd_nesterov_rule if group["nesterov"] else sgd_momentum_rule
        for members, keep, take in ((fresh, 0.0, 1.0), (started, momentum, 1 - group["dampening"])):
            if not members:
                continue
            values = [group["lr"], group["weight_decay"], momentum, keep, take, sign]
            h = scalars(values, members[0][0], self._uploads)
            ps = [p for p, _ in members]
            buffers = [self.state[p]["momentum_buffer"] for p in ps]
            guarded_rule, h = guarded(self, rule, h, (0, 2))
            foreach(guarded_rule, ps, [g for _, g in members], buffers, scalars=h, into=(0, 2))
