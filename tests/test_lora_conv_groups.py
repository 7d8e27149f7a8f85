"""LoRAConv2d around grouped convolutions and non-zero padding modes (flame/nn/lora.py):
values and adapter gradients against PyTorch's convolutions with the same weights, merging
into the grouped base weight, and the rank that groups refuse."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
from flame.nn import lora
from flame.nn.modules.conv import Conv2d

CASES = [
    # in, out, kernel, options of the base, rank
    (4, 6, 3, {"groups": 2, "padding": 1}, 4),
    (3, 5, 3, {"padding": 1, "padding_mode": "reflect"}, 2),
    (4, 8, 3, {"groups": 4, "stride": 2, "padding": 1, "padding_mode": "circular"}, 4),
    (6, 6, 3, {"groups": 3, "padding": "same", "dilation": 2, "padding_mode": "replicate"}, 3),
]


def _layer(case, rng):
    channels, out, kernel, options, rank = case
    fl.manual_seed(0)
    layer = lora.LoRAConv2d(Conv2d(channels, out, kernel, **options), rank=rank, alpha=3)
    with fl.no_grad():  # B starts at zero: give the adapter something to add
        layer.lora_B.copy_(fl.from_numpy(rng.standard_normal(layer.lora_B.shape) * 0.5))
    return layer


@pytest.mark.parametrize("case", CASES, ids=lambda case: str(case[3]))
def test_grouped_and_padded_adapters_match_torch(case, reference_backend):
    torch = pytest.importorskip("torch", reason="PyTorch is the reference for these checks")
    functional = torch.nn.functional
    rng = np.random.default_rng(3)
    channels, out, kernel, options, rank = case
    layer = _layer(case, rng)
    groups = options.get("groups", 1)
    assert layer.lora_A.shape == (rank, channels // groups, kernel, kernel)
    assert layer.lora_B.shape == (out, rank // groups, 1, 1)
    x = rng.standard_normal((2, channels, 9, 9)).astype(np.float32)
    y = layer(fl.from_numpy(x))
    (y * y).sum().backward()

    weights = {name: torch.from_numpy(value.numpy().copy()).requires_grad_()
               for name, value in layer.state_dict().items()}  # fmt: skip
    torch_base = torch.nn.Conv2d(channels, out, kernel, **options)
    with torch.no_grad():
        torch_base.weight.copy_(weights["base.weight"])
        torch_base.bias.copy_(weights["base.bias"])
    inputs = torch.from_numpy(x)
    spacing = options.get("dilation", 1)
    mode = options.get("padding_mode", "zeros")
    stride = options.get("stride", 1)
    if mode == "zeros":
        down = functional.conv2d(inputs, weights["lora_A"], None, stride, options["padding"],
                                 spacing, groups)  # fmt: skip
    else:
        padded = functional.pad(inputs, torch_base._reversed_padding_repeated_twice, mode=mode)
        down = functional.conv2d(padded, weights["lora_A"], None, stride, 0, spacing, groups)
    up = functional.conv2d(down, weights["lora_B"], groups=groups)
    expected = torch_base(inputs) + layer.scaling * up
    (expected * expected).sum().backward()
    np.testing.assert_allclose(y.numpy(), expected.detach().numpy(), rtol=1e-5, atol=1e-5)
    for name in ("lora_A", "lora_B"):
        np.testing.assert_allclose(getattr(layer, name).grad.numpy(), weights[name].grad.numpy(),
                                   rtol=1e-4, atol=1e-4, err_msg=name)  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda case: str(case[3]))
def test_a_grouped_adapter_merges_into_the_base_weight(case, reference_backend):
    rng = np.random.default_rng(4)
    layer = _layer(case, rng)
    x = fl.from_numpy(rng.standard_normal((2, case[0], 9, 9)).astype(np.float32))
    unmerged = layer(x).numpy()
    original = layer.base.weight.numpy().copy()
    layer.merge()
    np.testing.assert_allclose(layer(x).numpy(), unmerged, rtol=1e-4, atol=1e-4)
    layer.unmerge()
    np.testing.assert_allclose(layer.base.weight.numpy(), original, rtol=1e-5, atol=1e-6)


def test_a_rank_that_is_not_a_multiple_of_the_groups_is_refused(reference_backend):
    with pytest.raises(ValueError, match="rank=3 and groups=2"):
        lora.LoRAConv2d(Conv2d(4, 4, 3, groups=2), rank=3)
