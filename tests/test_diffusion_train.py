"""The diffusion example's training program (examples/diffusion): schedules, the forward
process and its parameterisations, the samplers on a denoiser whose answer is known, the
compiled training step against lazy steps, and whole runs (outputs, resume,
broken checkpoints, broken data folders) with a small stand-in model. Reference backend."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

import flame as fl
import flame.nn as nn
import flame.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the examples are not an installed package
    sys.path.insert(0, str(ROOT))

from examples.diffusion import diffusion  # noqa: E402

_MISSING = [
    name for name in ("sklearn", "PIL", "matplotlib", "tqdm")
    if importlib.util.find_spec(name) is None
]  # fmt: skip
needs_example_packages = pytest.mark.skipif(
    bool(_MISSING),
    reason=f"the diffusion example needs {', '.join(_MISSING)} (scikit-learn, Pillow, "
    "matplotlib, tqdm)",
)


# --- a small stand-in denoiser -----------------------------------------------------------------


class StandInBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.GroupNorm(4, width)
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.shift = nn.Linear(width, width)

    def forward(self, h, embedding):
        return h + self.conv(F.silu(self.norm(h) + self.shift(embedding)[:, :, None, None]))


class StandIn(nn.Module):
    """The models' calling convention (``model(x, t, y)``, label ``num_classes`` the null
    class) in a few thousand parameters, so the runs below take seconds."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 8):
        super().__init__()
        half = 4
        frequencies = np.exp(-math.log(1000.0) * np.arange(half) / half).astype(np.float32)
        self.register_buffer("frequencies", fl.tensor(frequencies))
        self.time = nn.Linear(2 * half, width)
        self.label = nn.Embedding(num_classes + 1, width)
        self.stem = nn.Conv2d(in_channels, width, 3, padding=1)
        self.blocks = nn.ModuleList([StandInBlock(width), StandInBlock(width)])
        self.head = nn.Conv2d(width, in_channels, 3, padding=1)

    def forward(self, x, t, y=None):
        angles = t.float()[:, None] * self.frequencies[None]
        embedding = F.silu(self.time(fl.cat([angles.sin(), angles.cos()], dim=1)))
        if y is not None:
            embedding = embedding + self.label(y)
        h = self.stem(x)
        for block in self.blocks:
            h = block(h, embedding)
        return self.head(F.silu(h))


def stand_in_builder(name, image_size, in_channels, num_classes, size, **overrides):
    return StandIn(in_channels, num_classes)


class KnownDenoiser(nn.Module):
    """The exact noise predictor of data that is one image per class: with ``x_t = a x* +
    s eps``, ``eps = (x_t - a x*) / s``. Every sampler must end on ``x*``."""

    def __init__(self, schedule, targets: np.ndarray):
        super().__init__()
        self.schedule = schedule
        self.targets = fl.tensor(targets.astype(np.float32)).realize()  # [classes + 1, C, H, W]

    def forward(self, x, t, y=None):
        a, s = diffusion.coefficients(self.schedule, t)
        return (x - a * fl.index_select(self.targets, 0, y)) / s


# --- schedules and parameterisations -----------------------------------------------------------


def test_linear_schedule_endpoints(reference_backend):
    schedule = diffusion.make_schedule("linear")
    assert schedule.timesteps == 1000
    assert schedule.betas[0] == pytest.approx(1e-4) and schedule.betas[-1] == pytest.approx(0.02)
    assert schedule.alphas_cumprod[0] == pytest.approx(1 - 1e-4)
    expected_last = np.prod(1 - np.linspace(1e-4, 0.02, 1000))
    assert schedule.alphas_cumprod[-1] == pytest.approx(expected_last, rel=1e-9)
    assert 4.0e-5 < schedule.alphas_cumprod[-1] < 4.1e-5  # DDPM's end: nearly pure noise
    assert np.all(np.diff(schedule.alphas_cumprod) < 0)
    np.testing.assert_allclose(
        schedule.sqrt_alphas_cumprod.numpy() ** 2, schedule.alphas_cumprod, rtol=1e-5
    )


def test_cosine_schedule_follows_its_formula(reference_backend):
    schedule = diffusion.make_schedule("cosine")
    steps = np.arange(1, 1001) / 1000
    offset = 0.008
    formula = np.cos((steps + offset) / (1 + offset) * np.pi / 2) ** 2
    formula /= np.cos(offset / (1 + offset) * np.pi / 2) ** 2
    unclipped = schedule.betas < 0.999  # only the last steps reach the clip
    assert unclipped[:990].all()
    np.testing.assert_allclose(schedule.alphas_cumprod[unclipped], formula[unclipped], rtol=1e-9)
    assert schedule.betas.max() == pytest.approx(0.999)


def test_unknown_schedule_and_prediction_are_named(reference_backend):
    with pytest.raises(ValueError, match="unknown noise schedule 'quadratic'"):
        diffusion.make_schedule("quadratic")
    with pytest.raises(ValueError, match="unknown prediction 'x0'"):
        diffusion.training_target("x0", None, None, None, None)


def test_q_sample_and_the_conversions_round_trip(reference_backend, rng):
    schedule = diffusion.make_schedule("cosine")
    x0 = fl.tensor(rng.uniform(-1, 1, (5, 2, 4, 4)).astype(np.float32))
    noise = fl.tensor(rng.standard_normal((5, 2, 4, 4)).astype(np.float32))
    t = fl.tensor(np.array([0, 1, 500, 998, 999], dtype=np.int64))
    a, s = diffusion.coefficients(schedule, t)
    x_t = diffusion.q_sample(x0, noise, a, s)
    a_host = np.sqrt(schedule.alphas_cumprod[[0, 1, 500, 998, 999]])[:, None, None, None]
    expected = a_host * x0.numpy() + np.sqrt(1 - a_host**2) * noise.numpy()
    np.testing.assert_allclose(x_t.numpy(), expected, rtol=1e-5, atol=1e-6)
    v = diffusion.training_target("v", x0, noise, a, s)
    for prediction, output in (("eps", noise), ("v", v)):
        got_x0, got_eps = diffusion.to_x0_eps(prediction, output, x_t, a, s)
        np.testing.assert_allclose(got_eps.numpy(), noise.numpy(), rtol=1e-4, atol=1e-4)
        if prediction == "v":  # from eps, x0 at t = 999 divides by a ~ 0.006
            np.testing.assert_allclose(got_x0.numpy(), x0.numpy(), rtol=1e-4, atol=1e-4)
    eps_x0, _ = diffusion.to_x0_eps("eps", noise, x_t, a, s)
    np.testing.assert_allclose(eps_x0.numpy()[:3], x0.numpy()[:3], rtol=1e-4, atol=1e-4)


# --- samplers ---------------------------------------------------------------------------------


def _known_sampling(kind: str, steps: int, rng, guidance: float = 1.0):
    schedule = diffusion.make_schedule("linear")
    targets = rng.uniform(-0.9, 0.9, (3, 1, 4, 4))  # classes 0, 1 and the null class 2
    model = KnownDenoiser(schedule, targets)
    generator = fl.Generator().manual_seed(5)
    sampler = diffusion.Sampler(model, schedule, kind=kind, steps=steps, guidance=guidance,
                                num_classes=2, generator=generator)  # fmt: skip
    labels = fl.tensor(np.array([0, 1, 1], dtype=np.int64))
    noise = fl.tensor(rng.standard_normal((3, 1, 4, 4)).astype(np.float32)).realize()
    return sampler, noise, labels, targets[[0, 1, 1]]


def test_ddim_1000_steps_is_deterministic_and_ends_on_the_data(reference_backend, rng):
    sampler, noise, labels, expected = _known_sampling("ddim", 1000, rng)
    first = sampler.sample(noise, labels).numpy().copy()
    second = sampler.sample(noise, labels).numpy().copy()
    np.testing.assert_array_equal(first, second)  # eta = 0: no randomness at all
    np.testing.assert_allclose(first, expected, atol=1e-4)
    assert len(sampler.timesteps) == 1000 and sampler.timesteps[0] == 999
    info = sampler.step.cache_info()
    assert info.traces == 1, info.reasons  # t and the coefficients are data, not code


def test_ddpm_and_strided_ddim_with_guidance_end_on_the_data(reference_backend, rng):
    for kind, steps in (("ddpm", 25), ("ddim", 10)):
        sampler, noise, labels, expected = _known_sampling(kind, steps, rng, guidance=3.0)
        result = sampler.sample(noise, labels).numpy()
        # guidance pushes past the class image by w - 1 times its distance from the null
        # class's, exactly so for this denoiser, until x0's clip to [-1, 1]
        null = sampler.model.targets.numpy()[2]
        pushed = np.clip(expected + 2.0 * (expected - null), -1.0, 1.0)
        np.testing.assert_allclose(result, pushed, atol=1e-3)


def test_generators_advance_at_every_compiled_call(reference_backend):
    generator = fl.Generator().manual_seed(3)
    draw = fl.compile(lambda x: x + fl.randn(4, generator=generator))
    zero = fl.zeros(4)
    calls = [draw(zero).numpy().copy() for _ in range(3)]
    assert not np.allclose(calls[0], calls[1]) and not np.allclose(calls[1], calls[2])
    generator.manual_seed(3)
    lazy = [fl.randn(4, generator=generator).numpy().copy() for _ in range(3)]
    np.testing.assert_allclose(np.stack(calls), np.stack(lazy), rtol=1e-6)
    assert draw.cache_info().traces == 1


# --- the compiled step against lazy steps --------------------------------------------------------


def test_compiled_step_matches_lazy_adamw_clip_and_ema(reference_backend, rng):
    """The example's compiled step (AdamW's opt.step(), clipping and the EMA's
    update_parameters inside fl.compile; the warm-up a LambdaLR stepped between calls)
    against the same done lazily, by hand where it can be: the warm-up rate, the EMA's first
    update a copy and then a lerp with the warmed-up decay."""
    from examples.diffusion import train

    options = train.parse_args(
        ["--quick", "--lr", "0.01", "--warmup", "3", "--weight-decay", "0.1",
         "--grad-clip", "0.5", "--ema", "0.9", "--prediction", "v"]
    )  # fmt: skip
    config = {"model": "unet", "size": "tiny", "image_size": 8, "channels": 1,
              "num_classes": 3, "schedule": "linear", "prediction": "v"}  # fmt: skip
    x = fl.tensor(rng.uniform(-1, 1, (4, 1, 8, 8)).astype(np.float32)).realize()
    y = fl.tensor(np.array([0, 1, 2, 1], dtype=np.int64)).realize()
    compiled = train.Trainer(options, config, stand_in_builder)
    compiled.prepare()
    compiled_losses, rates = [], []
    for _ in range(5):
        rates.append(compiled.optimizer.param_groups[0]["lr"])
        compiled_losses.append(compiled.run_step(x, y)[0].item())
    assert compiled.compiled.cache_info().traces == 1, compiled.compiled.cache_info().reasons
    np.testing.assert_allclose(rates, [0.01 / 3, 0.02 / 3, 0.01, 0.01, 0.01], rtol=1e-12)

    lazy = train.Trainer(options, config, stand_in_builder)
    lazy_losses = []
    for count in range(5):
        for group in lazy.optimizer.param_groups:
            group["lr"] = 0.01 * min(1.0, (count + 1) / 3)
        loss = diffusion.training_loss(
            lazy.model, x, y, lazy.schedule, prediction="v", cfg_dropout=0.1, num_classes=3,
            generator=lazy.generator,
        )  # fmt: skip
        loss.backward()
        nn.utils.clip_grad_norm_(lazy.model.parameters(), 0.5)
        lazy_losses.append(loss.item())
        lazy.optimizer.step()
        lazy.optimizer.zero_grad()
        weight = 1.0 if count == 0 else 1.0 - min(0.9, (1 + count) / (10 + count))
        with fl.no_grad():
            for averaged, current in zip(lazy.ema.module.parameters(), lazy.model.parameters()):
                averaged.copy_((averaged + (current - averaged) * weight).realize())
    np.testing.assert_allclose(compiled_losses, lazy_losses, rtol=1e-5)
    pairs = [(compiled.model, lazy.model), (compiled.ema.module, lazy.ema.module)]
    for mine, theirs in pairs:
        for a, b in zip(mine.parameters(), theirs.parameters()):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)
    first = next(iter(compiled.model.parameters()))
    assert float(compiled.optimizer.state[first]["step"].item()) == 5
    assert compiled.ema.n_averaged.item() == 5


# --- whole runs ---------------------------------------------------------------------------------


def _arguments(out: Path, *more: str) -> list[str]:
    return ["--reference", "--size", "tiny", "--image-size", "8", "--batch-size", "16",
            "--lr", "2e-3", "--warmup", "2", "--sample-steps", "3", "--columns", "2",
            "--out", str(out), "--no-progress", *more]  # fmt: skip


def _extra(path: Path) -> dict:
    """The JSON values a checkpoint keeps beside its tensors."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as handle:
        return json.loads(handle.metadata()["flame.extra"])


def _run(out: Path, *more: str):
    from examples.diffusion import train

    return train.main(_arguments(out, *more), builder=stand_in_builder)


@needs_example_packages
def test_a_short_run_learns_and_writes_its_outputs(tmp_path):
    summary = _run(tmp_path, "--steps", "30", "--save-every", "15")
    from examples.diffusion.train import last_checkpoint

    names = sorted(path.name for path in tmp_path.iterdir())
    assert names == ["ckpt-00000015.safetensors", "ckpt-00000030.safetensors", "loss.png",
                     "quality.json", "samples.png"]  # fmt: skip
    assert last_checkpoint(tmp_path).name == "ckpt-00000030.safetensors"
    state = fl.load_file(tmp_path / "ckpt-00000030.safetensors", device="cpu")
    assert "optimizer.state.0.exp_avg" in state and "ema.n_averaged" in state
    quality = json.loads((tmp_path / "quality.json").read_text())
    assert quality["samples"] == 20 and set(quality["per_class"]) == {str(k) for k in range(10)}
    assert quality["classifier_heldout_accuracy"] > 0.9  # the judge itself is sound
    assert summary["steps"] == 30 and summary["images_per_s"] > 0
    losses = _extra(tmp_path / "ckpt-00000030.safetensors")["losses"]
    assert len(losses) == 30 and np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])


@needs_example_packages
def test_resume_gives_the_uninterrupted_run(tmp_path):
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    _run(straight, "--steps", "8", "--save-every", "4", "--bf16")
    _run(halves, "--steps", "4", "--save-every", "4", "--bf16")
    _run(halves, "--steps", "8", "--save-every", "4", "--bf16", "--resume")
    one = fl.load_file(straight / "ckpt-00000008.safetensors", device="cpu")
    two = fl.load_file(halves / "ckpt-00000008.safetensors", device="cpu")
    assert set(one) == set(two)
    for name in one:
        np.testing.assert_array_equal(one[name].numpy(), two[name].numpy(), err_msg=name)
    ends = [_extra(run / "ckpt-00000008.safetensors") for run in (straight, halves)]
    assert ends[0] == ends[1]  # losses, generator and data order
    # --sample from the finished run needs no other option
    from examples.diffusion import train

    report = train.main(["--reference", "--sample", "--out", str(halves), "--sample-steps", "2",
                         "--columns", "1", "--no-progress"], builder=stand_in_builder)  # fmt: skip
    assert report["step"] == 8 and report["samples"] == 10


@needs_example_packages
def test_broken_and_foreign_checkpoints_are_refused_clearly(tmp_path):
    from examples.diffusion.train import CheckpointError

    _run(tmp_path, "--steps", "2", "--save-every", "2", "--sample-steps", "1", "--columns", "1")
    with pytest.raises(CheckpointError, match="configuration .*prediction: 'eps' there, 'v'"):
        _run(tmp_path, "--steps", "4", "--resume", "--prediction", "v")
    with pytest.raises(CheckpointError, match="already holds checkpoints .*--resume"):
        _run(tmp_path, "--steps", "4")
    path = tmp_path / "ckpt-00000002.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        _run(tmp_path, "--steps", "4", "--resume")


# --- data -------------------------------------------------------------------------------------


@needs_example_packages
def test_data_folders_explain_what_is_wrong(tmp_path):
    from PIL import Image

    from examples.diffusion.data import DataError, load_folder

    (tmp_path / "cats").mkdir()
    (tmp_path / "dogs").mkdir()
    (tmp_path / "cats" / "notes.txt").write_text("not an image")
    with pytest.raises(DataError, match="no images found .*<class name>/<image file>"):
        load_folder(tmp_path, 8)
    pixels = np.arange(100, dtype=np.uint8).reshape(10, 10)
    Image.fromarray(pixels).save(tmp_path / "cats" / "gray.png")
    Image.fromarray(np.stack([pixels] * 4, -1)).save(tmp_path / "dogs" / "a.png")
    Image.fromarray(pixels).convert("P").save(tmp_path / "dogs" / "palette.gif")
    (tmp_path / "dogs" / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(DataError, match="(?s)1 unreadable image file in .*broken.png .Unident"):
        load_folder(tmp_path, 8)
    (tmp_path / "dogs" / "broken.png").unlink()
    for channels in (1, 3):
        data = load_folder(tmp_path, 8, channels)
        assert data.images.shape == (3, channels, 8, 8) and data.classes == ["cats", "dogs"]
        assert list(data.labels) == [0, 1, 1]
        assert -1.0 <= data.images.min() and data.images.max() <= 1.0


@needs_example_packages
def test_batches_resume_where_they_stopped(reference_backend):
    from examples.diffusion.data import BatchLoader, Dataset

    count = 10
    images = np.arange(count, dtype=np.float32).reshape(count, 1, 1, 1)
    data = Dataset(images, np.arange(count, dtype=np.int64), ["x"])
    loader = BatchLoader(data, batch_size=3, seed=7)
    seen = [next(loader)[1].numpy().tolist() for _ in range(4)]  # epoch 0 (3 batches), then 1
    assert len(set(sum(seen[:3], []))) == 9  # no image twice in an epoch
    state = loader.state_dict()
    following = [next(loader)[1].numpy().tolist() for _ in range(5)]
    loader.close()
    again = BatchLoader(data, batch_size=3, seed=7)
    again.load_state_dict(state)
    assert [next(again)[1].numpy().tolist() for _ in range(5)] == following
    again.close()


@needs_example_packages
@pytest.mark.parametrize("model", ["unet", "dit"])
def test_the_real_tiny_models_train_with_recomputed_blocks(tmp_path, model):
    pytest.importorskip("examples.diffusion.models", reason="examples/diffusion/models.py")
    from examples.diffusion import train

    more = ["--model", model, "--steps", "2", "--save-every", "2", "--checkpoint-blocks"]
    summary = train.main(_arguments(tmp_path, *more, "--columns", "1", "--sample-steps", "1"))
    assert summary["steps"] == 2 and np.isfinite(summary["final_loss"])
