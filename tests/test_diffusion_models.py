"""The diffusion examples' denoisers (examples/diffusion/models.py) against their PyTorch twins
(bench/diffusion_models_torch.py): parameter counts of the full models (the DDPM CIFAR-10
UNet's published 35.7 M, DiT-S/2's by formula), identical state-dict names and shapes, and
on the tiny configurations the forward values and every parameter's gradient with the same
random weights loaded into both (float32, reference backend). Also: ``checkpoint=True``
recomputes each block and gives the gradients of ``checkpoint=False``, and the resolutions a
model cannot take are refused with the model and the sizes named."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
from examples.diffusion.models import build_model

SIZE = 8  # the tiny models' image size
CLASSES = 10
OUTPUT_TOLERANCE = 1e-4  # relative to the largest magnitude of PyTorch's value
GRADIENT_TOLERANCE = 1e-3


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="the models are checked against PyTorch twins")


def twin(name: str, image_size: int, num_classes, size: str = "tiny", **overrides):
    from bench.diffusion_models_torch import build_model as build_torch_model

    return build_torch_model(name, image_size, 3, num_classes, size, **overrides)


def shapes(model) -> dict:
    return {name: tuple(value.shape) for name, value in model.state_dict().items()}


def count(model) -> int:
    return sum(int(np.prod(parameter.shape)) for parameter in model.parameters())


def random_state(model, rng) -> dict:
    """Weights for every entry of ``model``'s state: the models start with zero output
    layers and gates, which would make most gradients zero and the comparison idle. Matrices
    and kernels get N(0, 1 / fan_in), vectors N(0, 0.3) (plus 1 for norm scales)."""
    state = {}
    for name, shape in shapes(model).items():
        if len(shape) > 1:
            value = rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))
        else:
            value = 0.3 * rng.standard_normal(shape) + ("norm" in name and "weight" in name)
        state[name] = value.astype(np.float32)
    return state


def inputs(rng, num_classes, height: int = SIZE, width: int = SIZE, float_time=False) -> dict:
    x = rng.standard_normal((2, 3, height, width)).astype(np.float32)
    t = np.array([3, 917], dtype=np.float32 if float_time else np.int64)
    y = None if num_classes is None else np.array([1, num_classes], dtype=np.int64)  # + null
    target = rng.standard_normal(x.shape).astype(np.float32)
    return {"x": x, "t": t, "y": y, "target": target}


def flame_step(model, data: dict):
    """Forward and the MSE loss's backward; the output and the gradients of x and of every
    parameter, by name, as arrays."""
    x = fl.tensor(data["x"]).requires_grad_()
    y = None if data["y"] is None else fl.tensor(data["y"])
    out = model(x, fl.tensor(data["t"]), y)
    loss = ((out - fl.tensor(data["target"])) ** 2).mean()
    loss.backward()
    named = dict(model.named_parameters())
    fl.realize(out, x.grad, *[parameter.grad for parameter in named.values()])
    grads = {name: parameter.grad.numpy() for name, parameter in named.items()}
    return out.numpy(), {"x": x.grad.numpy(), **grads}


def torch_step(torch, model, data: dict):
    x = torch.from_numpy(data["x"]).requires_grad_()
    y = None if data["y"] is None else torch.from_numpy(data["y"])
    out = model(x, torch.from_numpy(data["t"]), y)
    loss = ((out - torch.from_numpy(data["target"])) ** 2).mean()
    loss.backward()
    grads = {name: parameter.grad.numpy() for name, parameter in model.named_parameters()}
    return out.detach().numpy(), {"x": x.grad.numpy(), **grads}


def relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    scale = max(float(np.abs(expected).max()), 1e-30)
    return float(np.abs(got.astype(np.float64) - expected).max()) / scale


# --- the full models: counts and names (each built once: 7-11 s on the reference backend) -----


def ddpm_unet_count() -> int:
    """The DDPM CIFAR-10 UNet's parameters (ch 128, mult 1 2 2 2, 2 blocks, attention at 16),
    counted layer by layer from the paper's architecture."""
    conv = lambda cin, cout, k=3: cin * cout * k * k + cout  # noqa: E731
    norm = lambda c: 2 * c  # noqa: E731

    def res(cin, cout):
        skip = conv(cin, cout, 1) if cin != cout else 0
        time_proj = 512 * cout + cout
        return norm(cin) + conv(cin, cout) + time_proj + norm(cout) + conv(cout, cout) + skip

    def attention(c):
        return norm(c) + conv(c, 3 * c, 1) + conv(c, c, 1)

    total = 128 * 512 + 512 + 512 * 512 + 512 + conv(3, 128)
    total += res(128, 128) * 2 + conv(128, 128)  # 32x32
    total += res(128, 256) + res(256, 256) + 2 * attention(256) + conv(256, 256)  # 16x16
    total += 2 * res(256, 256) + conv(256, 256) + 2 * res(256, 256)  # 8x8, 4x4
    total += 2 * res(256, 256) + attention(256)  # middle
    total += 3 * res(512, 256) + conv(256, 256)  # 4x4 up
    total += 3 * res(512, 256) + conv(256, 256)  # 8x8 up
    total += 2 * res(512, 256) + res(384, 256) + 3 * attention(256) + conv(256, 256)  # 16x16
    total += res(384, 128) + 2 * res(256, 128)  # 32x32 up
    return total + norm(128) + conv(128, 3)


def dit_count(hidden: int, depth: int, patch: int, channels: int, classes) -> int:
    linear = lambda fan_in, fan_out: fan_in * fan_out + fan_out  # noqa: E731
    block = (
        linear(hidden, 3 * hidden) + linear(hidden, hidden)  # attention
        + linear(hidden, 4 * hidden) + linear(4 * hidden, hidden)  # MLP
        + linear(hidden, 6 * hidden)  # adaLN-Zero
    )  # fmt: skip
    embedders = channels * patch * patch * hidden + hidden + linear(256, hidden)
    embedders += linear(hidden, hidden) + (0 if classes is None else (classes + 1) * hidden)
    final = linear(hidden, 2 * hidden) + linear(hidden, patch * patch * channels)
    return depth * block + embedders + final


def assert_same_as_twin(model, name: str, num_classes) -> None:
    """Checked last, so the FLAME model's count is checked where PyTorch is missing too."""
    pytest.importorskip("torch", reason="the names are checked against the PyTorch twin's")
    reference = twin(name, 32, num_classes, "full")
    assert count(reference) == count(model) and shapes(reference) == shapes(model)


@pytest.mark.slow
def test_full_unet_is_the_ddpm_cifar10_model(reference_backend):
    model = build_model("unet", 32, 3, None)
    assert count(model) == ddpm_unet_count() == 35_746_307
    assert abs(count(model) - 35.75e6) / 35.75e6 < 1e-3  # the paper's 35.7 M
    assert_same_as_twin(model, "unet", None)


@pytest.mark.slow
def test_full_dit_is_dit_s_2(reference_backend):
    model = build_model("dit", 32, 3, CLASSES)
    assert count(model) == dit_count(384, 12, 2, 3, CLASSES) == 32_475_660
    assert_same_as_twin(model, "dit", CLASSES)


# --- the tiny models against PyTorch ---------------------------------------------------------

CASES = [
    pytest.param("unet", None, {}, id="unet"),
    pytest.param("unet", CLASSES, {"num_heads": 2}, id="unet-classes-2heads"),
    pytest.param("dit", None, {}, id="dit"),
    pytest.param("dit", CLASSES, {}, id="dit-classes"),
]


@pytest.mark.parametrize("name, num_classes, overrides", CASES)
def test_tiny_model_matches_pytorch(reference_backend, torch, rng, name, num_classes, overrides):
    """Forward and gradients with PyTorch's weights; dropout 0 (training mode, so the path
    a training step takes), DiT with float timesteps and a non-square input (its position
    embedding made for the other grid, and the patches put back in the right order)."""
    if name == "unet":
        overrides = {**overrides, "dropout": 0.0}
    model = build_model(name, SIZE, 3, num_classes, "tiny", **overrides)
    reference = twin(name, SIZE, num_classes, **overrides)
    assert count(model) < 100_000 and shapes(model) == shapes(reference)
    state = random_state(model, rng)
    model.load_state_dict({key: fl.tensor(value) for key, value in state.items()})
    reference.load_state_dict({key: torch.from_numpy(value) for key, value in state.items()})
    width = SIZE + 4 if name == "dit" else SIZE
    data = inputs(rng, num_classes, width=width, float_time=name == "dit")
    out, grads = flame_step(model, data)
    expected, expected_grads = torch_step(torch, reference, data)
    assert out.shape == (2, 3, SIZE, width) and out.dtype == np.float32
    assert relative_error(out, expected) < OUTPUT_TOLERANCE
    assert grads.keys() == expected_grads.keys()
    errors = {key: relative_error(grads[key], expected_grads[key]) for key in grads}
    worst = max(errors, key=errors.get)
    assert errors[worst] < GRADIENT_TOLERANCE, f"{worst}: {errors[worst]:.2e}"


@pytest.mark.parametrize("name", ["unet", "dit"])
def test_tiny_model_output_and_null_label(reference_backend, rng, name):
    """Output shape and dtype at the built size and at another one; ``y=None`` on a class
    conditional model is the null class."""
    model = build_model(name, SIZE, 3, CLASSES, "tiny").eval()
    model.load_state_dict({k: fl.tensor(v) for k, v in random_state(model, rng).items()})
    x, t = fl.randn(2, 3, SIZE, SIZE), fl.tensor([0, 999])
    null = model(x, t, fl.tensor([CLASSES, CLASSES]))
    assert tuple(null.shape) == (2, 3, SIZE, SIZE) and null.dtype == fl.float32
    np.testing.assert_array_equal(model(x, t).numpy(), null.numpy())
    bigger = model(fl.randn(1, 3, 2 * SIZE, SIZE), fl.tensor([5]), fl.tensor([2]))
    assert tuple(bigger.shape) == (1, 3, 2 * SIZE, SIZE) and bigger.dtype == fl.float32


# --- gradient checkpointing ------------------------------------------------------------------

BLOCKS = {"unet": 12, "dit": 2}  # tiny UNet: 8 ResBlocks + 4 attention blocks; DiT: depth 2


@pytest.mark.parametrize("name", ["unet", "dit"])
def test_checkpoint_gives_the_same_gradients(reference_backend, rng, name):
    """Each block under ``fl.checkpoint`` (in training, with the UNet's dropout on: the
    recomputation draws the same masks) gives the gradients of the plain model."""
    plain = build_model(name, SIZE, 3, CLASSES, "tiny")
    recomputed = build_model(name, SIZE, 3, CLASSES, "tiny", checkpoint=True)
    state = {key: fl.tensor(value) for key, value in random_state(plain, rng).items()}
    plain.load_state_dict(state)
    recomputed.load_state_dict(state)
    data = inputs(rng, CLASSES)
    results = []
    for model in (plain, recomputed):
        fl.manual_seed(7)
        results.append(flame_step(model, data))
    (out, grads), (out_again, grads_again) = results
    np.testing.assert_allclose(out_again, out, rtol=1e-6, atol=1e-7)
    for key, grad in grads.items():
        np.testing.assert_allclose(grads_again[key], grad, rtol=1e-5, atol=1e-6, err_msg=key)
    x, t = fl.randn(1, 3, SIZE, SIZE), fl.tensor([1])
    assert recomputed(x, t).ir().count("checkpoint(") == BLOCKS[name]
    assert plain(x, t).ir().count("checkpoint(") == 0
    assert recomputed.eval()(x, t).ir().count("checkpoint(") == 0  # evaluation saves nothing


def test_pytorch_twin_checkpoint_gives_the_same_gradients(torch, rng):
    """The twin's ``checkpoint=True`` path (torch.utils.checkpoint), dropout on."""
    data = inputs(rng, CLASSES)
    state = random_state(twin("unet", SIZE, CLASSES), rng)
    results = []
    for checkpoint in (False, True):
        model = twin("unet", SIZE, CLASSES, checkpoint=checkpoint)
        model.load_state_dict({key: torch.from_numpy(value) for key, value in state.items()})
        torch.manual_seed(7)
        results.append(torch_step(torch, model, data))
    (_, grads), (_, grads_again) = results
    for key, grad in grads.items():
        np.testing.assert_allclose(grads_again[key], grad, rtol=1e-5, atol=1e-6, err_msg=key)


# --- sizes the models cannot take ------------------------------------------------------------


def test_resolutions_the_models_cannot_take(reference_backend):
    with pytest.raises(ValueError, match=r"UNet: a 30x30 input .* multiples of 8"):
        build_model("unet", 30, 3, None)
    with pytest.raises(ValueError, match=r"DiT: a 9x9 input .* multiples of 2"):
        build_model("dit", 9, 3, None)
    unet, dit = (
        build_model("unet", SIZE, 3, None, "tiny"),
        build_model("dit", SIZE, 3, None, "tiny"),
    )
    t = fl.tensor([1])
    with pytest.raises(ValueError, match=r"UNet: a 7x8 input .* multiples of 2"):
        unet(fl.randn(1, 3, 7, 8), t)
    with pytest.raises(ValueError, match=r"DiT: a 8x5 input .* patch size is 2"):
        dit(fl.randn(1, 3, 8, 5), t)
    with pytest.raises(ValueError, match=r"DiT: x must be \[N, 3, H, W\], got \[1, 4, 8, 8\]"):
        dit(fl.randn(1, 4, 8, 8), t)
    with pytest.raises(ValueError, match=r"UNet: labels given to a model built without"):
        unet(fl.randn(1, 3, 8, 8), t, fl.tensor([0]))
    with pytest.raises(ValueError, match=r"build_model: no model 'vit'"):
        build_model("vit", SIZE, 3, None)
