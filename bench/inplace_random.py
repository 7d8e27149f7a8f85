"""Issue 18's timed targets, on the GPU, FLAME and PyTorch in one run.

    python -m bench.inplace_random --out DIR

1. An in-place EMA over 160 M float32 elements (``e.lerp_(p, w)`` under no_grad): device
   time with the host's work hidden (``*_ms``; per call with it, ``*_ms_per_call``; the
   timing loops of bench/training.py) against the byte floor (read e, read p, write e at the
   measured copy bandwidth), PyTorch eager's ``lerp_`` and torch.compile's.
2. Host time of a compiled step that draws random numbers: per call, with 0, 1 and 8 random
   ops, so the cost of a draw shows as the difference (the generator's state is written to
   the GPU once per call; no host synchronisation).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.training import copy_bandwidth, device_ms, median_ms

ELEMENTS = 160 * 1024 * 1024  # 160 Mi float32


def ema_rows(count: int, repeats: int = 20) -> dict:
    import cupy

    import flame as fl

    rows = {}
    bandwidth = copy_bandwidth()
    floor_ms = 3 * count * 4 / bandwidth * 1e3
    rows["copy_bandwidth_tb_s"] = bandwidth / 1e12
    rows["floor_ms"] = floor_ms
    with fl.backend("cuda"):
        e = fl.from_dlpack(cupy.random.random(count, dtype=cupy.float32))
        p = fl.from_dlpack(cupy.random.random(count, dtype=cupy.float32))

        def flame_step():
            with fl.no_grad():
                e.lerp_(p, 1e-3)

        rows["flame_ms_per_call"] = median_ms(flame_step, repeats)
        rows["flame_ms"] = device_ms(flame_step, repeats)
    try:
        import torch

        te = torch.rand(count, device="cuda")
        tp = torch.rand(count, device="cuda")

        def torch_step():
            with torch.no_grad():
                te.lerp_(tp, 1e-3)

        @torch.compile
        def compiled(a, b):
            a.lerp_(b, 1e-3)

        rows["torch_eager_ms_per_call"] = median_ms(torch_step, repeats)
        rows["torch_eager_ms"] = device_ms(torch_step, repeats)
        rows["torch_compile_ms_per_call"] = median_ms(lambda: compiled(te, tp), repeats)
        rows["torch_compile_ms"] = device_ms(lambda: compiled(te, tp), repeats)
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
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import cupy

    results = {
        "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        "ema": ema_rows(args.elements, args.repeats),
        "random_host": random_host_rows(),
    }
    text = json.dumps(results, indent=2)
    print(text)
    (args.out / "inplace_random.json").write_text(text)


if __name__ == "__main__":
    main()
