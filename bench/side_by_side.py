"""Measuring FLAME and PyTorch side by side on the same tensors: ``System`` (how a call and its
clock are built), ``Timing`` and ``device_ms`` (device time per call, queued behind a spin
kernel), ``run_systems`` (every system measured, then its outputs checked against the
reference's), ``ratios`` and ``make_row``; tensors copied from one side to the other; the
environment. Written for bench/conv_attention.py (which re-exports every name); the diffusion
benches use it too."""

from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

from bench.harness import guarded

BF16_TOLERANCE = 0.05  # largest difference over the largest magnitude, outputs and gradients
MIN_SPIN_S, MAX_SPIN_S = 0.001, 0.5


@dataclass(frozen=True)
class Timing:
    warmup: int
    calls: int
    repeats: int


@dataclass(frozen=True)
class System:
    """``build() -> (call, clock)``; ``call()`` returns the tensors to compare. ``scope()``
    is entered around building and timing (a backend, a setting); ``skip`` says why not."""

    build: object = None
    scope: object = contextlib.nullcontext
    skip: str | None = None


# --- timing ------------------------------------------------------------------------------------


def flame_clock(backend: str):
    import flame as fl
    from bench.clocks import CupyClock, HostClock

    return CupyClock(fl.synchronize) if backend == "cuda" else HostClock(fl.synchronize)


def torch_clock(device: str):
    from bench.clocks import HostClock, TorchClock

    return TorchClock() if device == "cuda" else HostClock()


def device_ms(clock, call, timing: Timing) -> dict:
    """Per call: events around ``calls`` calls queued behind a spin kernel long enough for the
    host to queue them all (its issue time, measured first), so the host's gaps are hidden."""
    for _ in range(timing.warmup):
        call()
    clock.synchronize()
    start = time.perf_counter()
    for _ in range(timing.calls):
        call()
    issue_s = time.perf_counter() - start
    clock.synchronize()
    spin = min(MAX_SPIN_S, 1.5 * issue_s + MIN_SPIN_S)
    samples = []
    for _ in range(timing.repeats):
        begin, end = clock.event(), clock.event()
        clock.synchronize()
        clock.spin(spin)
        begin.record()
        for _ in range(timing.calls):
            call()
        end.record()
        samples.append(clock.elapsed_ms(begin, end) / timing.calls)
    return {
        "ms": statistics.median(samples),
        "min_ms": min(samples),
        "samples": len(samples),
        "calls_per_sample": timing.calls,
        "host_issue_ms_per_call": issue_s * 1e3 / timing.calls,
        "spin_ms": spin * 1e3,
    }


def to_numpy(tensor) -> np.ndarray:
    if tensor is None:
        raise ValueError("an output or gradient is missing (None)")
    if isinstance(tensor, np.ndarray):
        return tensor.astype(np.float32)
    if hasattr(tensor, "detach"):  # torch
        return tensor.detach().float().cpu().numpy()
    return np.asarray(tensor.float().numpy())


def measure(system: System, timing: Timing, outputs: dict, key: str) -> dict:
    with system.scope():
        call, clock = system.build()
        clock.synchronize()
        start = time.perf_counter()
        produced = call()
        clock.synchronize()
        first_ms = (time.perf_counter() - start) * 1e3
        outputs[key] = [to_numpy(tensor) for tensor in produced]
        del produced
        return {"first_call_ms": first_ms, **device_ms(clock, call, timing)}


def release_memory(backend: str) -> None:
    gc.collect()
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if backend == "cuda":
        with contextlib.suppress(Exception):
            import cupy

            cupy.get_default_memory_pool().free_all_blocks()


def max_rel(value: np.ndarray, reference: np.ndarray) -> float:
    scale = float(np.max(np.abs(reference))) if reference.size else 0.0
    return float(np.max(np.abs(value - reference))) / max(scale, 1e-30) if value.size else 0.0


def run_systems(
    systems: dict, timing: Timing, names: tuple, backend: str, reference_key: str = "torch_eager"
) -> dict:
    """Every system measured in turn (guarded), then each one's outputs compared with the
    reference system's (PyTorch's)."""
    results, outputs = {}, {}
    for key, system in systems.items():
        if system.skip is not None:
            results[key] = {"status": "skipped", "reason": system.skip}
            continue
        progress(key)
        results[key] = guarded(measure, system, timing, outputs, key)
        release_memory(backend)
    reference = outputs.get(reference_key)
    for key, arrays in outputs.items():
        if key == reference_key or reference is None:
            continue
        diffs = {name: max_rel(a, b) for name, a, b in zip(names, arrays, reference)}
        worst = max(diffs.values())
        results[key]["check"] = {
            "max_rel_diff": diffs,
            "worst": worst,
            "tolerance": BF16_TOLERANCE,
            "agrees": worst <= BF16_TOLERANCE,
        }
    return results


def ratios(results: dict, backend: str, peer: str) -> dict:
    """Each peer's ms / FLAME's ms (above 1: FLAME faster), and ``peer`` against the fallback;
    None on the reference backend (CPU times say nothing) or where a side has no time."""
    flame_ms = results.get("flame", {}).get("ms")
    found = {}
    for key, entry in results.items():
        if key not in ("flame", "flame_fallback"):
            found[key] = quotient(entry.get("ms"), flame_ms, backend)
    if "flame_fallback" in results:
        fallback_ms = results["flame_fallback"].get("ms")
        found[f"{peer}_over_fallback"] = quotient(results[peer].get("ms"), fallback_ms, backend)
    return found


def quotient(numerator, denominator, backend: str):
    return numerator / denominator if backend == "cuda" and numerator and denominator else None


def progress(message: str) -> None:
    print(f"[conv_attention] {message}", file=sys.stderr, flush=True)


def make_row(label, fields, case, results, backend, peer, flops=None, **extra) -> dict:
    """One case's row: its results with TFLOP/s where ``flops`` is given, and the ratios."""
    for entry in results.values():
        if flops and entry.get("ms"):
            entry["tflop_s"] = flops / (entry["ms"] * 1e-3) / 1e12
    release_memory(backend)
    return {"label": label, "case": dict(zip(fields, case)), **extra, "flops": flops,
            "results": results, "ratios": ratios(results, backend, peer)}  # fmt: skip


# --- tensors on both sides ---------------------------------------------------------------------


def torch_device(backend: str) -> str:
    return "cuda" if backend == "cuda" else "cpu"


def to_flame(tensor, backend: str, requires_grad: bool = False):
    """A FLAME copy of a torch tensor: DLPack on the GPU, NumPy float32 otherwise (or if DLPack
    fails), cast back to the tensor's dtype."""
    import flame as fl

    copy = None
    if backend == "cuda":
        with contextlib.suppress(Exception):
            copy = fl.from_dlpack(tensor.detach().contiguous().clone())
    if copy is None:
        dtype = getattr(fl, str(tensor.dtype).removeprefix("torch."))
        with fl.backend(backend):
            copy = fl.tensor(tensor.detach().float().cpu().numpy()).to(dtype)
    copy = copy.realize()
    return copy.requires_grad_() if requires_grad else copy


def torch_inputs(shapes: list, backend: str, grads: list) -> list:
    import torch

    torch.manual_seed(0)
    device = torch_device(backend)
    return [
        torch.randn(shape, device=device, dtype=torch.bfloat16).requires_grad_(grad)
        for shape, grad in zip(shapes, grads)
    ]


def flame_scope(backend: str, setting=None):
    import flame as fl

    def scope():
        stack = contextlib.ExitStack()
        stack.enter_context(fl.backend(backend))
        if setting is not None:
            stack.enter_context(setting())
        return stack

    return scope


def clear_grads(tensors) -> None:
    for tensor in tensors:
        tensor.grad = None


def torch_compile_skip(backend: str) -> str | None:
    import torch

    if backend != "cuda":
        return "reference backend: CPU smoke run, torch.compile skipped"
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    return None


def environment_info(backend: str) -> dict:
    info = {"backend": backend, "device": "CPU (reference backend)"}
    with contextlib.suppress(Exception):
        import flame as fl

        info["flame_version"] = fl.__version__
    with contextlib.suppress(Exception):
        import torch

        info["torch_version"] = torch.__version__
        if backend == "cuda":
            info["device"] = torch.cuda.get_device_name()
            info["torch_cudnn_version"] = torch.backends.cudnn.version()
    with contextlib.suppress(Exception):  # flame.backends is new: its absence is no error
        import flame as fl

        info["flame_cudnn_available"] = fl.backends.cudnn.is_available()
        info["flame_cudnn_version"] = fl.backends.cudnn.version()
    return info
