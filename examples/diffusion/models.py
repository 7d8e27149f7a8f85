"""The two denoisers of the diffusion examples, written with ``flame.nn`` as a PyTorch user
writes them: ``UNet``, the DDPM CIFAR-10 network (Ho et al. 2020), and ``DiT``, the diffusion
transformer with adaLN-Zero blocks (Peebles & Xie 2023).

``bench/diffusion_models_torch.py`` is this file on ``torch.nn``, line for line (a ``diff``
shows the imports and the calls that differ: ``cat``, ``checkpoint``, ``from_numpy``), with
the same parameter names and shapes: a ``state_dict`` moves between the two unchanged, which
is how the tests check FLAME's forward and gradients against PyTorch's.

Both models are called as ``model(x [N, C, H, W], t [N], y [N] or None)`` and return
[N, C, H, W]; what the output stands for (noise, velocity) is the trainer's choice. With
``num_classes`` set, label ``num_classes`` is the null class that classifier-free guidance
drops labels to, and ``y=None`` means the null class for every sample.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np

import flame as fl
import flame.nn as nn
import flame.nn.functional as F

__all__ = ["DiT", "UNet", "build_model"]


# --- shared pieces ----------------------------------------------------------------------------


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
    return fl.cat(waves, dim=1)


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
            return fl.checkpoint(self.block, *inputs)
        return self.block(*inputs)


# --- UNet -------------------------------------------------------------------------------------


class ResBlock(CheckpointedBlock):
    """GroupNorm, SiLU, 3x3 conv; the time embedding projected by this block and added per
    channel; GroupNorm, SiLU, dropout, 3x3 conv; a 1x1 conv on the skip path where the width
    changes. The last conv starts at zero (DDPM's init_scale 0), so the block starts as the
    identity."""

    def __init__(self, in_channels, out_channels, embed_dim, dropout, groups, checkpoint):
        super().__init__(checkpoint)
        self.norm1 = nn.GroupNorm(groups, in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.time_proj = nn.Linear(embed_dim, out_channels)
        self.norm2 = nn.GroupNorm(groups, out_channels)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        nn.init.zeros_(self.conv2.weight)
        nn.init.zeros_(self.conv2.bias)
        same = in_channels == out_channels
        self.skip = nn.Identity() if same else nn.Conv2d(in_channels, out_channels, 1)

    def block(self, x, emb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.time_proj(F.silu(emb))[:, :, None, None]
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        return self.skip(x) + h


class AttentionBlock(CheckpointedBlock):
    """Self-attention over the H*W positions: GroupNorm, one 1x1 conv to queries, keys and
    values, ``num_heads`` heads splitting the channels, a 1x1 output projection that starts
    at zero, and the residual."""

    def __init__(self, channels, num_heads, groups, checkpoint):
        super().__init__(checkpoint)
        if channels % num_heads:
            raise ValueError(f"UNet: {channels} channels do not split into {num_heads} heads")
        self.num_heads = num_heads
        self.norm = nn.GroupNorm(groups, channels)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.proj = nn.Conv2d(channels, channels, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def block(self, x):
        n, channels, height, width = x.shape
        qkv = self.qkv(self.norm(x)).reshape(n, 3 * self.num_heads, -1, height * width)
        q, k, v = qkv.transpose(-2, -1).chunk(3, dim=1)  # each [N, heads, H*W, C / heads]
        out = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj(out.transpose(-2, -1).reshape(n, channels, height, width))


class Upsample(nn.Module):
    """Nearest-neighbour doubling, then a 3x3 conv."""

    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class DownStage(nn.Module):
    """One resolution of the encoder: ResBlocks, each followed by attention where the stage
    has it, then a strided 3x3 conv to the next resolution (not after the last). Every
    output goes on ``skips`` for the decoder."""

    def __init__(self, in_channels, channels, num_blocks, attention, downsample, blocks):
        super().__init__()
        res_block, attention_block = blocks
        widths = [in_channels] + [channels] * (num_blocks - 1)
        self.res_blocks = nn.ModuleList([res_block(width, channels) for width in widths])
        self.attentions = nn.ModuleList(
            [attention_block(channels) if attention else nn.Identity() for _ in widths]
        )
        self.downsample = (
            nn.Conv2d(channels, channels, 3, stride=2, padding=1) if downsample else None
        )

    def forward(self, h, emb, skips: list):
        for res_block, attention in zip(self.res_blocks, self.attentions):
            h = attention(res_block(h, emb))
            skips.append(h)
        if self.downsample is not None:
            h = self.downsample(h)
            skips.append(h)
        return h


class UpStage(nn.Module):
    """One resolution of the decoder: ResBlocks over the running features concatenated with
    one encoder output each (the last pushed first), attention where the stage has it, then
    nearest upsampling + 3x3 conv (not after the last)."""

    def __init__(self, in_channels, channels, skip_channels, attention, upsample, blocks):
        super().__init__()
        res_block, attention_block = blocks
        widths = [in_channels] + [channels] * (len(skip_channels) - 1)
        self.res_blocks = nn.ModuleList(
            [res_block(width + skip, channels) for width, skip in zip(widths, skip_channels)]
        )
        self.attentions = nn.ModuleList(
            [attention_block(channels) if attention else nn.Identity() for _ in widths]
        )
        self.upsample = Upsample(channels) if upsample else None

    def forward(self, h, emb, skips: list):
        for res_block, attention in zip(self.res_blocks, self.attentions):
            h = attention(res_block(fl.cat([h, skips.pop()], dim=1), emb))
        if self.upsample is not None:
            h = self.upsample(h)
        return h


class UNet(nn.Module):
    """The DDPM UNet: at each of ``len(channel_mult)`` resolutions ``num_res_blocks``
    ResBlocks of ``base_channels * mult`` channels (attention after each where the
    resolution, ``image_size / 2**level``, is in ``attention_resolutions``), a middle of
    ResBlock, attention, ResBlock, and a decoder that mirrors the encoder with one more
    ResBlock a level, each taking a skip connection. The time embedding (sinusoidal, then
    Linear, SiLU, Linear to ``4 * base_channels``; plus a label embedding when class
    conditional) feeds every ResBlock. The defaults are the CIFAR-10 model: 35.75 M
    parameters at 3 channels."""

    def __init__(
        self,
        image_size: int,
        in_channels: int,
        base_channels: int = 128,
        channel_mult: tuple[int, ...] = (1, 2, 2, 2),
        num_res_blocks: int = 2,
        attention_resolutions: tuple[int, ...] = (16,),
        dropout: float = 0.1,
        num_classes: int | None = None,
        num_heads: int = 1,
        checkpoint: bool = False,
        num_groups: int = 32,
    ):
        super().__init__()
        self.multiple = 2 ** (len(channel_mult) - 1)
        self.reason = f"the UNet halves it {len(channel_mult) - 1} times"
        check_resolution("UNet", image_size, image_size, self.multiple, self.reason)
        self.in_channels, self.num_classes = in_channels, num_classes
        embed_dim = 4 * base_channels
        frequencies = fl.from_numpy(timestep_frequencies(base_channels, shift=1))
        self.register_buffer("time_frequencies", frequencies, persistent=False)
        self.time_embed = nn.Sequential(
            nn.Linear(base_channels, embed_dim), nn.SiLU(), nn.Linear(embed_dim, embed_dim)
        )
        self.label_embed = None
        if num_classes is not None:  # the last row is the null class
            self.label_embed = nn.Embedding(num_classes + 1, embed_dim)
        blocks = (
            partial(
                ResBlock, embed_dim=embed_dim, dropout=dropout, groups=num_groups,
                checkpoint=checkpoint,
            ),
            partial(AttentionBlock, num_heads=num_heads, groups=num_groups, checkpoint=checkpoint),
        )  # fmt: skip
        # per resolution, highest first: (channels, whether it has attention)
        levels = [
            (base_channels * mult, image_size // 2**level in attention_resolutions)
            for level, mult in enumerate(channel_mult)
        ]
        self.conv_in = nn.Conv2d(in_channels, base_channels, 3, padding=1)
        skips = self._make_encoder(base_channels, levels, num_res_blocks, blocks)
        channels = skips[-1]
        self.mid_block1 = blocks[0](channels, channels)
        self.mid_attention = blocks[1](channels)
        self.mid_block2 = blocks[0](channels, channels)
        channels = self._make_decoder(channels, levels, skips, num_res_blocks, blocks)
        self.norm_out = nn.GroupNorm(num_groups, channels)
        self.conv_out = nn.Conv2d(channels, in_channels, 3, padding=1)
        nn.init.zeros_(self.conv_out.weight)
        nn.init.zeros_(self.conv_out.bias)

    def _make_encoder(self, channels, levels, num_res_blocks, blocks) -> list[int]:
        """``self.down``; returns the widths of the skip connections, in the order pushed."""
        skips = [channels]
        self.down = nn.ModuleList()
        for level, (width, attention) in enumerate(levels):
            last = level == len(levels) - 1
            self.down.append(
                DownStage(channels, width, num_res_blocks, attention, not last, blocks)
            )
            skips += [width] * (num_res_blocks if last else num_res_blocks + 1)
            channels = width
        return skips

    def _make_decoder(self, channels, levels, skips, num_res_blocks, blocks) -> int:
        """``self.up``, taking ``skips`` from the end; returns its output width."""
        self.up = nn.ModuleList()
        for level, (width, attention) in reversed(list(enumerate(levels))):
            taken = [skips.pop() for _ in range(num_res_blocks + 1)]
            self.up.append(UpStage(channels, width, taken, attention, level > 0, blocks))
            channels = width
        return channels

    def forward(self, x, t, y=None):
        check_inputs(self, x, t, y, self.multiple, self.reason)
        emb = self.time_embed(sinusoidal_embedding(t, self.time_frequencies, cos_first=False))
        if self.label_embed is not None:
            emb = emb + self.label_embed(labels_or_null(y, t, self.num_classes))
        h = self.conv_in(x)
        skips = [h]
        for stage in self.down:
            h = stage(h, emb, skips)
        h = self.mid_block2(self.mid_attention(self.mid_block1(h, emb)), emb)
        for stage in self.up:
            h = stage(h, emb, skips)
        return self.conv_out(F.silu(self.norm_out(h)))


# --- DiT --------------------------------------------------------------------------------------


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
        self.register_buffer("pos_embed", fl.from_numpy(position)[None], persistent=False)
        frequencies = fl.from_numpy(timestep_frequencies(frequency_size, shift=0))
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
