"""Parity of a diffusion training run: FLAME against PyTorch, the same model trained side by
side (issue 22, "Parity with PyTorch").

    python -m bench.diffusion_parity --model unet|dit --size tiny|demo|full [--steps 200]
        [--batch N] [--image S] [--out DIR] [--backend cuda|reference] [--torch-compile]

Both frameworks start from the same weights (PyTorch's initialisation, written to
``initial.safetensors`` and loaded by FLAME) and see the same batches of the example's digits
(grey, repeated to 3 channels), timesteps, noise and label dropout: drawn once per step in
NumPy from ``--seed`` and fed to both, so neither framework's RNG matters. The UNet's dropout
is set to 0 on both sides (its masks would be each framework's own). FLAME trains with the
example's ``Trainer`` (bench/diffusion.py's ``flame_trainer``) and a compiled step that is
``Trainer.train_step`` with the draws as inputs; PyTorch with bench/diffusion.py's
``TorchStep`` given the same draws (eager, or torch.compile of the loss with
``--torch-compile``). Both: MSE on eps, linear schedule, AdamW (weight decay 0), a linear
learning-rate warm-up, gradient clipping at norm 1, an EMA with the example's warmed-up decay,
bfloat16 autocast on the GPU (``--fp32`` turns it off; on the CPU it is off).

Reported (``parity.json``, ``parity.md``, ``loss.png``; sample grids ``samples_*.png``):

- step 1: both losses, and every parameter's gradient at the initial weights on batch 1
  (max |difference| / max |PyTorch's|, the worst 5 names). The models start with zero output
  layers, so step 1's output is 0 and its gradient reaches only the last layer: the same
  gradient comparison is repeated at the end with PyTorch's trained weights loaded into both,
  where every parameter has a gradient.
- the loss curves, and whether they agree "within their noise": each curve smoothed by an
  EMA (span ``SPAN`` steps); over the last ``min(100, steps / 2)`` steps the gap is the mean
  of |smoothed FLAME - smoothed PyTorch| and the noise of a curve the std of (loss - its
  smoothed curve). Within noise: gap <= the smaller noise. Since both see the same draws, the
  paired per-step difference is reported too (mean, std).
- DDIM samples of both EMA models (same noise and labels, guidance ``GUIDANCE``), their mean
  pixel difference, and the example's classifier check (examples/diffusion/data.py) on each.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench import conv_attention as ca
from bench.diffusion import (
    CFG_DROPOUT,
    CHANNELS,
    CLASSES,
    EMA_DECAY,
    GUIDANCE,
    TorchStep,
    flame_trainer,
    torch_model,
)
from bench.diffusion_parity_report import agreement, gradient_report, write

TIMESTEPS, GRAD_CLIP, LOG_EVERY = 1000, 1.0, 10
# --size: (the models' size name, image size, default batch, the example's preset for --lr)
SIZES = {"tiny": ("tiny", 8, 8, "quick"), "demo": ("small", 32, 128, "demo"),
         "full": ("full", 32, 64, "full")}  # fmt: skip


@dataclass
class Setup:
    model: str = "unet"
    size: str = "tiny"
    steps: int = 200
    batch: int | None = None
    image: int | None = None
    lr: float | None = None
    warmup: int | None = None
    seed: int = 0
    backend: str = "reference"
    bf16: bool = False
    torch_compile: bool = False
    sample_steps: int = 50
    samples_per_class: int = 10
    final_gradients: bool = True

    def complete(self) -> Setup:
        """Fill what was not given from ``--size`` (and the example's presets)."""
        from examples.diffusion.train import PRESETS

        _, image, batch, preset = SIZES[self.size]
        self.image, self.batch = self.image or image, self.batch or batch
        self.lr = self.lr or PRESETS[preset]["lr"]
        self.warmup = self.warmup or max(1, self.steps // 10)
        return self

    @property
    def case(self) -> tuple:
        return (self.model, SIZES[self.size][0], self.image, self.batch)


def progress(message: str) -> None:
    print(f"[diffusion_parity] {message}", file=sys.stderr, flush=True)


# --- data and the draws both frameworks share -------------------------------------------------


def digits(image_size: int):
    """The example's digits (train, held out), grey repeated to the models' 3 channels."""
    from examples.diffusion import data as datasets

    train, held_out = datasets.held_out_split(datasets.load_digits(image_size), 0.1, seed=0)
    return tuple(
        datasets.Dataset(np.repeat(part.images, CHANNELS, axis=1), part.labels, part.classes)
        for part in (train, held_out)
    )


def draws(data, step: int, batch: int, seed: int) -> tuple:
    """Step ``step``'s images, labels (10% dropped to the null class), timesteps and noise,
    from a NumPy generator keyed by (seed, step): the same arrays whoever asks."""
    rng = np.random.default_rng([seed, step])
    index = rng.choice(len(data.labels), batch, replace=False)
    images, labels = data.images[index], data.labels[index].copy()
    labels[rng.random(batch) < CFG_DROPOUT] = CLASSES
    t = rng.integers(0, TIMESTEPS, batch, dtype=np.int64)
    return images, labels, t, rng.standard_normal(images.shape, dtype=np.float32)


def no_dropout(model) -> None:
    for module in model.modules():
        if type(module).__name__ == "Dropout":
            module.p = 0.0


def torch_twin(setup: Setup):
    """PyTorch's model (its initial weights are the run's); the twin has no "small" size, so
    --size demo builds "full" with the FLAME model table's "small" arguments."""
    if setup.case[1] != "small":
        return torch_model(setup.case, setup.backend)
    import torch

    from bench.diffusion_models_torch import build_model
    from examples.diffusion.models import _configurations

    torch.manual_seed(0)
    overrides = _configurations(setup.image)[setup.model, "small"]
    model = build_model(setup.model, setup.image, CHANNELS, CLASSES, "full", **overrides)
    return model.to(ca.torch_device(setup.backend))


# --- FLAME ------------------------------------------------------------------------------------


class FlameSide:
    """The example's Trainer with PyTorch's initial weights; its compiled step is
    ``Trainer.train_step`` with the timesteps, noise and dropped labels as inputs."""

    def __init__(self, setup: Setup, weights: Path):
        import flame as fl
        from examples.diffusion.train import Warmup

        self.fl, self.setup = fl, setup
        self.trainer = flame_trainer(setup.case, fl.io.load_file(weights))
        no_dropout(self.trainer.model)
        no_dropout(self.trainer.ema.module)
        for group in self.trainer.optimizer.param_groups:
            group["initial_lr"] = setup.lr
        scheduler = fl.optim.lr_scheduler.LambdaLR(self.trainer.optimizer, Warmup(setup.warmup))
        self.trainer.scheduler = scheduler
        self.compiled = fl.compile(self.train_step)

    def inputs(self, arrays):
        return [self.fl.tensor(array).realize() for array in arrays]

    def loss(self, images, labels, t, noise):
        from examples.diffusion.diffusion import coefficients, q_sample

        fl, trainer = self.fl, self.trainer
        with fl.autocast(dtype=fl.bfloat16, enabled=self.setup.bf16):
            a, s = coefficients(trainer.schedule, t)
            output = trainer.forward_model(q_sample(images, noise, a, s), t, labels)
            return fl.nn.functional.mse_loss(output.float(), noise)

    def train_step(self, images, labels, t, noise):
        trainer = self.trainer
        loss = self.loss(images, labels, t, noise)
        loss.backward()
        norm = self.fl.nn.utils.clip_grad_norm_(trainer.model.parameters(), GRAD_CLIP)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.ema.update_parameters(trainer.model)
        return loss.detach(), norm.detach()

    def gradients(self, arrays) -> tuple[float, dict]:
        """One lazy forward and backward (no update): the loss and every gradient."""
        loss = self.loss(*self.inputs(arrays))
        loss.backward()
        named = dict(self.trainer.model.named_parameters())
        self.fl.realize(loss, *[p.grad for p in named.values() if p.grad is not None])
        grads = {name: to_numpy(p.grad, p.shape) for name, p in named.items()}
        for parameter in named.values():
            parameter.grad = None
        return float(loss.item()), grads

    def step(self, arrays):
        result = self.compiled(*self.inputs(arrays))
        self.trainer.scheduler.step()
        return result

    def read(self, values: list) -> list[float]:
        return self.fl.stack(values).numpy().astype(np.float64).tolist()

    def load(self, weights: Path) -> None:
        self.trainer.model.load_state_dict(self.fl.io.load_file(weights))

    def sample(self, noise, labels) -> tuple[np.ndarray, object]:
        from examples.diffusion.diffusion import Sampler

        fl = self.fl
        sampler = Sampler(self.trainer.ema.module.eval(), self.trainer.schedule, kind="ddim",
                          steps=self.setup.sample_steps, guidance=GUIDANCE,
                          num_classes=CLASSES)  # fmt: skip
        with fl.inference_mode(), fl.autocast(dtype=fl.bfloat16, enabled=self.setup.bf16):
            images = sampler.sample(fl.tensor(noise), fl.tensor(labels)).numpy()
        return np.asarray(images, dtype=np.float32), sampler

    def synchronize(self) -> None:
        self.fl.synchronize()


def to_numpy(grad, shape) -> np.ndarray:
    return np.zeros(shape, np.float32) if grad is None else grad.float().numpy()


# --- PyTorch ----------------------------------------------------------------------------------


class TorchSide(TorchStep):
    """bench/diffusion.py's step with the draws as inputs, the warm-up and the example's EMA."""

    def __init__(self, model, setup: Setup):
        import torch

        from examples.diffusion.train import Warmup

        self.setup = setup
        super().__init__(model, setup.backend, setup.torch_compile)
        del self.ema  # TorchStep's fixed-decay EMA: replaced by the example's warmed-up one
        for group in self.optimizer.param_groups:
            group["lr"] = setup.lr
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, Warmup(setup.warmup))
        self.averaged = torch.optim.swa_utils.AveragedModel(model, avg_fn=torch_ema(EMA_DECAY))

    def inputs(self, arrays):
        return [self.torch.from_numpy(array).to(self.device) for array in arrays]

    def eager_loss(self, images, labels, t, noise):  # bench's, the draws given
        a, s = self.a[t].view(-1, 1, 1, 1), self.s[t].view(-1, 1, 1, 1)
        torch = self.torch
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.setup.bf16):
            output = self.model(a * images + s * noise, t, labels)
        return torch.nn.functional.mse_loss(output.float(), noise)

    def step(self, arrays):
        loss = self.loss(*self.inputs(arrays))
        loss.backward()
        norm = self.torch.nn.utils.clip_grad_norm_(self.params, GRAD_CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.averaged.update_parameters(self.model)
        return loss.detach(), norm.detach()

    def gradients(self, arrays) -> tuple[float, dict]:
        loss = self.eager_loss(*self.inputs(arrays))
        loss.backward()
        grads = {}
        for name, parameter in self.model.named_parameters():
            grad = parameter.grad
            grads[name] = np.zeros(parameter.shape, np.float32) if grad is None else (
                grad.detach().float().cpu().numpy())  # fmt: skip
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.item()), grads

    def read(self, values: list) -> list[float]:
        return self.torch.stack(values).double().cpu().numpy().tolist()

    def sample(self, noise, labels, sampler) -> np.ndarray:
        """DDIM as the example's Sampler._step (eta 0, guided, x0 clipped), its values."""
        torch, device, model = self.torch, self.device, self.averaged.module.eval()
        x, labels = self.inputs([noise, labels])
        null = torch.full_like(labels, CLASSES)
        with torch.inference_mode(), torch.autocast(device, torch.bfloat16, self.setup.bf16):
            for t, h in zip(sampler.timesteps, sampler.per_step_values()):
                h = torch.tensor(h, dtype=torch.float32, device=device)
                steps = torch.full((2 * len(labels),), int(t), device=device)
                doubled = model(torch.cat([x, x]), steps, torch.cat([labels, null]))
                conditional, unconditional = doubled.chunk(2)
                output = (unconditional + h[2] * (conditional - unconditional)).float()
                x0 = ((x - h[1] * output) / h[0]).clamp(-1.0, 1.0)
                x = h[3] * x0 + h[4] * (x - h[0] * x0) / h[1]
        return x.clamp(-1.0, 1.0).float().cpu().numpy()

    def synchronize(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()


def torch_ema(decay: float):
    """examples/diffusion/train.py's ``ema_with_warmup`` in PyTorch."""
    import torch

    def average(averaged, current, num_averaged):
        count = num_averaged.float()
        weight = 1.0 - torch.clamp((1.0 + count) / (10.0 + count), max=decay)
        return averaged + weight * (current - averaged)

    return average


# --- the run ----------------------------------------------------------------------------------


def train(side, data, setup: Setup) -> dict:
    """``setup.steps`` steps; losses and gradient norms read every ``LOG_EVERY`` steps."""
    losses, norms, pending = [], [], []
    side.synchronize()
    began = time.perf_counter()
    first_step_s = None
    for step in range(setup.steps):
        pending.append(side.step(draws(data, step, setup.batch, setup.seed)))
        if first_step_s is None:
            side.synchronize()
            first_step_s = time.perf_counter() - began
        if len(pending) == LOG_EVERY or step == setup.steps - 1:
            losses += side.read([loss for loss, _ in pending])
            norms += side.read([norm for _, norm in pending])
            pending = []
    side.synchronize()
    total = time.perf_counter() - began
    rest = (total - first_step_s) / max(setup.steps - 1, 1)
    return {"losses": losses, "grad_norms": norms, "first_step_s": first_step_s,
            "train_s": total, "ms_per_step_after_first": rest * 1e3}  # fmt: skip


def write_weights(model, path: Path) -> Path:
    from safetensors.torch import save_file

    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path))
    return path


def compare_samples(flame: FlameSide, torch: TorchSide, setup: Setup, data, out: Path) -> dict:
    from examples.diffusion import data as datasets

    labels = np.repeat(np.arange(CLASSES, dtype=np.int64), setup.samples_per_class)
    rng = np.random.default_rng([setup.seed, 1 << 20])
    noise = rng.standard_normal((len(labels), CHANNELS, setup.image, setup.image), np.float32)
    began = time.perf_counter()
    flame_images, sampler = flame.sample(noise, labels)
    middle = time.perf_counter()
    torch_images = torch.sample(noise, labels, sampler)
    ended = time.perf_counter()
    classifier = datasets.fit_classifier(data[0])
    report = {"ddim_steps": len(sampler.timesteps), "guidance": GUIDANCE,
              "images": len(labels), "flame_s": middle - began, "torch_s": ended - middle,
              "mean_abs_pixel_diff": float(np.abs(flame_images - torch_images).mean())}  # fmt: skip
    for key, images in (("flame", flame_images), ("torch", torch_images)):
        report[key] = datasets.quality_report(classifier, images, labels, *data)
        path = out / f"samples_{key}.png"
        datasets.plot_samples(images, setup.samples_per_class, data[0].classes, path)
    return report


def lap(report: dict, name: str) -> None:
    """Wall seconds of the phase ``name`` (since the previous lap)."""
    now = time.perf_counter()
    report["timing_s"][name], report["_lap"] = now - report["_lap"], now


def gradients(flame: FlameSide, torch: TorchSide, arrays) -> dict:
    """Both losses and the per-parameter gradient differences on one batch."""
    flame_loss, flame_grads = flame.gradients(arrays)
    torch_loss, torch_grads = torch.gradients(arrays)
    return {"flame_loss": flame_loss, "torch_loss": torch_loss,
            "rel_diff": abs(flame_loss - torch_loss) / abs(torch_loss),
            "gradients": gradient_report(flame_grads, torch_grads)}  # fmt: skip


def run(setup: Setup, out: Path) -> dict:
    """The whole comparison; writes the weights and the sample grids under ``out``."""
    setup.complete()
    out.mkdir(parents=True, exist_ok=True)
    report = {**ca.environment_info(setup.backend), "setup": asdict(setup), "timing_s": {}}
    clock = report["_lap"] = time.perf_counter()
    data = digits(setup.image)
    if setup.batch > len(data[0].labels):
        raise ValueError(f"--batch {setup.batch}: larger than the {len(data[0].labels)} "
                         "training digits (a batch has no repeats)")  # fmt: skip
    with ca.flame_scope(setup.backend)():
        reference = torch_twin(setup)
        no_dropout(reference)
        flame = FlameSide(setup, write_weights(reference, out / "initial.safetensors"))
        torch = TorchSide(reference, setup)
        lap(report, "build")
        first = draws(data[0], 0, setup.batch, setup.seed)
        progress("step-1 gradients")
        report["step1"] = gradients(flame, torch, first)
        lap(report, "step1_gradients")
        curves = report["curves"] = {}
        for key, side in (("flame", flame), ("torch", torch)):
            progress(f"{key}: {setup.steps} steps")
            curves[key] = train(side, data[0], setup)
            lap(report, f"{key}_train")
        losses = [curves[key]["losses"][0] for key in ("flame", "torch")]
        difference = abs(losses[0] - losses[1])
        report["step1"].update(
            flame_step_loss=losses[0], torch_step_loss=losses[1], abs_diff=difference,
            step_rel_diff=difference / abs(losses[1]),
        )  # fmt: skip
        report["agreement"] = agreement(curves["flame"]["losses"], curves["torch"]["losses"])
        progress("sampling and the classifier check")
        report["samples"] = compare_samples(flame, torch, setup, data, out)
        lap(report, "sampling")
        if setup.final_gradients:  # PyTorch's trained weights into both, then batch 1 again
            progress("gradients at PyTorch's trained weights")
            flame.load(write_weights(reference, out / "final_torch.safetensors"))
            report["final_gradients"] = gradients(flame, torch, first)
            lap(report, "final_gradients")
    report["timing_s"]["total"] = time.perf_counter() - clock
    report["setup"]["out"] = str(out)
    del report["_lap"]
    return report


def parse(argv=None) -> tuple[Setup, Path]:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    add = parser.add_argument
    add("--model", choices=("unet", "dit"), default="unet")
    add("--size", choices=tuple(SIZES), default=None, help="default: full on cuda, else tiny")
    add("--steps", type=int, default=200)
    add("--batch", type=int, help="default: 8 tiny, 128 demo, 64 full")
    add("--image", type=int, help="image side (default: 8 tiny, 32 otherwise)")
    add("--lr", type=float, help="peak learning rate (default: the example's preset's)")
    add("--warmup", type=int, help="warm-up steps (default: steps / 10)")
    add("--seed", type=int, default=0)
    add("--out", type=Path, default=Path("out/diffusion_parity"))
    add("--backend", choices=("cuda", "reference"), default="cuda")
    add("--fp32", action="store_true", help="no bfloat16 autocast on the GPU")
    add("--torch-compile", action="store_true", help="PyTorch's loss under torch.compile")
    add("--sample-steps", type=int, help="DDIM steps (default: 50 cuda, 5 reference)")
    add("--samples-per-class", type=int, default=10)
    add("--no-final-gradients", action="store_true", help="skip the end-of-run gradients")
    arguments = parser.parse_args(argv)
    cuda = arguments.backend == "cuda"
    if arguments.torch_compile and not cuda:
        parser.error("--torch-compile: the GPU only (bench/diffusion.py skips it on the CPU too)")
    if arguments.steps < 1 or arguments.samples_per_class < 1:
        parser.error("--steps and --samples-per-class must be at least 1")
    setup = Setup(model=arguments.model, size=arguments.size or ("full" if cuda else "tiny"),
                  steps=arguments.steps, batch=arguments.batch, image=arguments.image,
                  lr=arguments.lr, warmup=arguments.warmup, seed=arguments.seed,
                  backend=arguments.backend, bf16=cuda and not arguments.fp32,
                  torch_compile=arguments.torch_compile,
                  sample_steps=arguments.sample_steps or (50 if cuda else 5),
                  samples_per_class=arguments.samples_per_class,
                  final_gradients=not arguments.no_final_gradients)  # fmt: skip
    return setup, arguments.out


def main(argv=None) -> int:
    setup, out = parse(argv)
    report = run(setup, out)
    print(write(report, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
