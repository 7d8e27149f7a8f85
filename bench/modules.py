"""Module overhead: a compiled training step of a 200-layer ``flame.nn`` model against the
same step written with bare tensors.

    python -m bench.modules --out DIR [--quick] [--backend cuda|reference]

The model is ``Sequential`` of 200 ``Linear`` layers with ``SiLU`` between them; the bare
version holds the same weights in a list and calls ``x @ w.T + b``. Both steps (forward, MSE,
backward) are ``flame.compile``d. Sizes are small (width 64, batch 16) so the step is bound by
the host: "per call us" is the wall time of a burst of calls divided by their number, the
GPU synchronised once at the end of the burst (the median over bursts, the steps taking
turns). PyTorch eager runs the same module for context, and the module step compiled with
``cuda_graph=True`` asks for its ~1600 kernels and cuBLAS calls as one CUDA graph (the cache
info says whether one was captured). The target (issue 19): module overhead is paid at trace time
only, so the two FLAME figures match. Writes ``modules.json`` and ``modules.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

LAYERS, WIDTH, BATCH = 200, 64, 16


def _bursts(call, sync, calls: int, bursts: int) -> float:
    for _ in range(3):
        call()
    sync()
    samples = []
    for _ in range(bursts):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        sync()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def flame_steps(backend: str, layers: int, calls: int, bursts: int) -> dict:
    import flame as fl
    import flame.nn as nn
    import flame.nn.functional as F

    with fl.backend(backend):
        fl.manual_seed(0)
        stack = []
        for _ in range(layers):
            stack += [nn.Linear(WIDTH, WIDTH), nn.SiLU()]
        model = nn.Sequential(*stack)
        bare = [(m.weight.detach(), m.bias.detach()) for m in model if isinstance(m, nn.Linear)]
        bare = [(w.clone().realize().requires_grad_(), b.clone().realize().requires_grad_())
                for w, b in bare]  # fmt: skip
        x = fl.randn(BATCH, WIDTH).realize()
        y = fl.randn(BATCH, WIDTH).realize()

        @fl.compile
        def module_step(x, y):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        @fl.compile
        def bare_step(x, y):
            h = x
            for w, b in bare:
                h = F.silu(h @ w.T + b)
            loss = F.mse_loss(h, y)
            loss.backward()
            return loss

        @fl.compile(cuda_graph=True)
        def graph_step(x, y):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        start = time.perf_counter()
        first_module = float(module_step(x, y).item())
        module_trace_s = time.perf_counter() - start
        start = time.perf_counter()
        first_bare = float(bare_step(x, y).item())
        bare_trace_s = time.perf_counter() - start
        assert abs(first_module - first_bare) <= 1e-4 * max(1.0, abs(first_bare)), (
            first_module,
            first_bare,
        )
        # the host's speed drifts: the three take turns, one burst each per round
        samples = {"module": [], "graph": [], "bare": []}
        steps = {"module": module_step, "graph": graph_step, "bare": bare_step}
        for _ in range(bursts):
            for name, step in steps.items():
                samples[name].append(_bursts(lambda s=step: s(x, y), fl.synchronize, calls, 1))
        module_us, graph_us, bare_us = (statistics.median(samples[k]) for k in samples)
        return {
            "module_per_call_us": module_us,
            "bare_per_call_us": bare_us,
            "module_over_bare": module_us / bare_us,
            "module_cuda_graph_per_call_us": graph_us,
            "graph_cache": str(graph_step.cache_info()),
            "module_first_call_s": module_trace_s,
            "bare_first_call_s": bare_trace_s,
            "module_cache": str(module_step.cache_info()),
            "bare_cache": str(bare_step.cache_info()),
        }


def torch_eager(layers: int, calls: int, bursts: int) -> dict:
    try:
        import torch
    except ImportError as error:
        return {"skipped": f"PyTorch not importable: {error}"}
    if not torch.cuda.is_available():
        return {"skipped": "PyTorch sees no GPU"}
    stack = []
    for _ in range(layers):
        stack += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.SiLU()]
    model = torch.nn.Sequential(*stack).cuda()
    x = torch.randn(BATCH, WIDTH, device="cuda")
    y = torch.randn(BATCH, WIDTH, device="cuda")

    def step():
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()

    return {"eager_per_call_us": _bursts(step, torch.cuda.synchronize, calls, bursts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--backend", default="cuda", choices=["cuda", "reference"])
    options = parser.parse_args()
    layers = 8 if options.quick else LAYERS
    calls, bursts = (5, 3) if options.quick else (200, 7)
    result = {"layers": layers, "width": WIDTH, "batch": BATCH, "backend": options.backend}
    result["flame"] = flame_steps(options.backend, layers, calls, bursts)
    if options.backend == "cuda":
        result["torch"] = torch_eager(layers, calls, bursts)
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "modules.json").write_text(json.dumps(result, indent=2))
    f = result["flame"]
    lines = [
        f"# Module overhead: {layers} Linear+SiLU layers, width {WIDTH}, batch {BATCH}",
        "",
        "| step | per call us | first call s |",
        "| --- | ---: | ---: |",
        f"| FLAME nn.Module, compiled | {f['module_per_call_us']:.1f} | "
        f"{f['module_first_call_s']:.2f} |",
        f"| FLAME bare tensors, compiled | {f['bare_per_call_us']:.1f} | "
        f"{f['bare_first_call_s']:.2f} |",
        f"| FLAME nn.Module, compiled, cuda_graph=True | "
        f"{f['module_cuda_graph_per_call_us']:.1f} | |",
    ]
    eager = result.get("torch", {}).get("eager_per_call_us")
    if eager is not None:
        lines.append(f"| PyTorch eager, nn.Module | {eager:.1f} | |")
    lines += ["", f"module / bare: {f['module_over_bare']:.3f}"]
    (options.out / "modules.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
