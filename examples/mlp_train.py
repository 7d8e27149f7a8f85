"""Train a small bfloat16 MLP with a compiled training step and AdamW.

    python examples/mlp_train.py [--batch B] [--hidden H] [--steps N]

The step (forward, backward) is one ``flame.compile``d function: traced once, then replayed;
AdamW updates every parameter with one multi-tensor kernel. Prints the loss as it falls and
the time per step. ``flame dump --profile examples/mlp_train.py`` shows its kernels.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import flame as fl
import flame.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    arguments = parser.parse_args()
    rng = np.random.default_rng(0)
    b, d, h = arguments.batch, arguments.features, arguments.hidden
    teacher = rng.standard_normal((d, d)).astype(np.float32) / np.float32(np.sqrt(d))
    x_host = rng.standard_normal((b, d)).astype(np.float32)
    x = fl.tensor(x_host).to(fl.bfloat16).realize()
    y = fl.tensor(np.tanh(x_host @ teacher)).to(fl.bfloat16).realize()
    params = [
        fl.tensor(rng.standard_normal((d, h)).astype(np.float32) / np.float32(np.sqrt(d))),
        fl.zeros(h),
        fl.tensor(rng.standard_normal((h, d)).astype(np.float32) / np.float32(np.sqrt(h))),
        fl.zeros(d),
    ]
    params = [p.to(fl.bfloat16).realize().requires_grad_() for p in params]
    w1, b1, w2, b2 = params
    opt = fl.optim.AdamW(params, lr=arguments.lr, weight_decay=0.01)

    @fl.compile
    def step(x, y):
        loss = F.mse_loss(F.gelu(x @ w1 + b1) @ w2 + b2, y)
        loss.backward()
        return loss

    start = time.perf_counter()
    for index in range(arguments.steps):
        loss = step(x, y)
        opt.step()
        opt.zero_grad()
        if index % 5 == 0 or index == arguments.steps - 1:
            print(f"step {index:3d}  loss {loss.item():.4f}")
    fl.synchronize()
    elapsed = (time.perf_counter() - start) / arguments.steps
    print(f"{elapsed * 1e3:.2f} ms per step (first step included); {step.cache_info()}")


if __name__ == "__main__":
    main()
