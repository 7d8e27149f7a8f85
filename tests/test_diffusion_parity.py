"""bench/diffusion_parity.py: FLAME and PyTorch train the tiny UNet and DiT side by side from
the same weights and draws (reference backend against PyTorch on the CPU, float32); and the
measures the bench reports (bench/diffusion_parity_report.py: gradient differences, the
curves' agreement) and the draws both frameworks share.

Bounds of the runs, float32, 10 steps (measured on the tiny models: step-1 loss 1e-7,
per-step losses <= 2e-6, gradients at trained weights <= 2e-6, sample pixels 5e-7): the
per-step relative loss difference must stay below ``CURVE_BOUND`` = 1e-4, ~50x above what
float32 rounding gives after 10 AdamW steps, and ~10x below what a real mismatch gives: a
learning rate 1% off on one side reaches 1e-3 within 10 steps
(``test_the_bound_catches_a_learning_rate_off_by_one_percent``)."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

import bench.diffusion_parity as parity
from bench import diffusion_parity_report as measures
from examples.diffusion.data import Dataset

LOSS_TOLERANCE = 1e-6  # step 1, float32: the mean of 8 x 3 x 8 x 8 squares, summed in two orders
GRADIENT_TOLERANCE = 1e-4  # max |diff| / max |PyTorch's|, per parameter
CURVE_BOUND = 1e-4  # per-step |loss FLAME - loss PyTorch| / loss PyTorch (module doc)
STEPS = 10

_MISSING = [name for name in ("sklearn", "PIL", "matplotlib")
            if importlib.util.find_spec(name) is None]  # fmt: skip
needs_example_packages = pytest.mark.skipif(
    bool(_MISSING), reason=f"the diffusion example needs {', '.join(_MISSING)}"
)


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="the parity run trains the PyTorch twin")


def tiny_run(model: str, out, steps: int = STEPS, extra=()) -> dict:
    argv = ["--backend", "reference", "--model", model, "--size", "tiny", "--out", str(out),
            "--steps", str(steps), "--sample-steps", "2", "--samples-per-class", "1",
            *extra]  # fmt: skip
    assert parity.main(argv) == 0
    return json.loads((out / "parity.json").read_text())


@pytest.mark.slow
@needs_example_packages
@pytest.mark.parametrize("model", ["unet", "dit"])
def test_tiny_model_trains_as_in_pytorch(torch, tmp_path, model):
    report = tiny_run(model, tmp_path)
    step1, curves = report["step1"], report["curves"]
    # the compiled (FLAME) and eager (PyTorch) steps, and the gradient passes before them
    assert step1["step_rel_diff"] < LOSS_TOLERANCE and step1["rel_diff"] < LOSS_TOLERANCE
    assert step1["flame_step_loss"] == pytest.approx(step1["flame_loss"], rel=LOSS_TOLERANCE)
    grads = step1["gradients"]
    # the zero output layer: at step 1 only it has a gradient, in both frameworks
    assert 0 < grads["zero_in_both"] < grads["parameters"]
    assert grads["max"] < GRADIENT_TOLERANCE, grads["worst"]
    for key in ("flame", "torch"):
        assert len(curves[key]["losses"]) == len(curves[key]["grad_norms"]) == STEPS
    flame, expected = np.array(curves["flame"]["losses"]), np.array(curves["torch"]["losses"])
    assert np.abs(flame - expected).max() / expected.min() < CURVE_BOUND
    assert np.ptp(expected) > 100 * CURVE_BOUND * expected.max()  # the curves do move
    assert report["agreement"]["within_noise"]
    final = report["final_gradients"]["gradients"]
    assert final["zero_in_both"] == 0 and final["max"] < GRADIENT_TOLERANCE, final["worst"]
    samples = report["samples"]
    assert samples["mean_abs_pixel_diff"] < GRADIENT_TOLERANCE
    assert samples["flame"]["samples"] == samples["torch"]["samples"] == 10
    for name in ("parity.md", "loss.png", "samples_flame.png", "initial.safetensors"):
        assert (tmp_path / name).stat().st_size > 0
    assert "within noise: yes" in (tmp_path / "parity.md").read_text()


@pytest.mark.slow
@needs_example_packages
def test_the_bound_catches_a_learning_rate_off_by_one_percent(torch, tmp_path, monkeypatch):
    build = parity.TorchSide.__init__

    def off(self, model, setup):
        build(self, model, setup)
        self.scheduler.base_lrs = [rate * 1.01 for rate in self.scheduler.base_lrs]

    monkeypatch.setattr(parity.TorchSide, "__init__", off)
    report = tiny_run("unet", tmp_path, steps=6, extra=["--no-final-gradients"])
    flame, expected = (np.array(report["curves"][k]["losses"]) for k in ("flame", "torch"))
    assert report["step1"]["step_rel_diff"] < LOSS_TOLERANCE  # step 1's loss precedes the lr
    assert np.abs(flame - expected).max() / expected.min() > 3 * CURVE_BOUND


# --- the measures, without either framework's training -----------------------------------------


def test_draws_are_the_same_for_whoever_asks():
    rng = np.random.default_rng(0)
    images = rng.standard_normal((50, 3, 4, 4)).astype(np.float32)
    data = Dataset(images, np.arange(50, dtype=np.int64) % 10, [str(k) for k in range(10)])
    first, again = parity.draws(data, 3, 40, seed=1), parity.draws(data, 3, 40, seed=1)
    for value, same in zip(first, again):
        np.testing.assert_array_equal(value, same)
    images, labels, t, noise = first
    assert images.shape == noise.shape == (40, 3, 4, 4) and noise.dtype == np.float32
    assert t.dtype == labels.dtype == np.int64 and 0 <= t.min() and t.max() < 1000
    assert 0 < np.sum(labels == 10) < 20  # label dropout to the null class, ~10%
    chosen = [int(np.flatnonzero((data.images == image).all(axis=(1, 2, 3)))[0])
              for image in images]  # fmt: skip
    assert len(set(chosen)) == 40  # a batch without repeats
    kept = labels != 10
    np.testing.assert_array_equal(labels[kept], data.labels[chosen][kept])
    other = parity.draws(data, 4, 40, seed=1)
    assert not np.array_equal(other[3], noise) and not np.array_equal(other[2], t)


def test_agreement_within_and_outside_the_noise():
    rng = np.random.default_rng(5)
    trend = np.linspace(1.0, 0.2, 200)
    flame = trend + 0.05 * rng.standard_normal(200)
    same = measures.agreement(flame, flame * (1 + 1e-4))
    assert same["within_noise"] and same["gap_over_noise"] < 0.01 and same["window"] == 100
    assert same["noise"]["flame"] == pytest.approx(0.05, rel=0.3)
    shifted = measures.agreement(flame, flame + 0.1)  # twice the noise apart
    assert not shifted["within_noise"] and shifted["gap"] == pytest.approx(0.1, rel=1e-6)
    assert shifted["paired_mean"] == pytest.approx(-0.1) and shifted["paired_std"] < 1e-9


def test_gradient_report_ranks_and_counts():
    ones = np.ones((2, 3), np.float32)
    torch_grads = {"a": ones, "b": 2 * ones, "zero": 0 * ones, "lost": 0 * ones}
    flame_grads = {"a": ones * 1.1, "b": 2 * ones, "zero": 0 * ones, "lost": ones}
    report = measures.gradient_report(flame_grads, torch_grads, worst=2)
    assert report["parameters"] == 4 and report["zero_in_both"] == 1
    assert [w["name"] for w in report["worst"]] == ["lost", "a"]
    assert report["max"] == np.inf
    assert report["worst"][1]["max_rel_diff"] == pytest.approx(0.1, rel=1e-5)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--backend", "reference", "--torch-compile"], "--torch-compile: the GPU only"),
        (["--backend", "reference", "--steps", "0"], "must be at least 1"),
    ],
)
def test_bad_command_lines_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit):
        parity.parse(argv)
    assert message in capsys.readouterr().err


@needs_example_packages
def test_a_batch_larger_than_the_digits_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"--batch 5000: larger than the 16\d\d training digits"):
        parity.run(parity.Setup(batch=5000), tmp_path)


def test_sizes_and_defaults():
    setup, _ = parity.parse(["--backend", "reference", "--model", "dit"])
    setup.complete()
    assert (setup.model, setup.size, setup.image, setup.batch, setup.bf16) == (
        "dit", "tiny", 8, 8, False)  # fmt: skip
    assert setup.warmup == 20 and setup.sample_steps == 5
    setup, _ = parity.parse(["--steps", "50"])
    setup.complete()
    assert (setup.size, setup.case, setup.bf16, setup.warmup) == (
        "full", ("unet", "full", 32, 64), True, 5)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("model", ["unet", "dit"])
def test_demo_size_is_the_examples_small_model_in_both(torch, reference_backend, model):
    """The PyTorch twin has no "small" size: --size demo builds it from FLAME's table."""
    from examples.diffusion.models import build_model

    setup = parity.Setup(model=model, size="demo", image=8).complete()
    twin = parity.torch_twin(setup)
    flame = build_model(model, 8, 3, 10, "small")
    shapes = {name: tuple(value.shape) for name, value in flame.state_dict().items()}
    assert shapes == {name: tuple(value.shape) for name, value in twin.state_dict().items()}
    assert setup.case == (model, "small", 8, 128)
