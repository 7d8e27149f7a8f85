"""EMA of a model's weights: one ``update_parameters`` per training step.

    python -m bench.ema --out DIR [--quick] [--repeats N]

A transformer-shaped set of 301 float32 tensors, ~33.4 M elements (25 layers of d=320 and an
embedding). Systems, in one run on one GPU:

- ``flame``: ``flame.optim.swa_utils.AveragedModel(model, multi_avg_fn=
  get_ema_multi_avg_fn(0.999))``, lazy mode (one multi-tensor kernel and the n_averaged
  increment per update);
- ``torch_foreach_lerp``: ``torch._foreach_lerp_(ema, params, 0.001)`` alone (the floor of
  what PyTorch's EMA can do);
- ``torch_averaged_model``: ``torch.optim.swa_utils.AveragedModel`` with the same
  ``get_ema_multi_avg_fn(0.999)`` (it reads ``n_averaged`` back to the host every update).

"device ms": the GPU's time alone (host work hidden behind a spin kernel); "per call ms":
CUDA events around each call, host gaps included; "host us": wall time per update queued
back to back (no synchronisation inside). The floor reads the EMA and the weights and writes
the EMA once: 12 bytes per element at the measured copy bandwidth. The FLAME and PyTorch
EMAs are compared after the same updates. Writes ``ema.json`` and ``ema.md`` under
``--out``. Needs a GPU (CuPy, PyTorch with CUDA).
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

from bench.training import copy_bandwidth, device_ms, median_ms

DECAY = 0.999
LAYERS, WIDTH, VOCAB = 25, 320, 8192
QUICK = dict(layers=4, width=64, vocab=256)


def layer_shapes(width: int) -> list[tuple[int, ...]]:
    """One transformer layer: qkv, output, two MLP matrices, their biases, two norms."""
    hidden = 4 * width
    return [
        (3 * width, width), (3 * width,), (width, width), (width,),
        (hidden, width), (hidden,), (width, hidden), (width,),
        (width,), (width,), (width,), (width,),
    ]  # fmt: skip


def model_shapes(quick: bool) -> list[tuple[int, ...]]:
    layers, width, vocab = (
        (QUICK["layers"], QUICK["width"], QUICK["vocab"]) if quick else (LAYERS, WIDTH, VOCAB)
    )
    return [(vocab, width)] + layer_shapes(width) * layers


def host_us(run, calls: int, synchronize) -> float:
    synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    elapsed = time.perf_counter() - start
    synchronize()
    return elapsed / calls * 1e6


def flame_ema(weights, repeats: int) -> tuple[dict, object]:
    import cupy

    import flame as fl
    import flame.nn as nn
    from flame.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    with fl.backend("cuda"):
        model = nn.Module()
        model.params = nn.ParameterList(
            [nn.Parameter(fl.from_dlpack(cupy.array(w, copy=True))) for w in weights]
        )
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
        start = time.perf_counter()
        ema.update_parameters(model)  # the first update copies
        ema.update_parameters(model)  # the second averages: compiles the kernel
        fl.synchronize()
        first = time.perf_counter() - start

        def update():
            ema.update_parameters(model)

        result = {
            "ms": median_ms(update, repeats),
            "device_ms": device_ms(update, repeats),
            "host_us": host_us(update, 50, fl.synchronize),
            "first_two_updates_s": first,
        }
    return result, (ema, model)


def torch_setup(weights):
    import torch

    params = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.as_tensor(w, device="cuda").clone()) for w in weights]
    )
    return params


def torch_foreach(weights, repeats: int) -> dict:
    import torch

    params = [p.detach() for p in torch_setup(weights)]
    ema = [p.clone() for p in params]

    def update():
        torch._foreach_lerp_(ema, params, 1 - DECAY)

    return {
        "ms": median_ms(update, repeats),
        "device_ms": device_ms(update, repeats),
        "host_us": host_us(update, 50, torch.cuda.synchronize),
    }


def torch_averaged(weights, repeats: int) -> tuple[dict, object]:
    import torch
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = torch.nn.Module()
    model.params = torch_setup(weights)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    ema.update_parameters(model)

    def update():
        ema.update_parameters(model)

    result = {
        "ms": median_ms(update, repeats),
        "device_ms": device_ms(update, repeats),
        "host_us": host_us(update, 50, torch.cuda.synchronize),
    }
    return result, (ema, model)


def worst_difference(flame_pair, torch_pair, updates: int) -> float:
    """Both EMAs restarted from the same weights, ``updates`` updates with the weights
    scaled between them; the largest difference relative to each tensor's largest value."""
    import cupy
    import torch

    import flame as fl

    (ema, model), (torch_ema, torch_model) = flame_pair, torch_pair
    for mine, theirs in zip(ema.module.parameters(), torch_ema.module.parameters()):
        with fl.no_grad():
            mine.copy_(fl.from_dlpack(cupy.asarray(theirs.detach())))
    for _ in range(updates):
        with fl.no_grad(), fl.backend("cuda"):
            for param in model.parameters():
                param.mul_(1.01)
        with torch.no_grad():
            for param in torch_model.parameters():
                param.mul_(1.01)
        ema.update_parameters(model)
        torch_ema.update_parameters(torch_model)
    worst = 0.0
    for mine, theirs in zip(ema.module.parameters(), torch_ema.module.parameters()):
        ours, other = cupy.from_dlpack(mine), cupy.asarray(theirs.detach())
        scale = float(cupy.abs(other).max()) + 1e-12
        worst = max(worst, float(cupy.abs(ours - other).max()) / scale)
    return worst


def run(quick: bool, repeats: int) -> dict:
    import cupy

    shapes = model_shapes(quick)
    rng = cupy.random.default_rng(0)
    weights = [rng.standard_normal(shape, dtype=cupy.float32) * 0.02 for shape in shapes]
    elements = sum(int(np.prod(shape)) for shape in shapes)
    flame_result, flame_pair = flame_ema(weights, repeats)
    foreach_result = torch_foreach(weights, repeats)
    averaged_result, torch_pair = torch_averaged(weights, repeats)
    bandwidth = copy_bandwidth()
    return {
        "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        "tensors": len(shapes), "elements": elements, "decay": DECAY,
        "floor_ms": 12 * elements / bandwidth * 1e3, "copy_bandwidth_tb_s": bandwidth / 1e12,
        "flame": flame_result, "torch_foreach_lerp": foreach_result,
        "torch_averaged_model": averaged_result,
        "max_relative_difference_vs_torch": worst_difference(flame_pair, torch_pair, 5),
    }  # fmt: skip


def markdown(report: dict) -> str:
    lines = [
        f"# EMA update ({report['device']})",
        "",
        f"{report['tensors']} float32 tensors, {report['elements'] / 1e6:.1f} M elements, "
        f"decay {report['decay']}; floor {report['floor_ms']:.3f} ms (12 bytes per element "
        f"at {report['copy_bandwidth_tb_s']:.2f} TB/s)",
        "",
        "| system | device ms | of floor | per call ms | FLAME speed-up | host us |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    ours = report["flame"]
    for name in ("flame", "torch_foreach_lerp", "torch_averaged_model"):
        entry = report[name]
        lines.append(
            f"| {name} | {entry['device_ms']:.3f} | "
            f"{report['floor_ms'] / entry['device_ms']:.0%} | {entry['ms']:.3f} | "
            f"{entry['ms'] / ours['ms']:.2f}x | {entry['host_us']:.0f} |"
        )
    lines += [
        "",
        f"FLAME's first two updates (copy, then the first average: kernel compiled or loaded): "
        f"{ours['first_two_updates_s']:.3f} s; max relative difference vs PyTorch's "
        f"AveragedModel after the same updates: {report['max_relative_difference_vs_torch']:.2e}",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ema", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("out/ema"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=30)
    arguments = parser.parse_args(argv)
    arguments.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("FLAME_CACHE_DIR", tempfile.mkdtemp(prefix="flame-bench-cache-"))
    report = run(arguments.quick, arguments.repeats)
    (arguments.out / "ema.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (arguments.out / "ema.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
