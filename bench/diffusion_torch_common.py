"""What the two denoisers on ``torch.nn`` (diffusion_torch_unet.py, diffusion_torch_dit.py)
share: ``examples/diffusion/common.py`` line for line, on PyTorch (the sinusoidal timestep
embedding, the input checks, the null class of classifier-free guidance, and blocks that
recompute their activations in the backward, ``checkpoint=True``). Nothing here imports FLAME."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.utils.checkpoint


def timestep_frequencies(dim: int, shift: int) -> np.ndarray:
    """The ``dim // 2`` frequencies ``10000 ** (-i / (dim // 2 - shift))`` of a sinusoidal
    timestep embedding (DDPM's shift is 1, DiT's 0). Made once in NumPy, so a model and its
    PyTorch twin hold the same bits and their embeddings agree to the rounding of sin/cos."""
    half = dim // 2
    return (10000.0 ** -(np.arange(half, dtype=np.float64) / (half - shift))).astype(np.float32)


def sinusoidal_embedding(t, frequencies, cos_first: bool):
    """Timesteps [N] (integer or float) -> [N, 2 * F]: the sines and cosines of t * f."""
    angles = t.float()[:, None] * frequencies[None]
    waves = (angles.cos(), angles.sin()) if cos_first else (angles.sin(), angles.cos())
    return torch.cat(waves, dim=1)


def check_resolution(model: str, height: int, width: int, multiple: int, reason: str) -> None:
    if height % multiple or width % multiple:
        raise ValueError(
            f"{model}: a {height}x{width} input cannot be taken: height and width must be "
            f"multiples of {multiple} ({reason})"
        )


def check_inputs(model: nn.Module, x, t, y, multiple: int, reason: str) -> None:
    """The shapes a model cannot take, named at the call rather than deep inside a layer."""
    name = type(model).__name__
    if x.ndim != 4 or x.shape[1] != model.in_channels:
        raise ValueError(f"{name}: x must be [N, {model.in_channels}, H, W], got {list(x.shape)}")
    check_resolution(name, x.shape[2], x.shape[3], multiple, reason)
    if tuple(t.shape) != (x.shape[0],):
        raise ValueError(f"{name}: t must be [N] = [{x.shape[0]}], got {list(t.shape)}")
    if y is not None and model.num_classes is None:
        raise ValueError(f"{name}: labels given to a model built without num_classes")
    if y is not None and tuple(y.shape) != (x.shape[0],):
        raise ValueError(f"{name}: y must be [N] = [{x.shape[0]}], got {list(y.shape)}")


def labels_or_null(y, t, num_classes: int):
    """``y``, or the null class for every sample (classifier-free guidance's unconditional
    branch passes ``y=None``)."""
    return y if y is not None else t.new_full((t.shape[0],), num_classes).long()


class CheckpointedBlock(nn.Module):
    """A block whose activations are recomputed in the backward instead of kept, when built
    with ``checkpoint=True`` and in training (evaluation keeps nothing to save).
    Subclasses write ``block``, the forward."""

    def __init__(self, checkpoint: bool):
        super().__init__()
        self.checkpoint = checkpoint

    def forward(self, *inputs):
        if self.checkpoint and self.training:
            return torch.utils.checkpoint.checkpoint(self.block, *inputs, use_reentrant=False)
        return self.block(*inputs)
