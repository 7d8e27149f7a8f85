"""``DiT``, the diffusion transformer with adaLN-Zero blocks, on ``torch.nn``:
``examples/diffusion/dit.py`` line for line (a ``diff`` shows the imports and the calls that
differ: ``from_numpy``). Built through ``diffusion_models_torch.build_model``. Nothing here
imports FLAME."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.diffusion_torch_common import (
    CheckpointedBlock,
    check_inputs,
    check_resolution,
    labels_or_null,
    sinusoidal_embedding,
    timestep_frequencies,
)


def sincos_position_embedding(dim: int, height: int, width: int) -> np.ndarray:
    """MAE's fixed 2-d embedding, [height * width, dim] row-major over the patch grid: the
    first half of the channels encodes the column, the second half the row, each as sines
    then cosines of ``position * 10000 ** (-i / (dim / 4))``."""
    if dim % 4:
        raise ValueError(f"DiT: hidden_size {dim} must be a multiple of 4 (2-d sin-cos embedding)")
    omega = 1.0 / 10000 ** (np.arange(dim // 4, dtype=np.float64) / (dim / 4))
    rows, columns = np.meshgrid(np.arange(height), np.arange(width), indexing="ij")

    def encode(positions):
        angles = positions.reshape(-1, 1).astype(np.float64) * omega[None]
        return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)

    return np.concatenate([encode(columns), encode(rows)], axis=1).astype(np.float32)


def modulate(x, shift, scale):
    """adaLN: the normalised tokens [N, T, D] scaled and shifted per sample ([N, D])."""
    return x * (1 + scale[:, None]) + shift[:, None]


class Attention(nn.Module):
    """Multi-head self-attention over tokens: one qkv Linear, SDPA, an output Linear."""

    def __init__(self, dim, num_heads):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"DiT: hidden_size {dim} does not split into {num_heads} heads")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        n, length, dim = x.shape
        qkv = self.qkv(x).reshape(n, length, 3, self.num_heads, dim // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [N, heads, T, D / heads]
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(n, length, dim))


class DiTBlock(CheckpointedBlock):
    """adaLN-Zero: the conditioning regresses a shift, a scale and a gate for each of the
    attention and MLP branches; the gates start at zero, so the block starts as the identity."""

    def __init__(self, hidden_size, num_heads, mlp_ratio, checkpoint):
        super().__init__(checkpoint)
        mlp_hidden = int(hidden_size * mlp_ratio)
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden_size, num_heads)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size, mlp_hidden),
            nn.GELU(approximate="tanh"),
            nn.Linear(mlp_hidden, hidden_size),
        )
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def block(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(
            c
        ).chunk(6, dim=1)
        x = x + gate_msa[:, None] * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        return x + gate_mlp[:, None] * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class FinalLayer(nn.Module):
    """adaLN (shift and scale, no gate) and a Linear to each patch's pixels."""

    def __init__(self, hidden_size, patch_size, out_channels):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    """The diffusion transformer: patchify (a p x p conv of stride p) plus a fixed sin-cos
    position embedding; the conditioning ``c`` = timestep embedding (256 sinusoidal
    features, Linear, SiLU, Linear) + label embedding; ``depth`` adaLN-Zero blocks; a final
    adaLN layer and the patches put back. The defaults are DiT-S/2."""

    def __init__(
        self,
        image_size: int,
        in_channels: int,
        patch_size: int = 2,
        hidden_size: int = 384,
        depth: int = 12,
        num_heads: int = 6,
        mlp_ratio: float = 4.0,
        num_classes: int | None = None,
        checkpoint: bool = False,
        frequency_size: int = 256,
    ):
        super().__init__()
        self.reason = f"the patch size is {patch_size}"
        check_resolution("DiT", image_size, image_size, patch_size, self.reason)
        self.in_channels, self.num_classes, self.patch_size = in_channels, num_classes, patch_size
        self.x_embedder = nn.Conv2d(in_channels, hidden_size, patch_size, stride=patch_size)
        # not learned and a function of the grid: not saved, so any resolution loads a state
        self.grid = image_size // patch_size
        position = sincos_position_embedding(hidden_size, self.grid, self.grid)
        self.register_buffer("pos_embed", torch.from_numpy(position)[None], persistent=False)
        frequencies = torch.from_numpy(timestep_frequencies(frequency_size, shift=0))
        self.register_buffer("time_frequencies", frequencies, persistent=False)
        self.t_embedder = nn.Sequential(
            nn.Linear(frequency_size, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size)
        )
        self.y_embedder = None
        if num_classes is not None:  # the last row is the null class
            self.y_embedder = nn.Embedding(num_classes + 1, hidden_size)
        self.blocks = nn.ModuleList(
            [DiTBlock(hidden_size, num_heads, mlp_ratio, checkpoint) for _ in range(depth)]
        )
        self.final_layer = FinalLayer(hidden_size, patch_size, in_channels)
        self.initialize_weights()

    def initialize_weights(self):
        """DiT's: Xavier-uniform Linears with zero biases, the patch conv Xavier as the
        Linear it is, N(0, 0.02) embeddings, and every adaLN regression and the output
        Linear at zero (adaLN-Zero)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        weight = self.x_embedder.weight
        fan_in, fan_out = math.prod(weight.shape[1:]), weight.shape[0]
        bound = math.sqrt(6.0 / (fan_in + fan_out))
        nn.init.uniform_(weight, -bound, bound)
        nn.init.zeros_(self.x_embedder.bias)
        nn.init.normal_(self.t_embedder[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder[2].weight, std=0.02)
        if self.y_embedder is not None:
            nn.init.normal_(self.y_embedder.weight, std=0.02)
        for layer in [block.adaLN_modulation[1] for block in self.blocks] + [
            self.final_layer.adaLN_modulation[1],
            self.final_layer.linear,
        ]:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def position_embedding(self, rows: int, columns: int):
        if rows == columns == self.grid:
            return self.pos_embed
        hidden = self.pos_embed.shape[-1]
        return self.pos_embed.new_tensor(sincos_position_embedding(hidden, rows, columns))[None]

    def forward(self, x, t, y=None):
        check_inputs(self, x, t, y, self.patch_size, self.reason)
        p = self.patch_size
        rows, columns = x.shape[2] // p, x.shape[3] // p
        tokens = self.x_embedder(x).flatten(2).transpose(1, 2)  # [N, T, D]
        tokens = tokens + self.position_embedding(rows, columns)
        c = self.t_embedder(sinusoidal_embedding(t, self.time_frequencies, cos_first=True))
        if self.y_embedder is not None:
            c = c + self.y_embedder(labels_or_null(y, t, self.num_classes))
        for block in self.blocks:
            tokens = block(tokens, c)
        patches = self.final_layer(tokens, c)  # [N, T, p * p * C]
        n, channels = x.shape[0], self.in_channels
        patches = patches.reshape(n, rows, columns, p, p, channels).permute(0, 5, 1, 3, 2, 4)
        return patches.reshape(n, channels, rows * p, columns * p)
