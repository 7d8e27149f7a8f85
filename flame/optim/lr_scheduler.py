"""Learning-rate schedules (PyTorch's interface). A schedule only changes ``group["lr"]``;
the optimizer hands the rate to its kernel as data, so no schedule ever recompiles.

How a new rate reaches a compiled step (``flame.compile`` around ``optimizer.step()``):
setting ``group["lr"]`` writes the group's values into the device tensor the traced step
reads (``Optimizer._hyper``, through the group, a ``ParamGroup``); a learning rate that is
a tensor (``lr=fl.tensor(1e-3)``) is written in place, as PyTorch's ``fill_``. Either way
the step is not traced again. Call ``scheduler.step()`` outside the compiled function."""

from __future__ import annotations

import abc
import math

from flame.tensor import Tensor


def _number(rate) -> float:
    """A rate as a number (a tensor rate is read once, when the schedule is made)."""
    return float(rate.item()) if isinstance(rate, Tensor) else rate


class LRScheduler(abc.ABC):
    def __init__(self, optimizer, last_epoch: int = -1):
        self.optimizer = optimizer
        if last_epoch == -1:
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", _number(group["lr"]))
        self.base_lrs = [_number(group["initial_lr"]) for group in optimizer.param_groups]
        self.last_epoch = last_epoch
        self.step()

    @abc.abstractmethod
    def lr_at(self, base_lr: float, epoch: int) -> float:
        """The rate at ``epoch`` for a group whose initial rate is ``base_lr``."""

    def step(self) -> None:
        from flame.optim._common import tracing

        if tracing():
            from flame.compile import TraceError

            raise TraceError(
                f"{type(self).__name__}.step() inside a function being compiled: the new rate "
                "would be fixed when it is traced. Call it outside the compiled step (the "
                "step reads the rate from the device, no retrace)"
            )
        self.last_epoch += 1
        rates = []
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            rate = self.lr_at(base, self.last_epoch)
            if isinstance(group["lr"], Tensor):  # PyTorch's fill_: in place, read on device
                from flame.optim._common import write_values

                write_values(group["lr"], rate, getattr(self.optimizer, "_uploads", None))
            else:
                group["lr"] = rate
            rates.append(rate)
        self._last_lr = rates

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)


class LambdaLR(LRScheduler):
    def __init__(self, optimizer, lr_lambda, last_epoch: int = -1):
        self.lr_lambda = lr_lambda
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr, epoch):
        return base_lr * self.lr_lambda(epoch)


class LinearLR(LRScheduler):
    """Scales the rate linearly from ``start_factor`` to ``end_factor`` over ``total_iters``
    steps (a linear warm-up)."""

    def __init__(
        self, optimizer, start_factor=1.0 / 3, end_factor=1.0, total_iters=5, last_epoch=-1
    ):
        if not 0 < start_factor <= 1 or not 0 <= end_factor <= 1:
            raise ValueError("LinearLR: factors must lie in (0, 1] and [0, 1]")
        self.start_factor, self.end_factor, self.total_iters = start_factor, end_factor, total_iters
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr, epoch):
        progress = min(epoch, self.total_iters) / self.total_iters
        factor = self.start_factor + (self.end_factor - self.start_factor) * progress
        return base_lr * factor


class CosineAnnealingLR(LRScheduler):
    def __init__(self, optimizer, T_max: int, eta_min: float = 0.0, last_epoch: int = -1):  # noqa: N803
        self.T_max, self.eta_min = T_max, eta_min
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr, epoch):
        cosine = (1 + math.cos(math.pi * epoch / self.T_max)) / 2
        return self.eta_min + (base_lr - self.eta_min) * cosine


class SequentialLR(LRScheduler):
    """Runs ``schedulers`` one after another, switching at ``milestones`` (e.g. a linear
    warm-up, then cosine decay)."""

    def __init__(self, optimizer, schedulers, milestones, last_epoch: int = -1):
        if len(milestones) != len(schedulers) - 1:
            raise ValueError("SequentialLR: give one milestone fewer than schedulers")
        self.schedulers, self.milestones = list(schedulers), list(milestones)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr, epoch):
        index = sum(1 for milestone in self.milestones if epoch >= milestone)
        start = self.milestones[index - 1] if index else 0
        return self.schedulers[index].lr_at(base_lr, epoch - start)
