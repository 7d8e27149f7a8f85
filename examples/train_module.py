"""Train a small convolutional ``flame.nn`` model with bf16 autocast, an EMA of its weights and
a checkpoint it resumes from exactly.

    python examples/train_module.py [--steps 60] [--save-every 20] [--dir runs/module]
    python examples/train_module.py --resume runs/module/step_40.safetensors --steps 60

The model is ordinary PyTorch-style module code (``Conv2d``, ``GroupNorm``, ``SiLU``,
``Linear``); the task is to regress a fixed random "teacher" network's outputs on random
images, so no dataset is needed. The step (forward under ``fl.autocast``, loss, backward) is
one ``flame.compile``d function; AdamW and the EMA update are one multi-tensor kernel each.
Every ``--save-every`` steps a safetensors checkpoint holds the model, the EMA, the optimizer,
the LR schedule, the step and the random generator's state; a run resumed from it continues
with the same numbers as the run that wrote it (the last line prints a checksum of the
weights to compare). Without a GPU it runs on the reference backend, smaller.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

import flame as fl
import flame.nn as nn
import flame.nn.functional as F
from flame.io import load_checkpoint, save_checkpoint
from flame.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


class Block(nn.Module):
    def __init__(self, channels: int, groups: int = 8):
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.conv(self.act(self.norm(x)))


class Net(nn.Module):
    def __init__(self, channels: int = 32, blocks: int = 2, outputs: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*[Block(channels) for _ in range(blocks)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(channels, outputs)

    def forward(self, x):
        h = self.pool(self.blocks(self.stem(x)))
        return self.head(h.flatten(1))


def main() -> None:
    from flame.runtime.device import gpu_available, gpu_unavailable_reason

    if gpu_available():
        train()
    else:
        print(f"no GPU ({gpu_unavailable_reason()}): running on the reference backend")
        with fl.backend("reference"):
            train()


def train() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--dir", type=Path, default=Path("runs/module"))
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--batch", type=int, default=64)
    options = parser.parse_args()
    gpu = fl.get_backend() == "cuda"
    size, channels = (32, 64) if gpu else (8, 16)
    batch = options.batch if gpu else 8

    fl.manual_seed(0)
    teacher = Net(channels=8, blocks=1).eval()
    model = Net(channels=channels)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))
    optimizer = fl.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    schedule = fl.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    start_step = 0
    if options.resume is not None:
        state = load_checkpoint(
            options.resume, model=model, ema=ema, optimizer=optimizer, scheduler=schedule
        )
        start_step = state["step"]
        print(f"resumed from {options.resume} at step {start_step}")

    @fl.compile
    def step(x, target):
        with fl.autocast(dtype=fl.bfloat16):
            loss = F.mse_loss(model(x).float(), target)
        loss.backward()
        return loss

    options.dir.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    for index in range(start_step, options.steps):
        x = fl.randn(batch, 3, size, size)
        with fl.no_grad():
            target = teacher(x).realize()
        loss = step(x, target)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        ema.update_parameters(model)
        if index % 10 == 0 or index == options.steps - 1:
            print(f"step {index:4d}  loss {loss.item():.5f}  lr {schedule.get_last_lr()[0]:.2e}")
        if (index + 1) % options.save_every == 0:
            path = options.dir / f"step_{index + 1}.safetensors"
            save_checkpoint(
                path, model=model, ema=ema, optimizer=optimizer, scheduler=schedule,
                step=index + 1,
            )  # fmt: skip
            print(f"saved {path}")
    fl.synchronize()
    elapsed = time.perf_counter() - began
    checksum = sum(float(np.abs(p.numpy()).sum()) for p in model.parameters())
    print(f"{elapsed:.1f} s; {step.cache_info()}")
    print(f"weights checksum {checksum:.6f}")


if __name__ == "__main__":
    main()
