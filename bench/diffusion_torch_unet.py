"""``UNet``, the DDPM CIFAR-10 denoiser, on ``torch.nn``: ``examples/diffusion/unet.py`` line
for line (a ``diff`` shows the imports and the calls that differ: ``cat``, ``from_numpy``).
Built through ``diffusion_models_torch.build_model``. Nothing here imports FLAME."""

from __future__ import annotations

from functools import partial

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
            h = attention(res_block(torch.cat([h, skips.pop()], dim=1), emb))
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
        frequencies = torch.from_numpy(timestep_frequencies(base_channels, shift=1))
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
