"""The diffusion examples' two denoisers on ``torch.nn``, for comparison with FLAME only:
``examples/diffusion`` line for line, file for file (``diffusion_torch_common.py`` is its
common.py, ``diffusion_torch_unet.py`` its unet.py, ``diffusion_torch_dit.py`` its dit.py, and
this file its models.py: the configurations and ``build_model``; a ``diff`` of two such files
shows the imports and the few calls that differ), with the same module names and parameter
shapes, so a ``state_dict`` of one loads into the other unchanged. The tests copy this model's
weights into FLAME's and compare outputs and gradients.

Nothing here imports FLAME: it runs wherever PyTorch does. See the FLAME files for what the
models are; both are called as ``model(x [N, C, H, W], t [N], y [N] or None)``.
"""

from __future__ import annotations

import torch.nn as nn

# every name this file held before it was split, importable from here as before
from bench.diffusion_torch_common import (  # noqa: F401
    CheckpointedBlock,
    check_inputs,
    check_resolution,
    labels_or_null,
    sinusoidal_embedding,
    timestep_frequencies,
)
from bench.diffusion_torch_dit import (  # noqa: F401
    Attention,
    DiT,
    DiTBlock,
    FinalLayer,
    modulate,
    sincos_position_embedding,
)
from bench.diffusion_torch_unet import (  # noqa: F401
    AttentionBlock,
    DownStage,
    ResBlock,
    UNet,
    Upsample,
    UpStage,
)

__all__ = ["DiT", "UNet", "build_model"]


# --- configurations ---------------------------------------------------------------------------


def _configurations(image_size: int) -> dict:
    """(name, size) -> constructor arguments. Full: the DDPM CIFAR-10 UNet and DiT-S/2.
    Tiny: the same architectures at a few tens of thousands of parameters, for CPU runs."""
    return {
        ("unet", "full"): {},
        ("unet", "tiny"): dict(
            base_channels=8, channel_mult=(1, 2), num_res_blocks=1,
            attention_resolutions=(image_size // 2,), num_groups=4,
        ),
        ("dit", "full"): {},
        ("dit", "tiny"): dict(hidden_size=32, depth=2, num_heads=2),
    }  # fmt: skip


def build_model(
    name: str,
    image_size: int,
    in_channels: int,
    num_classes: int | None,
    size: str = "full",
    **overrides,
) -> nn.Module:
    """``UNet`` or ``DiT`` (``name`` "unet" or "dit") in the ``size`` "full" or "tiny"
    configuration; ``overrides`` replace constructor arguments (``dropout=0.0``,
    ``checkpoint=True``, ...)."""
    configurations = _configurations(image_size)
    if (name, size) not in configurations:
        raise ValueError(
            f"build_model: no model {name!r} of size {size!r}; names 'unet', 'dit', "
            "sizes 'full', 'tiny'"
        )
    model = {"unet": UNet, "dit": DiT}[name]
    arguments = {**configurations[name, size], **overrides}
    return model(image_size, in_channels, num_classes=num_classes, **arguments)
