"""Train a class-conditional diffusion model with FLAME, then sample it and judge the samples.

    python -m examples.diffusion.train                          # GPU: the demo preset, minutes
    python -m examples.diffusion.train --quick                  # ~a minute on the CPU
    python -m examples.diffusion.train --preset full --bf16 --out runs/unet   # the paper's UNet
    python -m examples.diffusion.train --out runs/unet --resume --steps 40000
    python -m examples.diffusion.train --out runs/unet --sample --sampler ddpm --guidance 3

The data are scikit-learn's handwritten digits upsampled to 32x32 (or ``--data DIR``, one
subfolder per class). One training step -- the forward pass and the loss at random
timesteps (drawn, with the noise and the label dropout of classifier-free guidance, from a
FLAME generator inside the step), the backward pass, gradient clipping, ``opt.step()`` of
``fl.optim.AdamW`` and ``ema.update_parameters(model)`` -- is a single ``fl.compile``d
function, as a PyTorch user writes it: traced once, then replayed with no Python per
parameter. The learning-rate warm-up is a ``LambdaLR`` stepped between compiled steps (the
step reads the rate from the device: no retrace). Every ``--save-every`` steps a safetensors
checkpoint (model, EMA, optimizer, step, generator and data-order state) is written
atomically to ``--out``; ``--resume`` continues from the last one with the numbers an
uninterrupted run would have had. At the end the EMA weights are sampled (DDPM or DDIM),
and ``loss.png``, ``samples.png`` (one row per class) and ``quality.json`` (how often a
classifier trained on the real digits recognises the class each sample was asked for) are
written to ``--out``. Without a GPU everything runs on FLAME's reference backend.

Data-parallel: ``flame run --nproc-per-node N -m examples.diffusion.train``, ``--batch-size``
images per rank (parallel.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

import flame as fl
import flame.nn as nn
from examples.diffusion import data as datasets
from examples.diffusion import parallel
from examples.diffusion.diffusion import PREDICTIONS, SCHEDULES, Sampler, make_schedule
from examples.diffusion.diffusion import training_loss as diffusion_loss
from flame.optim.swa_utils import AveragedModel

# what --quick and a full run use for every option not given on the command line
QUICK = {"size": "tiny", "image_size": 16, "batch_size": 32, "steps": 80, "warmup": 10,
         "save_every": 40, "sample_steps": 10, "columns": 6, "lr": 2e-3}  # fmt: skip
# the README's GPU run: a few minutes to recognisable digits
DEMO = {"size": "small", "image_size": 32, "batch_size": 128, "steps": 3000, "warmup": 200,
        "save_every": 1000, "sample_steps": 50, "columns": 10, "lr": 5e-4}  # fmt: skip
FULL = {"size": "full", "image_size": 32, "batch_size": 128, "steps": 20000, "warmup": 1000,
        "save_every": 2000, "sample_steps": 50, "columns": 10, "lr": 2e-4}  # fmt: skip
PRESETS = {"quick": QUICK, "demo": DEMO, "full": FULL}
# the options that make a checkpoint's tensors: a checkpoint from other values cannot load
CONFIG_KEYS = ("model", "size", "image_size", "channels", "num_classes", "schedule",
               "prediction")  # fmt: skip


LOG_EVERY = 10  # steps between reads of the losses (each read waits for the device)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used by this run, and why."""


# --- options ----------------------------------------------------------------------------------


def parse_args(argv=None, gpu: bool | None = False) -> argparse.Namespace:
    """The options, with the preset's defaults filled in for a machine with or without a
    GPU (``gpu=None``: left for ``apply_preset``, once the backend is known)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--model", choices=("unet", "dit"), default="unet")
    add("--size", choices=("full", "small", "tiny"), help="model size (default: the preset's)")
    add(
        "--preset",
        choices=tuple(PRESETS),
        help="defaults for every option not given: demo (the default on a GPU: a few minutes), "
        "quick (the default without one: a tiny run of about a minute), full (the paper's "
        "model, 20k steps)",
    )
    add("--data", type=Path, help="a folder with one subfolder of images per class")
    add("--image-size", type=int, help="side of the square images (default 32)")
    add("--channels", type=int, choices=(1, 3), default=1, help="--data: grayscale or RGB")
    add("--batch-size", type=int)
    add("--steps", type=int, help="train until this many steps in all")
    add("--lr", type=float, help="peak learning rate (default 2e-4)")
    add("--warmup", type=int, help="steps of linear learning-rate warm-up")
    add("--weight-decay", type=float, default=0.0)
    add("--grad-clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    add("--ema", type=float, default=0.9999, help="EMA decay, warmed up as (1+n)/(10+n)")
    add("--schedule", choices=SCHEDULES, default="linear")
    add("--prediction", choices=PREDICTIONS, default="eps")
    add("--cfg-dropout", type=float, default=0.1, help="label dropout for guidance")
    add("--bf16", action="store_true", help="forward pass under bfloat16 autocast")
    add("--checkpoint-blocks", action="store_true", help="recompute blocks in the backward")
    add("--out", type=Path, help="run folder (default runs/diffusion-<preset>)")
    add("--save-every", type=int)
    add("--resume", action="store_true", help="continue from the last checkpoint in --out")
    add("--overwrite", action="store_true", help="start afresh in an --out with checkpoints")
    add("--sample", action="store_true", help="only sample from the last checkpoint")
    add("--checkpoint", type=Path, help="the checkpoint for --resume/--sample")
    add("--sampler", choices=("ddpm", "ddim"), default="ddim")
    add(
        "--sample-steps",
        type=int,
        help="sampler steps (default 50, 10 with --quick; DDPM below 1000 walks a respaced chain)",
    )
    add("--guidance", type=float, default=2.0, help="classifier-free guidance scale w")
    add("--columns", type=int, help="samples per class in samples.png")
    add("--seed", type=int, default=0)
    add("--reference", action="store_true", help="run on the reference backend")
    add("--quick", action="store_true", help="--preset quick (replaces a run in --out)")
    add("--no-progress", action="store_true", help="no progress bar")
    options = parser.parse_args(argv)
    return options if gpu is None else apply_preset(options, gpu)


def apply_preset(options: argparse.Namespace, gpu: bool) -> argparse.Namespace:
    """Fill every option not given from the preset (demo on a GPU, quick without one)."""
    if options.quick:
        options.preset = "quick"
    options.preset = options.preset or ("demo" if gpu else "quick")
    options.scratch = options.out is None  # the default folder: a new run replaces the last
    if options.scratch:
        options.out = Path(f"runs/diffusion-{options.preset}")
    for key, value in PRESETS[options.preset].items():
        if getattr(options, key) is None:
            setattr(options, key, value)
    return options


# --- the model, the EMA and the optimizer -----------------------------------------------------


def default_builder(name, image_size, in_channels, num_classes, size, **overrides):
    from examples.diffusion.models import build_model

    return build_model(name, image_size, in_channels, num_classes, size, **overrides)


class Warmup:
    """The learning-rate factor of step ``epoch`` (0-based): linear warm-up over ``steps``
    steps, then 1 (``LambdaLR``'s ``lr_lambda``; a class, not a lambda, so it pickles)."""

    def __init__(self, steps: int):
        self.steps = max(int(steps), 1)

    def __call__(self, epoch: int) -> float:
        return min(1.0, (epoch + 1) / self.steps)


def ema_with_warmup(decay: float):
    """``AveragedModel``'s ``avg_fn`` for an EMA whose decay warms up: ``min(decay, (1 + n) /
    (10 + n))`` after ``n`` updates, so the average does not cling to the first weights for
    the ~1/(1-decay) steps a fixed 0.9999 would need. ``n`` is the model's ``n_averaged``,
    read on the device inside the compiled step (the first update copies, as PyTorch's)."""

    def average(averaged, current, num_averaged):
        count = num_averaged.float()
        weight = 1.0 - fl.clamp((1.0 + count) / (10.0 + count), max=decay)
        return averaged + weight * (current - averaged)

    return average


# --- the run ----------------------------------------------------------------------------------


def load_data(options):
    if options.data is None:
        data = datasets.load_digits(options.image_size)
    else:
        data = datasets.load_folder(options.data, options.image_size, options.channels)
    return datasets.held_out_split(data, 0.1, seed=options.seed)


def run_config(options, train: datasets.Dataset) -> dict:
    return {
        "model": options.model, "size": options.size, "image_size": train.image_size,
        "channels": train.channels, "num_classes": len(train.classes),
        "schedule": options.schedule, "prediction": options.prediction,
        "data": str(options.data) if options.data else "digits", "classes": train.classes,
    }  # fmt: skip


class Trainer:
    """The model, its EMA, the optimizer, the generator and the compiled step of one run."""

    def __init__(self, options, config: dict, builder=None, world=parallel.ONE_PROCESS):
        self.options, self.config, self.world = options, config, world
        fl.manual_seed(options.seed)  # the initial weights
        build = builder or default_builder
        # blocks that recompute their activations in the backward (fl.checkpoint): the
        # models take it as a constructor argument, so it is asked for only when wanted
        overrides = {"checkpoint": True} if options.checkpoint_blocks else {}
        self.model = build(config["model"], config["image_size"], config["channels"],
                           config["num_classes"], config["size"], **overrides)  # fmt: skip
        self.ema = AveragedModel(self.model, avg_fn=ema_with_warmup(options.ema))
        self.ema.requires_grad_(False)
        self.optimizer = fl.optim.AdamW(
            self.model.parameters(), lr=options.lr, weight_decay=options.weight_decay
        )
        # the warm-up: a schedule stepped after each compiled step; the step reads the rate
        # from the device (flame/optim/lr_scheduler.py), so a new rate is no retrace
        self.scheduler = fl.optim.lr_scheduler.LambdaLR(self.optimizer, Warmup(options.warmup))
        self.generator = fl.Generator().manual_seed(options.seed + 1)
        parallel.own_streams(world, self.generator, fl.random.default_generator)
        self.schedule = make_schedule(config["schedule"])
        self.step, self.losses = 0, []
        self.forward_model, self.compiled = self.model, None  # prepare() sets both

    def prepare(self) -> None:
        """Wrap the model for data-parallel training (rank 0's weights to every rank) and
        build the compiled step (after any checkpoint load: a load writes into the tensors
        the step reads)."""
        self.forward_model = parallel.wrap(self.model, self.world)
        self.compiled = fl.compile(self.train_step) if self.world.compiles else self.train_step

    def run_step(self, images, labels):
        """One compiled step, then the schedule's step (outside it, as in PyTorch)."""
        result = self.compiled(images, labels)
        self.scheduler.step()
        return result

    def train_step(self, images, labels):
        """One whole training step; traced once by ``fl.compile``, then replayed."""
        options = self.options
        with fl.autocast(dtype=fl.bfloat16, enabled=options.bf16):
            loss = diffusion_loss(
                self.forward_model, images, labels, self.schedule, prediction=options.prediction,
                cfg_dropout=options.cfg_dropout, num_classes=self.config["num_classes"],
                generator=self.generator,
            )  # fmt: skip
        loss.backward()
        if options.grad_clip > 0:
            norm = nn.utils.clip_grad_norm_(self.model.parameters(), options.grad_clip)
        else:
            norm = fl.zeros(())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # no gradient leaves the program
        self.ema.update_parameters(self.model)
        return loss.detach(), norm.detach()

    # --- checkpoints ---

    def save(self, directory: Path, loader: datasets.BatchLoader) -> Path:
        """Write ``ckpt-<step>.safetensors`` atomically (FLAME writes beside the name, then
        renames): a run killed mid-write leaves the previous checkpoint as the last one."""
        from flame.io import save_checkpoint

        path = directory / f"ckpt-{self.step:08d}.safetensors"
        extra = {
            "config": self.config,
            "generator": [int(v) for v in self.generator.get_state().numpy()],
            "data": loader.state_dict(),
            "losses": [float(v) for v in self.losses],
        }
        save_checkpoint(path, model=self.model, ema=self.ema, optimizer=self.optimizer,
                        step=self.step, rng=True, extra=extra)  # fmt: skip
        return path

    def load(self, path: Path, loader: datasets.BatchLoader | None) -> None:
        from flame.io import load_checkpoint

        check_config(path, self.config)
        try:
            state = load_checkpoint(path, model=self.model, ema=self.ema, optimizer=self.optimizer)
        except Exception as error:  # a shape mismatch the config check did not catch
            message = f"cannot load checkpoint {path} into this model: {error}"
            raise CheckpointError(message) from error
        extra = state["extra"]
        self.step = int(state["step"])
        # the warm-up is a function of the step: the schedule is put there, not saved
        self.scheduler.last_epoch = self.step - 1
        self.scheduler.step()
        self.losses = list(extra.get("losses", []))
        self.generator.set_state(np.array(extra["generator"], dtype=np.int64))
        parallel.own_streams(self.world, self.generator, fl.random.default_generator)
        if loader is not None:
            loader.load_state_dict(extra["data"])


def read_config(path: Path) -> dict:
    """The run configuration stored in a checkpoint, read from its header only."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as handle:
            metadata = handle.metadata() or {}
    except Exception as error:
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({type(error).__name__}: {error}); it may be "
            "truncated or not a safetensors file. Delete it to resume from an earlier one."
        ) from error
    try:
        return json.loads(metadata["flame.extra"])["config"]
    except (KeyError, ValueError, TypeError) as error:
        raise CheckpointError(f"{path} is not a checkpoint of this example (no run "
                              "configuration in its metadata)") from error  # fmt: skip


def check_config(path: Path, config: dict) -> None:
    saved = read_config(path)
    different = [key for key in CONFIG_KEYS if saved.get(key) != config.get(key)]
    if different:
        described = ", ".join(f"{key}: {saved.get(key)!r} there, {config.get(key)!r} here"
                              for key in different)  # fmt: skip
        raise CheckpointError(
            f"checkpoint {path} was written by a run with another configuration ({described}); "
            "use the same options, or another --out for a new run"
        )


def last_checkpoint(directory: Path) -> Path | None:
    """The newest complete checkpoint in ``directory`` (temporary ``.partial`` files of an
    interrupted write never carry the final name)."""
    found = sorted(directory.glob("ckpt-*.safetensors")) if directory.is_dir() else []
    return found[-1] if found else None


def clear_checkpoints(directory: Path, allowed: bool, remove: bool = True) -> None:
    """A fresh run must not mix its checkpoints with an earlier run's: it removes them when
    allowed (``--overwrite``, ``--quick``; every rank checks, only rank 0 ``remove``s) and
    refuses otherwise."""
    found = sorted(directory.glob("ckpt-*.safetensors"))
    if found and not allowed:
        raise CheckpointError(
            f"{directory} already holds checkpoints of an earlier run (last: {found[-1].name}); "
            "pass --resume to continue it, --overwrite to start afresh, or another --out"
        )
    for path in found if remove else ():
        path.unlink()


# --- training ---------------------------------------------------------------------------------


def train(options, builder=None, world=parallel.ONE_PROCESS) -> dict:
    """Train (every rank), then plot, sample and judge (rank 0, the others wait for it)."""
    train_data, held_out = load_data(options)
    config = run_config(options, train_data)
    options.out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(options, config, builder, world)
    loader = datasets.BatchLoader(train_data, options.batch_size, seed=options.seed,
                                  rank=world.rank, world_size=world.world_size)  # fmt: skip
    if options.resume:
        path = options.checkpoint or last_checkpoint(options.out)
        if path is None:
            raise CheckpointError(f"--resume: no checkpoint in {options.out}")
        trainer.load(path, loader)
        if world.is_main:
            print(f"resumed from {path} at step {trainer.step}")
    else:
        allowed = options.overwrite or options.quick or options.scratch
        clear_checkpoints(options.out, allowed, remove=world.is_main)
    trainer.prepare()
    try:
        timing = run_steps(trainer, loader, options)
    finally:
        loader.close()
    summary = {"steps": trainer.step, "final_loss": _final_loss(trainer.losses), **timing,
               "agreement": None, "classifier_heldout_accuracy": None}  # fmt: skip
    if world.is_main:
        datasets.plot_losses(trainer.losses, options.out / "loss.png")
        quality = sample_and_judge(trainer, train_data, held_out, options)
        for key in ("agreement", "classifier_heldout_accuracy"):
            summary[key] = quality[key]
        print_summary(summary, options.out)
    parallel.barrier(world)
    return summary


def run_steps(trainer: Trainer, loader, options) -> dict:
    """The training loop: compiled steps, the losses read back every ``LOG_EVERY`` steps
    (a read waits for the device), a checkpoint every ``--save-every`` steps."""
    from tqdm import tqdm

    world = trainer.world
    bar = tqdm(total=options.steps, initial=trainer.step, unit="step", dynamic_ncols=True,
               disable=options.no_progress or not world.is_main)  # fmt: skip
    meter, pending = parallel.Throughput(options.batch_size, world), []
    for index in range(trainer.step, options.steps):
        images, labels = next(loader)
        clock = time.perf_counter()
        loss, _ = trainer.run_step(images, labels)
        meter.stepped(clock, loss)
        pending.append(loss)
        trainer.step = index + 1
        saving = trainer.step % options.save_every == 0 or trainer.step == options.steps
        if len(pending) == LOG_EVERY or saving:
            losses = parallel.mean_over_ranks(fl.stack(pending), world)
            trainer.losses += losses.numpy().tolist()
            pending = []
            rate = meter.images_per_s()
            bar.set_postfix(loss=f"{trainer.losses[-1]:.4f}", img_s=f"{rate or 0:.1f}")
        bar.update(1)
        if saving and world.is_main:
            clock = time.perf_counter()
            trainer.save(options.out, loader)
            meter.paused_s += time.perf_counter() - clock
    bar.close()
    fl.synchronize()
    return {"first_step_s": meter.first_step_s, "images_per_s": meter.images_per_s()}


def _final_loss(losses: list) -> float | None:
    """The mean of the last ten losses: one step's loss is as noisy as its timesteps."""
    return float(np.mean(losses[-10:])) if losses else None


# --- sampling and the quality check ---------------------------------------------------------------


def sample_and_judge(trainer: Trainer, train_data, held_out, options) -> dict:
    """Sample ``--columns`` images per class from the EMA weights, write ``samples.png`` and
    ``quality.json``; returns the quality report."""
    config = trainer.config
    classes = config["num_classes"]
    labels = np.repeat(np.arange(classes, dtype=np.int64), options.columns)
    model = trainer.ema.module.eval()
    generator = fl.Generator().manual_seed(options.seed + 2)  # samples independent of training
    sampler = Sampler(model, trainer.schedule, kind=options.sampler, steps=options.sample_steps,
                      prediction=config["prediction"], guidance=options.guidance,
                      num_classes=classes, generator=generator)  # fmt: skip
    shape = (len(labels), config["channels"], config["image_size"], config["image_size"])
    noise = fl.randn(*shape, generator=generator)
    began = time.perf_counter()
    images = sampler.sample(noise, fl.tensor(labels)).numpy().copy()
    sampling_s = time.perf_counter() - began
    datasets.plot_samples(images, options.columns, config["classes"], options.out / "samples.png")
    classifier = datasets.fit_classifier(train_data)
    report = datasets.quality_report(classifier, images, labels, train_data, held_out)
    report.update({"sampler": options.sampler, "sample_steps": len(sampler.timesteps),
                   "guidance": options.guidance, "sampling_s": sampling_s,
                   "step": trainer.step})  # fmt: skip
    (options.out / "quality.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def print_summary(summary: dict, out: Path) -> None:
    def number(value, form):
        return "n/a" if value is None else format(value, form)

    print(
        f"steps {summary['steps']}  final loss {number(summary['final_loss'], '.4f')}  "
        f"{number(summary['images_per_s'], '.1f')} images/s  "
        f"first step {number(summary['first_step_s'], '.2f')} s"
    )
    print(
        f"class agreement of the samples {number(summary['agreement'], '.3f')} (the same "
        f"classifier on real held-out images: "
        f"{number(summary['classifier_heldout_accuracy'], '.3f')})"
    )
    print(f"wrote {out}/loss.png, {out}/samples.png, {out}/quality.json")


def sample_only(options, builder=None) -> dict:
    """``--sample``: the model configuration comes from the checkpoint."""
    path = options.checkpoint or last_checkpoint(options.out)
    if path is None:
        raise CheckpointError(f"--sample: no checkpoint in {options.out}")
    saved = read_config(path)
    for key in ("model", "size", "image_size", "channels", "schedule", "prediction"):
        setattr(options, key, saved[key])
    if saved["data"] != "digits":
        options.data = Path(saved["data"])
    train_data, held_out = load_data(options)
    trainer = Trainer(options, run_config(options, train_data), builder)
    trainer.load(path, None)
    report = sample_and_judge(trainer, train_data, held_out, options)
    print(f"step {trainer.step}: class agreement {report['agreement']:.3f} (classifier on real "
          f"held-out images: {report['classifier_heldout_accuracy']:.3f})")  # fmt: skip
    return report


def main(argv=None, builder=None):
    """Parse ``argv``, choose the backend (the GPU where there is one), join the other ranks
    when launched (flame run, torchrun), and run. ``builder`` replaces ``build_model``."""
    options = parse_args(argv, gpu=None)
    backend, world = parallel.start(options.reference)
    apply_preset(options, backend == "cuda")
    with fl.backend(backend), parallel.failing_together(world):
        if options.sample:  # rank 0 alone, when launched
            return sample_only(options, builder) if world.is_main else None
        return train(options, builder, world)


if __name__ == "__main__":
    main()
