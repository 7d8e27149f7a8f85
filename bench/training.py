"""Training-step benchmarks: the AdamW step and the bfloat16 MLP training step.

    python -m bench.training --out DIR [--quick]

Peers in the same run: PyTorch's fused and foreach AdamW; for the MLP, PyTorch eager and
``torch.compile`` (forward and backward compiled, fused AdamW). "device ms": median of
CUDA-event timings with the host's work hidden behind a spin kernel (the GPU's time alone);
"per call ms": events around each call, host gaps included. "first call": wall time of the
first step in this process with FLAME's kernel cache empty (a fresh ``FLAME_CACHE_DIR``); the
MLP's first step is also timed in new processes, with the cache cold, then warm.
Writes ``training.json`` and ``training.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ADAMW_SHAPES = [(1024, 1024)] * 150 + [(65536,)] * 50  # 200 params, 160.6 M elements
ADAMW_QUICK = [(64, 64)] * 150 + [(1000,)] * 50
MLP = dict(batch=8192, d_in=4096, d_hidden=16384)
MLP_QUICK = dict(batch=256, d_in=256, d_hidden=512)
LR, WEIGHT_DECAY = 1e-3, 1e-2


def median_ms(run, repeats: int, warmup: int = 3, spin_s: float = 0.0) -> float:
    """Median CUDA-event time of ``run`` after warm-up. With ``spin_s``, each run is queued
    while the GPU still executes a spin kernel that long, so the host's work is hidden and the
    events time the kernels back to back (device time); without, host gaps count (per call)."""
    import cupy

    from bench.clocks import CupyClock

    clock = CupyClock()
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        if spin_s:
            cupy.cuda.Device().synchronize()
            clock.spin(spin_s)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        run()
        stop.record()
        stop.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(samples)


def device_ms(run, repeats: int) -> float:
    return median_ms(run, repeats, spin_s=0.02)


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write counted)."""
    import cupy

    source = cupy.ones(1 << 28, dtype=cupy.float32)
    target = cupy.empty_like(source)
    ms = median_ms(lambda: cupy.copyto(target, source), 10)
    return 2 * source.nbytes / (ms / 1e3)


# --- AdamW ---------------------------------------------------------------------------------


def adamw(quick: bool, repeats: int) -> dict:
    import cupy
    import torch

    import flame as fl

    shapes = ADAMW_QUICK if quick else ADAMW_SHAPES
    elements = sum(int(np.prod(shape)) for shape in shapes)
    rng = cupy.random.default_rng(0)
    inits = [rng.standard_normal(shape, dtype=cupy.float32) for shape in shapes]
    grads = [rng.standard_normal(shape, dtype=cupy.float32) for shape in shapes]

    params = [fl.from_dlpack(cupy.array(a, copy=True)).requires_grad_() for a in inits]
    for p, g in zip(params, grads):
        p.grad = fl.from_dlpack(g)
    opt = fl.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    start = time.perf_counter()
    opt.step()
    fl.synchronize()
    first = time.perf_counter() - start
    flame_ms = median_ms(opt.step, repeats)
    flame_device = device_ms(opt.step, repeats)
    calls = 20
    start = time.perf_counter()
    for _ in range(calls):
        opt.step()
    host_us = (time.perf_counter() - start) / calls * 1e6
    fl.synchronize()

    results = {
        "flame": {
            "ms": flame_ms, "device_ms": flame_device, "first_call_s": first,
            "host_us_per_step": host_us,
        }
    }  # fmt: skip
    steps_taken = 3 + repeats + 3 + repeats + calls + 1
    for variant in ("fused", "foreach"):
        tparams = [torch.as_tensor(a, device="cuda").clone().requires_grad_() for a in inits]
        for p, g in zip(tparams, grads):
            p.grad = torch.as_tensor(g, device="cuda")
        topt = torch.optim.AdamW(
            tparams, lr=LR, weight_decay=WEIGHT_DECAY, **{variant: True}
        )  # fmt: skip
        start = time.perf_counter()
        topt.step()
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        ms = median_ms(topt.step, repeats)
        device = device_ms(topt.step, repeats)
        results[f"torch_{variant}"] = {"ms": ms, "device_ms": device, "first_call_s": first}
        if variant == "fused":
            for _ in range(steps_taken - 1 - 2 * (3 + repeats)):
                topt.step()
            worst = 0.0
            for p, t in list(zip(params, tparams))[::37]:
                ours = cupy.from_dlpack(p)
                theirs = cupy.asarray(t.detach())
                scale = float(cupy.abs(theirs).max()) + 1e-12
                worst = max(worst, float(cupy.abs(ours - theirs).max()) / scale)
            results["max_relative_difference_vs_torch_fused"] = worst
        del topt, tparams
    bandwidth = copy_bandwidth()
    floor_ms = 28 * elements / bandwidth * 1e3  # p, m, v read+written, g read: 7 x 4 bytes
    return {
        "params": len(shapes), "elements": elements, "floor_ms": floor_ms,
        "copy_bandwidth_tb_s": bandwidth / 1e12, **results,
    }  # fmt: skip


# --- bfloat16 MLP training step ----------------------------------------------------------------


def flame_mlp(x, y, weights):
    """The FLAME side of the MLP benchmark from float32 CuPy/NumPy arrays: bf16 inputs and
    parameters, AdamW, and the compiled loss-and-gradients function."""
    import cupy

    import flame as fl
    import flame.nn.functional as F

    xs = fl.from_dlpack(cupy.asarray(x)).to(fl.bfloat16).realize()
    ys = fl.from_dlpack(cupy.asarray(y)).to(fl.bfloat16).realize()
    params = [fl.from_dlpack(cupy.asarray(w)).to(fl.bfloat16).realize() for w in weights]
    for p in params:
        p.requires_grad_()
    opt = fl.optim.AdamW(params, lr=1e-4, weight_decay=WEIGHT_DECAY)

    @fl.compile
    def loss_and_grads(x, y, w1, b1, w2, b2):
        def loss(w1, b1, w2, b2):
            return F.mse_loss(F.gelu(x @ w1 + b1) @ w2 + b2, y)

        return fl.value_and_grad(loss, argnums=(0, 1, 2, 3))(w1, b1, w2, b2)

    return xs, ys, params, opt, loss_and_grads


def mlp_flame(x_np, y_np, weights, repeats):
    import flame as fl

    x, y, params, opt, loss_and_grads = flame_mlp(x_np, y_np, weights)
    losses = []

    def step():
        loss, grads = loss_and_grads(x, y, *params)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        losses.append(loss)

    start = time.perf_counter()
    step()
    fl.synchronize()
    first = time.perf_counter() - start
    ms = median_ms(step, repeats)
    device = device_ms(step, repeats)
    return {
        "ms": ms, "device_ms": device, "first_call_s": first,
        "losses": [float(value.item()) for value in losses[:4]],
    }  # fmt: skip


def mlp_torch(x_np, y_np, weights, repeats, compiled: bool):
    import torch
    import torch.nn.functional as F

    device = "cuda"
    x = torch.as_tensor(x_np, device=device).bfloat16()
    y = torch.as_tensor(y_np, device=device).bfloat16()
    params = [torch.as_tensor(w, device=device).bfloat16().requires_grad_() for w in weights]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=WEIGHT_DECAY, fused=True)

    def loss_fn(x, y, w1, b1, w2, b2):
        return F.mse_loss(F.gelu(x @ w1 + b1) @ w2 + b2, y)

    loss_fn = torch.compile(loss_fn) if compiled else loss_fn
    losses = []

    def step():
        loss = loss_fn(x, y, *params)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    ms = median_ms(step, repeats)
    device = device_ms(step, repeats)
    return {
        "ms": ms, "device_ms": device, "first_call_s": first,
        "losses": [float(value) for value in losses[:4]],
    }  # fmt: skip


def mlp(quick: bool, repeats: int) -> dict:
    size = MLP_QUICK if quick else MLP
    rng = np.random.default_rng(0)
    b, d, h = size["batch"], size["d_in"], size["d_hidden"]
    x = rng.standard_normal((b, d), dtype=np.float32)
    y = rng.standard_normal((b, d), dtype=np.float32)
    weights = [
        rng.standard_normal((d, h), dtype=np.float32) / float(np.sqrt(d)),
        np.zeros(h, np.float32) + 0.01,
        rng.standard_normal((h, d), dtype=np.float32) / float(np.sqrt(h)),
        np.zeros(d, np.float32) + 0.01,
    ]
    flops = 3 * 2 * (2 * b * d * h)  # two matmuls forward, twice that backward
    results = {"flops": flops}
    results["flame"] = mlp_flame(x, y, weights, repeats)
    results["torch_eager"] = mlp_torch(x, y, weights, repeats, compiled=False)
    results["torch_compile"] = mlp_torch(x, y, weights, repeats, compiled=True)
    for entry in ("flame", "torch_eager", "torch_compile"):
        results[entry]["tflop_s"] = flops / (results[entry]["device_ms"] / 1e3) / 1e12
    return results


def first_step_process(quick: bool, cache: Path) -> dict:
    """The MLP's first FLAME step in a new process with this kernel cache folder: seconds to
    import FLAME, and seconds from the inputs on the GPU to the first step done (tracing,
    planning, kernels compiled or loaded from the cache, the step itself)."""
    code = (
        "import json, time; start = time.perf_counter(); import cupy, flame; "
        "imported = time.perf_counter() - start; import bench.training as t; "
        f"print(json.dumps(dict(t.first_step_only({quick!r}), import_s=imported)))"
    )
    environment = dict(os.environ, FLAME_CACHE_DIR=str(cache))
    # Python's bytecode as an installed package has it: written by the cold process into a
    # folder of its own (the tree may be read-only), read by the warm ones, as in
    # bench/flame_only.py. Without it each process compiled FLAME's lazily imported modules
    # (executor, codegen, optim) from source inside the timed step.
    environment["PYTHONPYCACHEPREFIX"] = str(cache / "pycache")
    environment.pop("PYTHONDONTWRITEBYTECODE", None)
    output = subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True,
        timeout=600, check=True,
    )  # fmt: skip
    return json.loads(output.stdout.strip().splitlines()[-1])


def first_step_only(quick: bool) -> dict:
    """Inputs made on the GPU, then the timed part: setup and one step."""
    import cupy

    import flame as fl

    size = MLP_QUICK if quick else MLP
    b, d, h = size["batch"], size["d_in"], size["d_hidden"]
    rng = cupy.random.default_rng(0)
    x = rng.standard_normal((b, d), dtype=cupy.float32)
    weights = [
        rng.standard_normal((d, h), dtype=cupy.float32) / 64,
        cupy.zeros(h, cupy.float32),
        rng.standard_normal((h, d), dtype=cupy.float32) / 128,
        cupy.zeros(d, cupy.float32),
    ]
    y = x * 0.5  # before the clock: CuPy's own kernel for this is not FLAME's first step
    cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    _mlp_first_step(x, y, weights)
    fl.synchronize()
    return {"first_step_s": time.perf_counter() - start}


def _mlp_first_step(x, y, weights):
    """Setup and one training step from float32 CuPy inputs: what a new process pays."""
    xs, ys, params, opt, loss_and_grads = flame_mlp(x, y, weights)
    loss, grads = loss_and_grads(xs, ys, *params)
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()
    return loss.item()


def markdown(report: dict) -> str:
    lines = [f"# Training benchmarks ({report['device']})", ""]
    a = report.get("adamw")
    if a:
        lines += [
            f"## AdamW step: {a['params']} params, {a['elements'] / 1e6:.1f} M elements, float32",
            "",
            f"floor {a['floor_ms']:.3f} ms (28 B/element at {a['copy_bandwidth_tb_s']:.2f} TB/s)",
            "",
            "| system | device ms | vs floor | FLAME speed-up | per call ms | FLAME speed-up "
            "| first call s |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name in ("flame", "torch_fused", "torch_foreach"):
            entry, ours = a[name], a["flame"]
            lines.append(
                f"| {name} | {entry['device_ms']:.3f} | {entry['device_ms'] / a['floor_ms']:.2f}x "
                f"| {entry['device_ms'] / ours['device_ms']:.2f}x | {entry['ms']:.3f} | "
                f"{entry['ms'] / ours['ms']:.2f}x | {entry['first_call_s']:.3f} |"
            )
        lines += [
            "",
            f"FLAME host time per step: {a['flame']['host_us_per_step']:.0f} us; max relative "
            f"difference vs torch fused after the same steps: "
            f"{a['max_relative_difference_vs_torch_fused']:.2e}",
            "",
        ]
    m = report.get("mlp")
    if m:
        lines += [
            "## bfloat16 MLP training step (Linear, GELU, Linear, MSE, AdamW)",
            "",
            "| system | device ms | TFLOP/s | FLAME speed-up | per call ms | FLAME speed-up "
            "| first call s | losses |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name in ("flame", "torch_eager", "torch_compile"):
            entry, ours = m[name], m["flame"]
            losses = ", ".join(f"{value:.4f}" for value in entry["losses"])
            lines.append(
                f"| {name} | {entry['device_ms']:.3f} | {entry['tflop_s']:.0f} | "
                f"{entry['device_ms'] / ours['device_ms']:.2f}x | {entry['ms']:.3f} | "
                f"{entry['ms'] / ours['ms']:.2f}x | {entry['first_call_s']:.2f} | {losses} |"
            )
        if "first_step_cold" in m:
            cold, warm = m["first_step_cold"], m["first_step_warm"]
            runs = ", ".join(f"{run:.3f}" for run in warm.get("runs_s", []))
            lines += [
                "",
                f"FLAME first step in a new process, from inputs on the GPU to the step done: "
                f"cold kernel cache {cold['first_step_s']:.3f} s, warm disk cache "
                f"{warm['first_step_s']:.3f} s (median of 3 processes: "
                f"{runs}; importing flame before that: "
                f"{cold['import_s']:.2f} s / {warm['import_s']:.2f} s; Python bytecode written "
                f"by the cold process, read by the warm ones)",
            ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.training", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("out/training"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--only", choices=("adamw", "mlp"), action="append")
    arguments = parser.parse_args(argv)
    arguments.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("FLAME_CACHE_DIR", tempfile.mkdtemp(prefix="flame-bench-cache-"))
    import cupy

    report = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()}
    chosen = arguments.only or ["adamw", "mlp"]
    first_steps = {}
    if "mlp" in chosen:  # new processes first, while no peer has left workers or memory behind
        cache = Path(tempfile.mkdtemp(prefix="flame-first-step-"))
        first_steps["first_step_cold"] = first_step_process(arguments.quick, cache)
        warm = [first_step_process(arguments.quick, cache) for _ in range(3)]
        median = sorted(warm, key=lambda run: run["first_step_s"])[1]
        first_steps["first_step_warm"] = {**median, "runs_s": [r["first_step_s"] for r in warm]}
    if "adamw" in chosen:
        report["adamw"] = adamw(arguments.quick, arguments.repeats)
    if "mlp" in chosen:
        report["mlp"] = {**mlp(arguments.quick, arguments.repeats), **first_steps}
    (arguments.out / "training.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (arguments.out / "training.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
