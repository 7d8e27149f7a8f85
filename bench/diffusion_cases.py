"""What bench/diffusion.py compares: the cases, the targets, and the pieces every section
builds its systems from (FLAME's ``Trainer`` and batches, the PyTorch twin and its step), with
the same weights, schedule, label dropout and EMA on both sides."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from bench import conv_attention as ca

CLASSES, CHANNELS, LR, EMA_DECAY, CFG_DROPOUT, GUIDANCE = 10, 3, 2e-4, 0.9999, 0.1, 2.0
TARGETS = {  # peer ms / FLAME ms at least; first-step: ms at most
    "unet": {"torch_compile": 1.25, "torch_eager": 1.7},
    "dit": {"torch_compile": 1.2},
    "sampling": {"torch_compile": 1.2},
    "first-step": {"cold": 10_000, "warm_disk": 1_000, "new_resolution": 1_000},
}
# (model, size, image size, batch); sampling: (..., images, DDIM steps)
STEP_CASES = {
    "full": [("unet", "full", 32, 64), ("unet", "full", 64, 16), ("dit", "full", 32, 64)],
    "quick": [("unet", "full", 32, 64), ("dit", "full", 32, 64)],
    "tiny": [("unet", "tiny", 8, 2), ("dit", "tiny", 8, 2)],
}
SAMPLING_CASES = {
    "full": [("unet", "full", 32, 256, 50), ("dit", "full", 32, 256, 50)],
    "quick": [("unet", "full", 32, 256, 50)],
    "tiny": [("unet", "tiny", 8, 2, 3)],
}
# the first-step case, then the new resolution's (image size, batch)
FIRST_STEP = {
    "cuda": (("unet", "full", 32, 64), (64, 16)),
    "reference": (("unet", "tiny", 8, 2), (16, 2)),
}


def progress(message: str) -> None:
    print(f"[diffusion] {message}", file=sys.stderr, flush=True)


def targets_met(targets: dict, found: dict) -> dict:
    return {k: None if found.get(k) is None else found[k] >= v for k, v in targets.items()}


def torch_model(case, backend: str):
    import torch

    from bench.diffusion_models_torch import build_model

    torch.manual_seed(0)
    model = build_model(case[0], case[2], CHANNELS, CLASSES, case[1])
    return model.to(ca.torch_device(backend))


def flame_trainer(case, state=None, checkpoint: bool = False):
    """The example's ``Trainer`` (weights from ``state`` if given), learning rate constant."""
    from examples.diffusion.models import build_model
    from examples.diffusion.train import Trainer

    def builder(*arguments, **overrides):
        model = build_model(*arguments, **overrides)
        if state is not None:
            model.load_state_dict(state)
        return model

    options = SimpleNamespace(seed=0, checkpoint_blocks=checkpoint, lr=LR, weight_decay=0.0,
                              warmup=1, bf16=True, prediction="eps", cfg_dropout=CFG_DROPOUT,
                              grad_clip=1.0, ema=EMA_DECAY)  # fmt: skip
    config = {"model": case[0], "size": case[1], "image_size": case[2], "channels": CHANNELS,
              "num_classes": CLASSES, "schedule": "linear", "prediction": "eps"}  # fmt: skip
    trainer = Trainer(options, config, builder)
    trainer.prepare()
    return trainer


def flame_batch(image_size: int, batch: int):
    import flame as fl

    images = fl.randn(batch, CHANNELS, image_size, image_size).clamp(-1.0, 1.0).realize()
    return images, fl.randint(0, CLASSES, (batch,), dtype=fl.int64).realize()


def torch_batch(image_size: int, batch: int, backend: str):
    import torch

    device = ca.torch_device(backend)
    images = torch.randn(batch, CHANNELS, image_size, image_size, device=device).clamp(-1, 1)
    return images, torch.randint(0, CLASSES, (batch,), device=device)


class TorchStep:
    """The example's step in PyTorch: same loss (linear schedule, eps), clip, AdamW (fused on
    the GPU), EMA at a fixed decay (FLAME warms the decay up, on the device)."""

    def __init__(self, model, backend: str, compiled: bool):
        import numpy as np
        import torch

        from examples.diffusion.diffusion import linear_betas

        self.torch, self.model, self.device = torch, model.train(), ca.torch_device(backend)
        self.params = list(model.parameters())
        self.ema = [p.detach().clone() for p in self.params]
        fused = self.device == "cuda"
        self.optimizer = torch.optim.AdamW(self.params, lr=LR, weight_decay=0.0, fused=fused)
        alpha_bar = np.cumprod(1.0 - linear_betas())
        self.a, self.s = (torch.tensor(np.sqrt(v), dtype=torch.float32, device=self.device)
                          for v in (alpha_bar, 1.0 - alpha_bar))  # fmt: skip
        self.loss = torch.compile(self.eager_loss) if compiled else self.eager_loss

    def eager_loss(self, images, labels):
        torch, batch = self.torch, images.shape[0]
        t = torch.randint(0, len(self.a), (batch,), device=self.device)
        noise = torch.randn_like(images)
        dropped = torch.rand(batch, device=self.device) < CFG_DROPOUT
        labels = torch.where(dropped, torch.full_like(labels, CLASSES), labels)
        a, s = self.a[t].view(-1, 1, 1, 1), self.s[t].view(-1, 1, 1, 1)
        with torch.autocast(self.device, dtype=torch.bfloat16):
            output = self.model(a * images + s * noise, t, labels)
        return torch.nn.functional.mse_loss(output.float(), noise)

    def __call__(self, images, labels):
        loss = self.loss(images, labels)
        loss.backward()
        norm = self.torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with self.torch.no_grad():
            self.torch._foreach_lerp_(self.ema, self.params, 1.0 - EMA_DECAY)
        return loss.detach(), norm
