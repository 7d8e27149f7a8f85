"""The two denoisers of the diffusion examples, written with ``flame.nn`` as a PyTorch user
writes them: ``UNet``, the DDPM CIFAR-10 network (Ho et al. 2020), and ``DiT``, the diffusion
transformer with adaLN-Zero blocks (Peebles & Xie 2023).

The code is in common.py (what both share), unet.py, dit.py, and here (the configurations
and ``build_model``). ``bench/diffusion_models_torch.py`` is the four on ``torch.nn`` in one
file, in that order, line for line (a ``diff`` shows the imports and the calls that differ:
``cat``, ``checkpoint``, ``from_numpy``), with the same parameter names and shapes: a
``state_dict`` moves between the two unchanged, which is how the tests check FLAME's forward
and gradients against PyTorch's.

Both models are called as ``model(x [N, C, H, W], t [N], y [N] or None)`` and return
[N, C, H, W]; what the output stands for (noise, velocity) is the trainer's choice. With
``num_classes`` set, label ``num_classes`` is the null class that classifier-free guidance
drops labels to, and ``y=None`` means the null class for every sample.
"""

from __future__ import annotations

import flame.nn as nn

# every name models.py held before it was split, importable from here as before
from examples.diffusion.common import (  # noqa: F401
    CheckpointedBlock,
    check_inputs,
    check_resolution,
    labels_or_null,
    sinusoidal_embedding,
    timestep_frequencies,
)
from examples.diffusion.dit import (  # noqa: F401
    Attention,
    DiT,
    DiTBlock,
    FinalLayer,
    modulate,
    sincos_position_embedding,
)
from examples.diffusion.unet import (  # noqa: F401
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
    Small: a quarter of the UNet's width and one level less (about 6 M parameters), a
    6-block DiT: the README's GPU run. Tiny: the same architectures at a few tens of
    thousands of parameters, for CPU runs."""
    return {
        ("unet", "full"): {},
        ("unet", "tiny"): dict(
            base_channels=8, channel_mult=(1, 2), num_res_blocks=1,
            attention_resolutions=(image_size // 2,), num_groups=4,
        ),
        ("unet", "small"): dict(
            base_channels=64, channel_mult=(1, 2, 2), attention_resolutions=(image_size // 2,),
        ),
        ("dit", "full"): {},
        ("dit", "small"): dict(hidden_size=256, depth=6, num_heads=4),
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
            "sizes 'full', 'small', 'tiny'"
        )
    model = {"unet": UNet, "dit": DiT}[name]
    arguments = {**configurations[name, size], **overrides}
    return model(image_size, in_channels, num_classes=num_classes, **arguments)
