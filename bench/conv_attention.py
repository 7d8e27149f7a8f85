"""Convolution and attention: FLAME against cuDNN (PyTorch eager), torch.compile and PyTorch's
fused attention, forward and backward, bfloat16, in one run.

    python -m bench.conv_attention --out DIR [--quick] [--only SECTION ...]
                                   [--backend cuda|reference]

Sections (``--only`` repeatable; all four by default, run in the order conv, attention,
compile, resblock):

- ``conv``: conv2d forward and both gradients (``y = conv2d(x, w); y.backward(gy)`` on both
  sides), NCHW, UNet shapes (3x3 stride 1, one 3x3 stride-2 downsample, one 1x1). Peer: PyTorch
  eager (cuDNN), ``cudnn.benchmark`` off (its default) and on. Target: FLAME >= 0.97x eager.
- ``attention``: ``scaled_dot_product_attention`` forward alone and forward + backward, [B, H, L,
  D], D 64 and 128, L 256 to 16384 with B*H*L = 65536, causal and not. Peer: PyTorch's SDPA.
  TFLOP/s: 4*B*H*L*L*D forward, 2.5x that backward, halved when causal. Targets: >= 0.95x SDPA;
  FLAME fallback >= 0.5x.
- ``resblock``: a UNet ResBlock (GroupNorm(32), SiLU, conv3x3, + Linear(SiLU(time embedding))
  broadcast over H, W, GroupNorm(32), SiLU, conv3x3, + residual), forward and backward with
  bfloat16 parameters and inputs; one class instantiated with ``torch.nn`` and with
  ``flame.nn``, FLAME's weights loaded from PyTorch's. Peers: eager and torch.compile (default
  mode; last, as its compile workers keep the host's CPUs busy for seconds afterwards).
  Target: >= 1.2x torch.compile.
- ``compile``: the first call of a new compiled function holding one new conv and one new
  attention configuration (forward and backward) in a fresh process: cold (empty
  ``FLAME_CACHE_DIR`` and ``CUPY_CACHE_DIR``), then warm from disk (a second fresh process, same
  directories). Targets: <= 150 ms cold, <= 5 ms from disk for the library part; the whole
  first call is reported, with FLAME's compile events (traces, plans, kernels by origin).
  Each child starts once the host's CPUs are quiet (bench/timing.py ``wait_for_quiet_host``).

"FLAME fallback" (conv and attention) is FLAME with ``flame.backends.cudnn.enabled = False``,
set while that system is built and timed: FLAME's own kernels; skipped, with the reason, where
the setting does not exist. Times are the device's: a spin kernel holds the stream while the
host queues ``calls`` calls, events around them, per call; the median over ``repeats`` samples
(``ms``). The host's time to issue one call is beside it (``host_issue_ms_per_call``). Ratios
are peer ms / FLAME ms: above 1, FLAME is faster. Outputs and gradients are compared once with
PyTorch's (largest difference over the largest magnitude). ``--backend reference`` is a CPU
smoke run: tiny shapes, FLAME's NumPy backend, PyTorch on the CPU, no torch.compile, no
fallback, no ratios; its ``compile`` section tries the child processes' plumbing only.
Writes ``conv_attention.json`` and ``conv_attention.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.harness import guarded
from bench.timing import wait_for_quiet_host

ROOT = Path(__file__).resolve().parent.parent
# torch.compile (resblock) last: its compile workers keep the host busy for seconds after
SECTIONS = ("conv", "attention", "compile", "resblock")
BF16_TOLERANCE = 0.05  # largest difference over the largest magnitude, outputs and gradients
MIN_SPIN_S, MAX_SPIN_S = 0.001, 0.5
CHILD_MARKER = "FLAME_CONV_ATTENTION_FIRSTCALL "
TARGETS = {
    "conv": "FLAME >= 0.97x PyTorch eager (cuDNN)",
    "attention": "FLAME >= 0.95x torch SDPA; FLAME fallback >= 0.5x",
    "resblock": "FLAME >= 1.2x torch.compile",
    "compile": "<= 150 ms cold, <= 5 ms from disk (library part)",
}

# (batch, channels in, channels out, height = width, kernel, stride)
CONV = [
    (8, 64, 64, 128, 3, 1),
    (16, 128, 128, 64, 3, 1),
    (32, 256, 256, 32, 3, 1),
    (32, 512, 512, 16, 3, 1),
    (64, 512, 512, 8, 3, 1),
    (16, 128, 128, 64, 3, 2),
    (32, 256, 512, 32, 1, 1),
]
CONV_QUICK = [(32, 256, 256, 32, 3, 1), (32, 256, 512, 32, 1, 1)]
CONV_TINY = [(2, 4, 4, 8, 3, 1), (2, 4, 4, 8, 3, 2), (2, 4, 8, 8, 1, 1)]
# (batch, channels, height = width, embedding width)
RESBLOCK = [(32, 128, 32, 512), (32, 256, 16, 512), (32, 512, 8, 512)]
RESBLOCK_QUICK = [(32, 256, 16, 512)]
RESBLOCK_TINY = [(2, 32, 4, 16)]
ATTENTION_TINY = [(1, 2, 16, 8, False), (1, 2, 16, 8, True)]  # (batch, heads, L, D, causal)
ATTENTION_QUICK = [(4, 16, 1024, 64, False), (1, 16, 4096, 128, True)]


def attention_cases() -> list[tuple]:
    cases = []
    for dim in (64, 128):
        for length in (256, 1024, 4096, 16384):
            batch_heads = max(1, 65536 // length)
            heads = min(16, batch_heads)
            for causal in (False, True):
                cases.append((batch_heads // heads, heads, length, dim, causal))
    return cases


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


# --- conv and attention ------------------------------------------------------------------------


def fallback_setting():
    """(a context manager under which FLAME runs its own conv and attention kernels, what it
    sets), or (None, why there is none)."""
    import flame as fl

    cudnn = getattr(getattr(fl, "backends", None), "cudnn", None)
    if cudnn is None or not hasattr(cudnn, "enabled"):
        return None, "flame.backends.cudnn.enabled does not exist"

    @contextlib.contextmanager
    def disabled():
        saved = cudnn.enabled
        cudnn.enabled = False
        try:
            yield
        finally:
            cudnn.enabled = saved

    return disabled, "flame.backends.cudnn.enabled = False"


def flame_systems(build, backend: str, fallback) -> dict:
    """FLAME, and FLAME with its library kernels turned off (built and timed under the setting)."""
    setting, why = fallback
    skip = "reference backend: no library kernel to turn off" if backend != "cuda" else None
    return {
        "flame": System(build, flame_scope(backend)),
        "flame_fallback": System(
            build, flame_scope(backend, setting), skip=skip or (why if setting is None else None)
        ),
    }


@contextlib.contextmanager
def cudnn_benchmark(flag: bool):
    import torch

    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = flag
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = saved


def conv_systems(case: tuple, backend: str, fallback) -> dict:
    import torch

    import flame as fl
    import flame.nn.functional as F

    batch, cin, cout, size, kernel, stride = case
    padding = kernel // 2
    out_size = (size + 2 * padding - kernel) // stride + 1
    shapes = [(batch, cin, size, size), (cout, cin, kernel, kernel)]
    x, w, gy = torch_inputs(
        [*shapes, (batch, cout, out_size, out_size)], backend, [True, True, False]
    )

    def torch_build():
        def call():
            clear_grads((x, w))
            y = torch.nn.functional.conv2d(x, w, stride=stride, padding=padding)
            y.backward(gy)
            return y, x.grad, w.grad

        return call, torch_clock(torch_device(backend))

    def flame_build():
        fx, fw, fgy = to_flame(x, backend, True), to_flame(w, backend, True), to_flame(gy, backend)

        @fl.compile
        def step(x, w, gy):
            y = F.conv2d(x, w, stride=stride, padding=padding)
            y.backward(gy)
            return y

        def call():
            clear_grads((fx, fw))
            return step(fx, fw, fgy), fx.grad, fw.grad

        return call, flame_clock(backend)

    skip = None if backend == "cuda" else "reference backend: PyTorch on the CPU"
    return {
        "torch_eager": System(torch_build, lambda: cudnn_benchmark(False)),
        "torch_eager_cudnn_benchmark": System(torch_build, lambda: cudnn_benchmark(True), skip),
        **flame_systems(flame_build, backend, fallback),
    }


def conv_section(backend: str, cases: list, timing: Timing) -> dict:
    fallback, rows = fallback_setting(), []
    for case in cases:
        batch, cin, cout, size, kernel, stride = case
        label = f"{cin}->{cout}ch {size}x{size} b{batch} {kernel}x{kernel} s{stride}"
        progress(f"conv {label}")
        out_size = (size + 2 * (kernel // 2) - kernel) // stride + 1
        flops = 3 * 2 * batch * cout * out_size * out_size * cin * kernel * kernel
        systems = conv_systems(case, backend, fallback)
        results = run_systems(systems, timing, ("y", "grad_x", "grad_w"), backend)
        fields = ("batch", "channels_in", "channels_out", "size", "kernel", "stride")
        rows.append(make_row(label, fields, case, results, backend, "torch_eager", flops=flops))
    return {"target": TARGETS["conv"], "fallback_setting": fallback[1], "rows": rows}


def make_row(label, fields, case, results, backend, peer, flops=None, **extra) -> dict:
    """One case's row: its results with TFLOP/s where ``flops`` is given, and the ratios."""
    for entry in results.values():
        if flops and entry.get("ms"):
            entry["tflop_s"] = flops / (entry["ms"] * 1e-3) / 1e12
    release_memory(backend)
    return {"label": label, "case": dict(zip(fields, case)), **extra, "flops": flops,
            "results": results, "ratios": ratios(results, backend, peer)}  # fmt: skip


def attention_systems(case: tuple, backward: bool, backend: str, fallback) -> dict:
    import torch

    import flame as fl
    import flame.nn.functional as F

    batch, heads, length, dim, causal = case
    shape = (batch, heads, length, dim)
    q, k, v, go = torch_inputs([shape] * 4, backend, [backward] * 3 + [False])
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def torch_build():
        def call():
            clear_grads((q, k, v))
            with torch.set_grad_enabled(backward):
                out = sdpa(q, k, v, is_causal=causal)
            if not backward:
                return (out,)
            out.backward(go)
            return out, q.grad, k.grad, v.grad

        return call, torch_clock(torch_device(backend))

    def flame_build():
        fq, fk, fv = (to_flame(t, backend, backward) for t in (q, k, v))
        fgo = to_flame(go, backend)

        @fl.compile
        def step(q, k, v, go):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            if backward:
                out.backward(go)
            return out

        def call():
            clear_grads((fq, fk, fv))
            out = step(fq, fk, fv, fgo)
            return (out, fq.grad, fk.grad, fv.grad) if backward else (out,)

        return call, flame_clock(backend)

    return {"torch_sdpa": System(torch_build), **flame_systems(flame_build, backend, fallback)}


def attention_section(backend: str, cases: list, timing: Timing) -> dict:
    fallback, rows = fallback_setting(), []
    fields = ("batch", "heads", "length", "head_dim", "causal")
    for case in cases:
        batch, heads, length, dim, causal = case
        forward_flops = 4 * batch * heads * length * length * dim / (2 if causal else 1)
        for backward in (False, True):
            mode = "fwd+bwd" if backward else "fwd"
            label = f"B{batch} H{heads} L{length} D{dim}{' causal' if causal else ''} {mode}"
            progress(f"attention {label}")
            names = ("out", "grad_q", "grad_k", "grad_v") if backward else ("out",)
            systems = attention_systems(case, backward, backend, fallback)
            results = run_systems(systems, timing, names, backend, "torch_sdpa")
            flops = forward_flops * (3.5 if backward else 1.0)
            rows.append(make_row(label, fields, case, results, backend, "torch_sdpa",
                                 flops=flops, mode=mode))  # fmt: skip
    return {"target": TARGETS["attention"], "fallback_setting": fallback[1], "rows": rows}


# --- resblock ----------------------------------------------------------------------------------


def resblock_class(library_nn):
    """The same ResBlock for ``torch.nn`` and ``flame.nn``: the two modules match by design."""

    class ResBlock(library_nn.Module):
        def __init__(self, channels: int, embedding: int):
            super().__init__()
            self.norm1 = library_nn.GroupNorm(32, channels)
            self.conv1 = library_nn.Conv2d(channels, channels, 3, padding=1)
            self.time = library_nn.Linear(embedding, channels)
            self.norm2 = library_nn.GroupNorm(32, channels)
            self.conv2 = library_nn.Conv2d(channels, channels, 3, padding=1)
            self.act = library_nn.SiLU()

        def forward(self, x, time_embedding):
            h = self.conv1(self.act(self.norm1(x)))
            h = h + self.time(self.act(time_embedding)).reshape(x.shape[0], -1, 1, 1)
            h = self.conv2(self.act(self.norm2(h)))
            return x + h

    return ResBlock


def resblock_systems(case: tuple, backend: str) -> dict:
    import torch

    import flame as fl
    import flame.nn as fnn

    batch, channels, size, embedding = case
    device = torch_device(backend)
    torch.manual_seed(0)
    module = resblock_class(torch.nn)(channels, embedding).to(device, torch.bfloat16)
    shapes = [(batch, channels, size, size), (batch, embedding), (batch, channels, size, size)]
    x, temb, gout = torch_inputs(shapes, backend, [True, True, False])

    def torch_build(compiled: bool):
        def build():
            forward = torch.compile(module) if compiled else module

            def call():
                module.zero_grad(set_to_none=True)
                clear_grads((x, temb))
                out = forward(x, temb)
                out.backward(gout)
                return out, x.grad, module.conv1.weight.grad

            return call, torch_clock(device)

        return build

    def flame_build():
        block = resblock_class(fnn)(channels, embedding).bfloat16()
        block.load_state_dict({k: v.float().cpu().numpy() for k, v in module.state_dict().items()})
        fx, ftemb, fgout = (
            to_flame(x, backend, True),
            to_flame(temb, backend, True),
            to_flame(gout, backend),
        )

        @fl.compile
        def step(x, temb, gout):
            out = block(x, temb)
            out.backward(gout)
            return out

        def call():
            block.zero_grad(set_to_none=True)
            clear_grads((fx, ftemb))
            return step(fx, ftemb, fgout), fx.grad, block.conv1.weight.grad

        return call, flame_clock(backend)

    compile_skip = torch_compile_skip(backend)
    return {
        "torch_eager": System(torch_build(False)),
        "flame": System(flame_build, flame_scope(backend)),
        "torch_compile": System(torch_build(True), skip=compile_skip),
    }


def torch_compile_skip(backend: str) -> str | None:
    import torch

    if backend != "cuda":
        return "reference backend: CPU smoke run, torch.compile skipped"
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    return None


def resblock_section(backend: str, cases: list, timing: Timing) -> dict:
    rows = []
    for case in cases:
        batch, channels, size, embedding = case
        label = f"{channels}ch {size}x{size} b{batch} (time embedding {embedding})"
        progress(f"resblock {label}")
        names = ("out", "grad_x", "grad_conv1_weight")
        results = run_systems(resblock_systems(case, backend), timing, names, backend)
        fields = ("batch", "channels", "size", "embedding")
        rows.append(make_row(label, fields, case, results, backend, "torch_eager"))
    return {"target": TARGETS["resblock"], "rows": rows}


# --- first call: a fresh process, cold then warm from disk -------------------------------------

# (batch, channels, size) of a 3x3 conv, padding 1; (batch, heads, length, head dim)
FIRST_CALL = {"cuda": ((2, 320, 32), (2, 5, 1024, 64)), "reference": ((1, 4, 8), (1, 2, 16, 8))}
GRAD_INPUTS = (0, 1, 3, 4, 5)  # x, w, q, k, v


def first_call_child(backend: str) -> None:
    """In the child: import, context, inputs on the device, then the timed first call (and a
    second one) of a compiled conv + attention training step; one line of JSON."""
    started = time.perf_counter()
    import flame as fl
    import flame.nn.functional as F

    stamps = {"import_flame_ms": (time.perf_counter() - started) * 1e3}
    if backend == "cuda":
        import cupy

        cupy.cuda.runtime.free(0)  # the CUDA context, before the clock starts
    with fl.backend(backend):
        tensors = first_call_inputs(fl, *FIRST_CALL[backend])
    fl.synchronize()

    @fl.compile
    def step(x, w, gy, q, k, v, go):
        loss = (F.conv2d(x, w, padding=1) * gy).sum()
        loss = loss + (F.scaled_dot_product_attention(q, k, v) * go).sum()
        loss.backward()
        return loss

    events = EventTotals()
    for name in ("first_call_ms", "second_call_ms"):
        clear_grads(tensors[index] for index in GRAD_INPUTS)
        with recording(events) if name == "first_call_ms" else contextlib.nullcontext():
            start = time.perf_counter()
            step(*tensors)
            fl.synchronize()
            stamps[name] = (time.perf_counter() - start) * 1e3
    stamps["events"] = events.totals
    stamps["cache_info"] = str(step.cache_info())
    print(CHILD_MARKER + json.dumps(stamps), flush=True)


def first_call_inputs(fl, conv: tuple, attention: tuple) -> list:
    """x, w, gy of the conv and q, k, v, go of the attention, realized; x, w, q, k, v need grads."""
    batch, channels, size = conv
    shapes = [(batch, channels, size, size), (channels, channels, 3, 3)]
    shapes += [(batch, channels, size, size)] + [attention] * 4
    tensors = [fl.randn(*shape, dtype=fl.bfloat16).realize() for shape in shapes]
    for index in GRAD_INPUTS:
        tensors[index].requires_grad_()
    return tensors


class EventTotals:
    """FLAME's compile events (flame/runtime/events.py), counted and timed by kind (kernels
    also by origin: memory, disk, compiled)."""

    def __init__(self):
        self.totals = {}

    def __call__(self, kind: str, data: dict) -> None:
        if kind == "kernel":
            kind = f"kernel_{data.get('origin')}"
        entry = self.totals.setdefault(kind, {"count": 0, "seconds": 0.0})
        entry["count"] += 1
        entry["seconds"] += float(data.get("seconds") or 0.0)


def recording(recorder):
    try:
        from flame.runtime.events import recording as flame_recording
    except ImportError:  # an internal module: its absence costs the breakdown only
        return contextlib.nullcontext()
    return flame_recording(recorder)


def run_child(environment: dict, backend: str) -> dict:
    start = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, "-m", "bench.conv_attention", "--first-call-child", "--backend", backend],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall_ms = (time.perf_counter() - start) * 1e3
    for line in completed.stdout.splitlines():
        if line.startswith(CHILD_MARKER):
            return {"process_wall_ms": wall_ms, **json.loads(line[len(CHILD_MARKER) :])}
    raise RuntimeError(f"child exited {completed.returncode}: {completed.stderr[-2000:]}")


def compile_section(backend: str) -> dict:
    conv, attention = FIRST_CALL[backend]
    result = {"target": TARGETS["compile"], "conv": conv, "attention": attention}
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.getenv("PYTHONPATH")]))
    environment["FLAME_CACHE_DIR"] = tempfile.mkdtemp(prefix="flame-conv-attention-cache-")
    environment["CUPY_CACHE_DIR"] = tempfile.mkdtemp(prefix="cupy-conv-attention-cache-")
    result["cache_dir"] = environment["FLAME_CACHE_DIR"]
    for name in ("cold", "warm_disk"):
        quiet = wait_for_quiet_host(limit=20.0) if backend == "cuda" else None
        progress(f"compile: {name}")
        result[name] = {**guarded(run_child, environment, backend), "quiet_host": quiet}
    return result


# --- report ------------------------------------------------------------------------------------


NAMES = {"torch_eager": "eager", "torch_eager_cudnn_benchmark": "eager, cudnn.benchmark",
         "torch_sdpa": "torch SDPA", "torch_compile": "torch.compile", "flame": "FLAME",
         "flame_fallback": "FLAME fallback"}  # fmt: skip


def time_cell(entry: dict) -> str:
    """ms, with TFLOP/s in brackets where the row counts flops; or why there is no time."""
    if entry.get("status") != "ok":
        return entry.get("status", "-")
    rate = entry.get("tflop_s")
    return f"{entry['ms']:.3f}" + (f" ({rate:.0f})" if rate is not None else "")


def ratio_cell(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def check_cell(entry: dict) -> str:
    check = entry.get("check")
    return "-" if not check else f"{check['worst']:.1e}{'' if check['agrees'] else ' (!)'}"


def ratio_name(key: str) -> str:
    if key.endswith("_over_fallback"):
        return f"{NAMES[key.removesuffix('_over_fallback')]} / fallback"
    return f"{NAMES[key]} / FLAME"


def section_table(section: dict, systems: list, ratio_keys: list) -> list[str]:
    unit = " ms (TFLOP/s)" if section["rows"] and section["rows"][0]["flops"] else " ms"
    header = ["case", *(NAMES[key] + unit for key in systems)]
    header += [*(ratio_name(key) for key in ratio_keys), "FLAME max rel diff"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in section["rows"]:
        results = row["results"]
        cells = [row["label"], *(time_cell(results.get(key, {})) for key in systems)]
        cells += [ratio_cell(row["ratios"].get(key)) for key in ratio_keys]
        cells.append(check_cell(results.get("flame", {})))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def compile_lines(section: dict) -> list[str]:
    lines = [
        "| run | import flame ms | first call ms | second call ms | kernels compiled / from disk |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in ("cold", "warm_disk"):
        entry = section.get(name, {})
        if entry.get("status") != "ok":
            lines.append(f"| {name} | {entry.get('error', '-')} | | | |")
            continue
        events = entry.get("events", {})
        kernels = [events.get(f"kernel_{o}", {}).get("count", 0) for o in ("compiled", "disk")]
        lines.append(
            f"| {name} | {entry['import_flame_ms']:.0f} | {entry['first_call_ms']:.1f} "
            f"| {entry['second_call_ms']:.2f} | {kernels[0]} / {kernels[1]} |"
        )
    return lines


TABLES = {  # section -> (systems, ratio keys)
    "conv": (["torch_eager", "torch_eager_cudnn_benchmark", "flame", "flame_fallback"],
             ["torch_eager", "torch_eager_cudnn_benchmark", "torch_eager_over_fallback"]),
    "attention": (["torch_sdpa", "flame", "flame_fallback"],
                  ["torch_sdpa", "torch_sdpa_over_fallback"]),
    "resblock": (["torch_eager", "torch_compile", "flame"], ["torch_eager", "torch_compile"]),
}  # fmt: skip


def markdown(report: dict) -> str:
    lines = [
        f"# Convolution and attention, bfloat16 ({report['device']})",
        "",
        "Device ms per call (median); ratios peer ms / FLAME ms: above 1, FLAME is faster.",
        "",
    ]
    for name in SECTIONS:
        section = report.get(name)
        if section is None:
            continue
        lines += [f"## {name}", "", f"Target: {TARGETS[name]}", ""]
        if section.get("status") == "error":
            lines.append(f"error: {section['error']}")
        elif name == "compile":
            lines += compile_lines(section)
        else:
            lines += section_table(section, *TABLES[name])
        if "fallback_setting" in section:
            lines += ["", f"FLAME fallback: {section['fallback_setting']}"]
        lines.append("")
    return "\n".join(lines)


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


def run(backend: str, quick: bool, only=None, timing: Timing | None = None) -> dict:
    tiny = backend != "cuda"
    if timing is None:
        timing = Timing(1, 1, 2) if tiny else Timing(1, 3, 3) if quick else Timing(3, 10, 9)
    report = {**environment_info(backend), "quick": quick, "timing": timing.__dict__}
    shapes = {
        "conv": CONV_TINY if tiny else CONV_QUICK if quick else CONV,
        "attention": ATTENTION_TINY if tiny else ATTENTION_QUICK if quick else attention_cases(),
        "resblock": RESBLOCK_TINY if tiny else RESBLOCK_QUICK if quick else RESBLOCK,
    }
    actions = {
        "conv": lambda: conv_section(backend, shapes["conv"], timing),
        "attention": lambda: attention_section(backend, shapes["attention"], timing),
        "resblock": lambda: resblock_section(backend, shapes["resblock"], timing),
        "compile": lambda: compile_section(backend),
    }
    for name in SECTIONS:
        if name in (only or SECTIONS):
            outcome = guarded(actions[name])
            report[name] = outcome if outcome["status"] == "error" else actions_result(outcome)
    return report


def actions_result(outcome: dict) -> dict:
    """A section that ran: its own dict, without ``guarded``'s "ok" (a skip keeps its status)."""
    outcome = dict(outcome)
    if outcome["status"] == "ok":
        outcome.pop("status")
    return outcome


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.conv_attention",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("out/conv_attention"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", action="append", choices=SECTIONS)
    parser.add_argument("--backend", choices=("cuda", "reference"), default="cuda")
    parser.add_argument("--first-call-child", action="store_true", help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.first_call_child:
        first_call_child(arguments.backend)
        return 0
    report = run(arguments.backend, arguments.quick, arguments.only)
    arguments.out.mkdir(parents=True, exist_ok=True)
    (arguments.out / "conv_attention.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (arguments.out / "conv_attention.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
