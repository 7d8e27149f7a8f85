"""Issue 18's timed targets, on the GPU, FLAME and PyTorch in one run.

    python -m bench.inplace_random --out DIR

1. An in-place EMA over 160 M float32 elements (``e.lerp_(p, w)`` under no_grad): device
   time with the host's work hidden (``*_ms``; per call with it, ``*_ms_per_call``) against
   the byte floor (read e, read p, write e at the measured copy bandwidth),
   PyTorch eager's ``lerp_`` and torch.compile's.
2. Host time of a compiled step that draws random numbers: per call, with 0, 1 and 8 random
   ops, so the cost of a draw shows as the difference (the generator's state is written to
   the GPU once per call; no host synchronisation).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from bench.clocks import CupyClock, TorchClock

ELEMENTS = 160 * 1024 * 1024 // 1  # 160 Mi float32


def _events(fn, repeat=20, warmup=3):
    import cupy

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def _hidden(clock, fn, repeats=20, warmup=3, spin=0.005):
    """Device time alone: each timed call queued behind a spin kernel (bench/clocks.py), so
    the host's work of the call is done while the GPU still spins."""
    for _ in range(warmup):
        fn()
    clock.synchronize()
    times = []
    for _ in range(repeats):
        clock.spin(spin)
        start, stop = clock.event(), clock.event()
        start.record()
        fn()
        stop.record()
        clock.synchronize()
        times.append(clock.elapsed_ms(start, stop))
    return float(np.median(times))


def copy_bandwidth(count: int) -> float:
    import cupy

    source = cupy.random.random(count, dtype=cupy.float32)
    target = cupy.empty_like(source)
    ms = _events(lambda: target.__setitem__(Ellipsis, source))
    return 2 * count * 4 / (ms * 1e-3)


def ema_rows(count: int) -> dict:
    import cupy

    import flame as fl

    rows = {}
    bandwidth = copy_bandwidth(count)
    floor_ms = 3 * count * 4 / bandwidth * 1e3
    rows["copy_bandwidth_tb_s"] = bandwidth / 1e12
    rows["floor_ms"] = floor_ms
    with fl.backend("cuda"):
        e = fl.from_dlpack(cupy.random.random(count, dtype=cupy.float32))
        p = fl.from_dlpack(cupy.random.random(count, dtype=cupy.float32))

        def flame_step():
            with fl.no_grad():
                e.lerp_(p, 1e-3)

        rows["flame_ms_per_call"] = _events(flame_step)
        rows["flame_ms"] = _hidden(CupyClock(fl.synchronize), flame_step)
    try:
        import torch

        te = torch.rand(count, device="cuda")
        tp = torch.rand(count, device="cuda")

        def torch_step():
            with torch.no_grad():
                te.lerp_(tp, 1e-3)

        clock = TorchClock()
        rows["torch_eager_ms_per_call"] = _events(torch_step)
        rows["torch_eager_ms"] = _hidden(clock, torch_step)

        @torch.compile
        def compiled(a, b):
            a.lerp_(b, 1e-3)

        rows["torch_compile_ms_per_call"] = _events(lambda: compiled(te, tp))
        rows["torch_compile_ms"] = _hidden(clock, lambda: compiled(te, tp))
    except Exception as error:  # noqa: BLE001  PyTorch absent or without CUDA
        rows["torch_error"] = f"{type(error).__name__}: {error}"
    rows["flame_fraction_of_floor"] = floor_ms / rows["flame_ms"]
    return rows


def random_host_rows(calls: int = 2000) -> dict:
    import flame as fl

    rows = {}
    with fl.backend("cuda"):
        x = fl.zeros(1024)
        for draws in (0, 1, 8):

            def body(x, draws=draws):
                out = x * 1.5
                for _ in range(draws):
                    out = out + fl.rand_like(x)
                return out

            step = fl.compile(body)
            for _ in range(50):
                step(x)
            fl.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                step(x)
            fl.synchronize()
            rows[f"compiled_us_per_call_{draws}_draws"] = (
                (time.perf_counter() - start) / calls * 1e6
            )
            rows[f"traces_{draws}_draws"] = step.cache_info().traces
    rows["us_per_draw_1"] = (
        rows["compiled_us_per_call_1_draws"] - rows["compiled_us_per_call_0_draws"]
    )
    rows["us_per_draw_8"] = (
        rows["compiled_us_per_call_8_draws"] - rows["compiled_us_per_call_0_draws"]
    ) / 8
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--elements", type=int, default=ELEMENTS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import cupy

    results = {
        "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        "ema": ema_rows(args.elements),
        "random_host": random_host_rows(),
    }
    text = json.dumps(results, indent=2)
    print(text)
    (args.out / "inplace_random.json").write_text(text)


if __name__ == "__main__":
    main()
