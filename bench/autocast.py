"""Autocast benchmark: a bfloat16-autocast MLP training step with float32 master weights.

    python -m bench.autocast --out DIR [--quick] [--repeats N]
    python -m bench.autocast --smoke --out DIR   # no GPU: a tiny step on the CPU, both sides

Linear, GELU, Linear, MSE, AdamW (batch 4096, 1024 -> 4096 -> 1024): parameters, gradients
and optimizer state in float32; the forward (and so its backward) in bfloat16 where
PyTorch's autocast lists say so (the products), float32 for the loss. Peers in the same
run: PyTorch eager under ``torch.autocast`` and ``torch.compile`` (the loss function) under
``torch.autocast``, both with fused AdamW. FLAME: the loss and gradients as one
``flame.compile``d function called under ``flame.autocast(dtype=flame.bfloat16)`` (the
autocast state is part of its signature), then ``AdamW.step``. Timings as in
bench/training.py: "device ms" (the GPU's time alone, host work hidden behind a spin
kernel), "per call ms" (host gaps included), and the ratios of each peer to FLAME.
Writes ``autocast.json`` and ``autocast.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MLP = dict(batch=4096, d_in=1024, d_hidden=4096)
MLP_QUICK = dict(batch=256, d_in=128, d_hidden=512)
MLP_SMOKE = dict(batch=32, d_in=16, d_hidden=64)
LR, WEIGHT_DECAY = 1e-4, 1e-2
SYSTEMS = ("flame", "torch_eager", "torch_compile")


def problem(size: dict, seed: int = 0):
    """Inputs, targets and the four float32 parameters (w1, b1, w2, b2) as NumPy arrays."""
    rng = np.random.default_rng(seed)
    b, d, h = size["batch"], size["d_in"], size["d_hidden"]
    x = rng.standard_normal((b, d), dtype=np.float32)
    y = rng.standard_normal((b, d), dtype=np.float32)
    weights = [
        rng.standard_normal((d, h), dtype=np.float32) / float(np.sqrt(d)),
        np.full(h, 0.01, np.float32),
        rng.standard_normal((h, d), dtype=np.float32) / float(np.sqrt(h)),
        np.full(d, 0.01, np.float32),
    ]
    return x, y, weights


def flame_step(x_np, y_np, weights, backend: str = "cuda"):
    """FLAME's training step (a function of no arguments) and the list its losses go to."""
    import flame as fl
    import flame.nn.functional as F

    with fl.backend(backend):
        if backend == "cuda":
            import cupy

            x, y = (fl.from_dlpack(cupy.asarray(a)) for a in (x_np, y_np))
            params = [fl.from_dlpack(cupy.asarray(w).copy()) for w in weights]
        else:
            x, y = fl.tensor(x_np).realize(), fl.tensor(y_np).realize()
            params = [fl.tensor(w.copy()).realize() for w in weights]
    for p in params:
        p.requires_grad_()
    opt = fl.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)

    @fl.compile
    def loss_and_grads(x, y, w1, b1, w2, b2):
        def loss(w1, b1, w2, b2):
            return F.mse_loss(F.gelu(x @ w1 + b1) @ w2 + b2, y)

        return fl.value_and_grad(loss, argnums=(0, 1, 2, 3))(w1, b1, w2, b2)

    losses = []

    def step():
        with fl.autocast(dtype=fl.bfloat16):
            loss, grads = loss_and_grads(x, y, *params)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        losses.append(loss)

    return step, losses, loss_and_grads


def torch_step(x_np, y_np, weights, compiled: bool, device: str = "cuda"):
    import torch
    import torch.nn.functional as F

    x, y = (torch.as_tensor(a, device=device) for a in (x_np, y_np))
    params = [torch.as_tensor(w, device=device).clone().requires_grad_() for w in weights]
    fused = device == "cuda"
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=fused)

    def loss_fn(x, y, w1, b1, w2, b2):
        return F.mse_loss(F.gelu(x @ w1 + b1) @ w2 + b2, y)

    loss_fn = torch.compile(loss_fn) if compiled else loss_fn
    losses = []

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = loss_fn(x, y, *params)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    return step, losses


def measure(step, losses, repeats: int, synchronize) -> dict:
    from bench.training import device_ms, median_ms

    start = time.perf_counter()
    step()
    synchronize()
    first = time.perf_counter() - start
    ms = median_ms(step, repeats)
    device = device_ms(step, repeats)
    return {
        "ms": ms, "device_ms": device, "first_call_s": first,
        "losses": [float(value.item()) for value in losses[:4]],
    }  # fmt: skip


def run_gpu(quick: bool, repeats: int) -> dict:
    import torch

    import flame as fl

    size = MLP_QUICK if quick else MLP
    x, y, weights = problem(size)
    b, d, h = size["batch"], size["d_in"], size["d_hidden"]
    flops = 3 * 2 * (2 * b * d * h)  # two products forward, twice that backward
    report = {"size": size, "flops": flops}
    step, losses, compiled = flame_step(x, y, weights)
    report["flame"] = measure(step, losses, repeats, fl.synchronize)
    report["flame"]["traces"] = compiled.cache_info().traces  # 1: no retrace per step
    del step, losses, compiled
    for name, is_compiled in (("torch_eager", False), ("torch_compile", True)):
        step, losses = torch_step(x, y, weights, is_compiled)
        report[name] = measure(step, losses, repeats, torch.cuda.synchronize)
        del step, losses
    ours = report["flame"]
    for name in SYSTEMS:
        entry = report[name]
        entry["tflop_s"] = flops / (entry["device_ms"] / 1e3) / 1e12
        entry["device_ratio_to_flame"] = entry["device_ms"] / ours["device_ms"]
        entry["per_call_ratio_to_flame"] = entry["ms"] / ours["ms"]
    return report


def run_smoke(steps: int = 3) -> dict:
    """No GPU: a few steps of the tiny problem on FLAME's reference backend and PyTorch's
    CPU autocast, wall time per step (not a speed claim) and the losses side by side."""
    x, y, weights = problem(MLP_SMOKE)
    report = {"size": MLP_SMOKE, "smoke": True}
    step, losses, compiled = flame_step(x, y, weights, backend="reference")
    report["flame"] = _wall(step, losses, steps)
    report["flame"]["traces"] = compiled.cache_info().traces
    step, losses = torch_step(x, y, weights, compiled=False, device="cpu")
    report["torch_eager"] = _wall(step, losses, steps)
    return report


def _wall(step, losses, steps: int) -> dict:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    values = [float(value.item()) for value in losses]
    return {"wall_ms_per_step": (time.perf_counter() - start) / steps * 1e3, "losses": values}


def markdown(report: dict) -> str:
    size = report["size"]
    shape = f"batch {size['batch']}, {size['d_in']} -> {size['d_hidden']} -> {size['d_in']}"
    lines = [f"# Autocast bfloat16 MLP training step ({report.get('device', 'CPU smoke')})", ""]
    lines += [f"{shape}; float32 master weights, AdamW; FLAME compiled under flame.autocast", ""]
    if report.get("smoke"):
        lines += [
            "| system | wall ms/step (CPU, not a speed claim) | losses |",
            "| --- | --- | --- |",
        ]
        for name in SYSTEMS:
            entry = report.get(name)
            if entry:
                losses = ", ".join(f"{value:.4f}" for value in entry["losses"])
                lines.append(f"| {name} | {entry['wall_ms_per_step']:.2f} | {losses} |")
        return "\n".join(lines) + "\n"
    lines += [
        "| system | device ms | TFLOP/s | vs FLAME (device) | per call ms | vs FLAME (per call) "
        "| first call s | losses |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in SYSTEMS:
        entry = report[name]
        losses = ", ".join(f"{value:.4f}" for value in entry["losses"])
        lines.append(
            f"| {name} | {entry['device_ms']:.3f} | {entry['tflop_s']:.0f} | "
            f"{entry['device_ratio_to_flame']:.2f}x | {entry['ms']:.3f} | "
            f"{entry['per_call_ratio_to_flame']:.2f}x | {entry['first_call_s']:.2f} | {losses} |"
        )
    lines += ["", f"FLAME traces of the compiled step: {report['flame']['traces']}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.autocast", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("out/autocast"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run, no GPU needed")
    parser.add_argument("--repeats", type=int, default=20)
    arguments = parser.parse_args(argv)
    arguments.out.mkdir(parents=True, exist_ok=True)
    if arguments.smoke:
        report = run_smoke()
    else:
        os.environ.setdefault("FLAME_CACHE_DIR", tempfile.mkdtemp(prefix="flame-bench-cache-"))
        import cupy

        report = {
            "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
            **run_gpu(arguments.quick, arguments.repeats),
        }  # fmt: skip
    (arguments.out / "autocast.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (arguments.out / "autocast.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
