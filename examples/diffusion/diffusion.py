"""Gaussian diffusion for the diffusion example: noise schedules, the forward process, the
training loss and two samplers (DDPM ancestral and DDIM), with classifier-free guidance.

Notation (Ho et al. 2020; Nichol & Dhariwal 2021): ``alpha_bar[t]`` is the product of
``1 - beta`` up to step ``t``; ``a = sqrt(alpha_bar[t])`` and ``s = sqrt(1 - alpha_bar[t])``
are the weights of the clean image and of the noise in ``x_t = a * x0 + s * eps``. A model
predicts either the noise ``eps`` or the velocity ``v = a * eps - s * x0`` (Salimans & Ho
2022); both convert to ``(x0, eps)`` given ``x_t``, which is all the samplers need.

Everything that changes from one sampler step to the next (the timestep, the schedule's
coefficients, the guidance scale) reaches the compiled step as a tensor, never as a Python
number: a number is part of a compiled function's signature, so each new ``t`` would trace
the model again. The schedule itself is computed in float64 on the host and handed to FLAME
in float32 (1000 values; an index into it is a gather inside the traced step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import flame as fl

TIMESTEPS = 1000
SCHEDULES = ("linear", "cosine")
PREDICTIONS = ("eps", "v")


# --- schedules ------------------------------------------------------------------------------


def linear_betas(steps: int = TIMESTEPS, start: float = 1e-4, end: float = 0.02) -> np.ndarray:
    """DDPM's schedule: betas evenly spaced from ``start`` to ``end``."""
    return np.linspace(start, end, steps, dtype=np.float64)


def cosine_alpha_bar(progress: np.ndarray, offset: float = 0.008) -> np.ndarray:
    """Nichol & Dhariwal's ``f(t) / f(0)`` with ``f(t) = cos((t/T + s) / (1 + s) * pi/2)^2``;
    ``progress`` is ``t / T`` in [0, 1]. The small offset keeps beta from vanishing near 0,
    where a noise-free image would make the first step too easy to be useful."""

    def f(p):
        return np.cos((p + offset) / (1 + offset) * math.pi / 2) ** 2

    return f(np.asarray(progress, dtype=np.float64)) / f(0.0)


def cosine_betas(steps: int = TIMESTEPS, max_beta: float = 0.999) -> np.ndarray:
    """Betas that realize ``cosine_alpha_bar`` step by step; clipped at ``max_beta`` because
    the last step would otherwise have beta = 1 (alpha_bar reaches 0) and a singular
    posterior."""
    progress = np.arange(steps + 1, dtype=np.float64) / steps
    alpha_bar = cosine_alpha_bar(progress)
    return np.minimum(1.0 - alpha_bar[1:] / alpha_bar[:-1], max_beta)


@dataclass(frozen=True)
class Schedule:
    """A noise schedule: host arrays (float64) for the samplers' per-step coefficients and
    device tensors (float32) of ``a`` and ``s`` per timestep for the training loss."""

    name: str
    betas: np.ndarray
    alphas_cumprod: np.ndarray
    sqrt_alphas_cumprod: fl.Tensor
    sqrt_one_minus_alphas_cumprod: fl.Tensor

    @property
    def timesteps(self) -> int:
        return len(self.betas)


def make_schedule(name: str = "linear", steps: int = TIMESTEPS) -> Schedule:
    """The schedule ``name`` (linear or cosine) over ``steps`` timesteps, its tensors on the
    current backend."""
    if name == "linear":
        betas = linear_betas(steps)
    elif name == "cosine":
        betas = cosine_betas(steps)
    else:
        raise ValueError(f"unknown noise schedule {name!r}; choose one of {SCHEDULES}")
    alphas_cumprod = np.cumprod(1.0 - betas)
    a = fl.tensor(np.sqrt(alphas_cumprod).astype(np.float32)).realize()
    s = fl.tensor(np.sqrt(1.0 - alphas_cumprod).astype(np.float32)).realize()
    return Schedule(name, betas, alphas_cumprod, a, s)


def coefficients(schedule: Schedule, t: fl.Tensor) -> tuple[fl.Tensor, fl.Tensor]:
    """``(a, s)`` at the timesteps ``t`` ([N] int64), shaped [N, 1, 1, 1] to scale images."""
    shape = (t.shape[0], 1, 1, 1)
    a = fl.index_select(schedule.sqrt_alphas_cumprod, 0, t).reshape(shape)
    s = fl.index_select(schedule.sqrt_one_minus_alphas_cumprod, 0, t).reshape(shape)
    return a, s


# --- the forward process and the two parameterisations ----------------------------------------


def q_sample(x0, noise, a, s):
    """A draw of ``x_t`` given ``x0``: ``a * x0 + s * noise``."""
    return a * x0 + s * noise


def v_target(x0, noise, a, s):
    """The velocity ``v = a * eps - s * x0``: the direction of ``x_t`` along the quarter
    circle from ``x0`` to the noise, well scaled at every ``t`` (unlike ``eps`` near t = 0 or
    ``x0`` near t = T)."""
    return a * noise - s * x0


def training_target(prediction: str, x0, noise, a, s):
    if prediction == "eps":
        return noise
    if prediction == "v":
        return v_target(x0, noise, a, s)
    raise ValueError(f"unknown prediction {prediction!r}; choose one of {PREDICTIONS}")


def to_x0_eps(prediction: str, output, x_t, a, s):
    """The model's ``output`` as ``(x0, eps)`` given ``x_t``. With ``a^2 + s^2 = 1``:
    from eps, ``x0 = (x_t - s eps) / a``; from v, ``x0 = a x_t - s v`` and
    ``eps = s x_t + a v``."""
    if prediction == "eps":
        return (x_t - s * output) / a, output
    if prediction == "v":
        return a * x_t - s * output, s * x_t + a * output
    raise ValueError(f"unknown prediction {prediction!r}; choose one of {PREDICTIONS}")


# --- the training loss ------------------------------------------------------------------------


def training_loss(
    model, x0, labels, schedule: Schedule, *, prediction: str = "eps", cfg_dropout: float = 0.0,
    num_classes: int | None = None, generator=None,
):  # fmt: skip
    """The simple loss of DDPM: the mean squared error of the model's prediction at a random
    timestep. Timesteps, noise and the label dropout of classifier-free guidance are drawn
    from ``generator`` here, so that inside a compiled step they are new at every call. A
    dropped label becomes the null class ``num_classes``: the one model learns both the
    conditional and the unconditional prediction."""
    batch = x0.shape[0]
    t = fl.randint(0, schedule.timesteps, (batch,), generator=generator, dtype=fl.int64)
    noise = fl.randn_like(x0, generator=generator)
    if labels is not None and cfg_dropout > 0:
        dropped = fl.rand(batch, generator=generator) < cfg_dropout
        labels = fl.where(dropped, fl.full_like(labels, num_classes), labels)
    a, s = coefficients(schedule, t)
    output = model(q_sample(x0, noise, a, s), t, labels)
    target = training_target(prediction, x0, noise, a, s)
    return fl.nn.functional.mse_loss(output.float(), target)


# --- sampling ---------------------------------------------------------------------------------


def sampling_timesteps(total: int, steps: int) -> np.ndarray:
    """``steps`` timesteps from ``total - 1`` down to 0, evenly spaced (all of them when
    ``steps == total``), so that every run, short or long, starts from pure noise."""
    if not 1 <= steps <= total:
        raise ValueError(f"sampling steps must lie in [1, {total}], got {steps}")
    return np.unique(np.round(np.linspace(0, total - 1, steps)).astype(np.int64))[::-1]


def guided_prediction(model, x_t, t, labels, scale, num_classes):
    """The model's output with classifier-free guidance: ``uncond + w * (cond - uncond)``,
    both halves from one forward pass over the batch twice (labels, then the null class).
    Guidance is applied to the raw output; for eps and for v alike this equals guiding eps,
    since both conversions are affine in the output with the same ``x_t``."""
    if labels is None:
        return model(x_t, t, None)
    null = fl.full_like(labels, num_classes)
    doubled = model(fl.cat([x_t, x_t]), fl.cat([t, t]), fl.cat([labels, null]))
    conditional, unconditional = doubled.chunk(2)
    return unconditional + scale * (conditional - unconditional)


class Sampler:
    """DDPM ancestral or DDIM sampling of ``model`` (put in eval mode by the caller) over
    ``steps`` timesteps (for DDPM fewer than the schedule's walk a respaced chain, as in
    Nichol & Dhariwal), each step one compiled function. The per-step values go in as one
    small float32 tensor ``h`` (all made before the loop starts), so the loop replays one
    program:

    ``h = [a_t, s_t, w, c_x0, c_xt, sigma]``: the step's own ``a`` and ``s``, the guidance
    scale, and the weights of the predicted ``x0`` and of ``x_t`` (DDPM's posterior mean)
    or of ``x0`` and ``eps`` (DDIM), and the standard deviation of the noise added."""

    def __init__(self, model, schedule: Schedule, *, kind: str = "ddim", steps: int = 50,
                 prediction: str = "eps", guidance: float = 1.0, eta: float = 0.0,
                 num_classes: int | None = None, clip: bool = True, generator=None):  # fmt: skip
        if kind not in ("ddpm", "ddim"):
            raise ValueError(f"unknown sampler {kind!r}; choose ddpm or ddim")
        self.model, self.schedule, self.kind = model, schedule, kind
        self.prediction, self.guidance, self.eta = prediction, guidance, eta
        self.clip = clip
        self.stochastic = kind == "ddpm" or eta > 0  # eta = 0: DDIM draws no noise at all
        self.num_classes, self.generator = num_classes, generator
        self.timesteps = sampling_timesteps(schedule.timesteps, steps)
        self.step = fl.compile(self._step)

    def per_step_values(self) -> list[np.ndarray]:
        """One ``h`` per step, in float64 (rounded to float32 on upload)."""
        alpha_bar = self.schedule.alphas_cumprod
        values = []
        for index, t in enumerate(self.timesteps):
            previous = self.timesteps[index + 1] if index + 1 < len(self.timesteps) else -1
            now, before = alpha_bar[t], (alpha_bar[previous] if previous >= 0 else 1.0)
            if self.kind == "ddpm":
                beta = 1.0 - now / before  # one step of the chain (also for a strided one)
                c_x0 = math.sqrt(before) * beta / (1.0 - now)
                c_xt = math.sqrt(1.0 - beta) * (1.0 - before) / (1.0 - now)
                sigma = math.sqrt(beta * (1.0 - before) / (1.0 - now))  # posterior's beta~
            else:
                sigma = self.eta * math.sqrt((1.0 - before) / (1.0 - now) * (1.0 - now / before))
                c_x0 = math.sqrt(before)
                c_xt = math.sqrt(max(1.0 - before - sigma**2, 0.0))  # the weight of eps
            row = [math.sqrt(now), math.sqrt(1.0 - now), self.guidance, c_x0, c_xt, sigma]
            values.append(np.array(row, dtype=np.float64))
        return values

    def _step(self, x_t, t, labels, h):
        """One reverse step; run under ``fl.compile``."""
        with fl.no_grad():
            a, s = h[0], h[1]
            if self.guidance == 1.0:  # w = 1 is the conditional model: no second half
                output = self.model(x_t, t, labels)
            else:
                output = guided_prediction(self.model, x_t, t, labels, h[2], self.num_classes)
            x0, eps = to_x0_eps(self.prediction, output.float(), x_t, a, s)
            if self.clip:  # the data's range: keeps the early, poor guesses of x0 sane
                x0 = x0.clamp(-1.0, 1.0)
                eps = (x_t - a * x0) / s  # the noise that goes with the clipped x0
            x_previous = h[3] * x0 + h[4] * (x_t if self.kind == "ddpm" else eps)
            if self.stochastic:
                x_previous = x_previous + h[5] * fl.randn_like(x_t, generator=self.generator)
            return x_previous

    def sample(self, noise: fl.Tensor, labels: fl.Tensor | None, progress=None) -> fl.Tensor:
        """Run the chain from ``noise`` ([N, C, H, W]) for ``labels`` ([N] int64 or None);
        ``progress`` (a callable taking the step index) reports each step."""
        batch = noise.shape[0]
        steps = [
            (fl.full((batch,), int(t), dtype=fl.int64), fl.tensor(h, dtype=fl.float32))
            for t, h in zip(self.timesteps, self.per_step_values())
        ]
        fl.realize(*[value for pair in steps for value in pair])  # uploaded before the loop
        x = noise
        for index, (t, h) in enumerate(steps):
            x = self.step(x, t, labels, h)
            if progress is not None:
                progress(index)
        return x.clamp(-1.0, 1.0)
