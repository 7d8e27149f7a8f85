"""Attention forward + backward with dropout on the GPU, bfloat16: FLAME's flash kernels at
p = 0.1 and p = 0 (``flame.runtime.flash_attention`` called directly on CuPy arrays, so the
kernels alone are timed), FLAME's ``F.scaled_dot_product_attention`` through a compiled step
with cuDNN on and off, and ``torch.nn.functional.scaled_dot_product_attention`` with
``dropout_p`` 0.1 and 0 on the same inputs. CUDA events, warm-up first, the median of REPEATS.

    python3 notes/probes/attention_dropout_bench.py [--shape B,H,L,D] [--causal]

Prints one JSON line: milliseconds of each, and FLAME's speed as a fraction of torch's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's flame

WARMUP = 5
REPEATS = 20


def median_ms(function) -> float:
    import cupy

    for _ in range(WARMUP):
        function()
    times = []
    for _ in range(REPEATS):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        function()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def flash_ms(arrays, p: float, causal: bool) -> float:
    import cupy
    import numpy as np

    from flame.runtime import flash_attention as fa

    q, k, v, do = arrays
    scale = q.shape[-1] ** -0.5
    rng = cupy.asarray(np.array([1234, 0], dtype=np.int64))
    options = {"scale": scale, "causal": causal, "dtype": "bfloat16"}
    if p:
        options.update(dropout=p, rng=rng)

    def step():
        o, lse = fa.forward(q, k, v, **options)
        fa.backward(q, k, v, o, do, lse, **options)

    return median_ms(step)


def flame_step_ms(arrays, p: float, causal: bool, cudnn: bool) -> float:
    import flame as fl
    import flame.nn.functional as F

    fl.backends.cudnn.enabled = cudnn
    with fl.backend("cuda"):
        q, k, v, do = (fl.tensor(array).to(fl.bfloat16).realize() for array in arrays)

        def forward_backward(q, k, v, do):
            def projected(q, k, v):
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)
                return (out.float() * do.float()).sum()

            return fl.grad(projected, argnums=(0, 1, 2))(q, k, v)

        compiled = fl.compile(forward_backward)

        def step():
            for grad in compiled(q, k, v, do):
                grad.realize()

        return median_ms(step)


def torch_ms(arrays, p: float, causal: bool) -> float:
    import torch

    q, k, v, do = (torch.from_numpy(array).to("cuda", torch.bfloat16) for array in arrays)
    for tensor in (q, k, v):
        tensor.requires_grad_()

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=p, is_causal=causal
        )
        torch.autograd.grad(out, (q, k, v), do)

    return median_ms(step)


def main() -> None:
    import cupy
    import numpy as np

    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="4,16,2048,64")
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    batch, heads, length, dim = (int(x) for x in args.shape.split(","))
    shape = (batch, heads, length, dim)
    generator = np.random.default_rng(0)
    # float32 values with bfloat16's bits (truncated): every library reads the same numbers
    host = [
        (generator.standard_normal(shape).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(
            np.float32
        )
        for _ in range(4)
    ]
    bits = [cupy.asarray((array.view(np.uint32) >> 16).astype(np.uint16)) for array in host]
    row = {"shape": list(shape), "causal": args.causal, "dtype": "bfloat16"}
    row["flash_p0_ms"] = flash_ms(bits, 0.0, args.causal)
    row["flash_p0.1_ms"] = flash_ms(bits, 0.1, args.causal)
    for cudnn in (True, False):
        label = "cudnn" if cudnn else "flash"
        for p in (0.0, 0.1):
            try:
                row[f"flame_sdpa_{label}_p{p}_ms"] = flame_step_ms(host, p, args.causal, cudnn)
            except Exception as error:  # noqa: BLE001 (reported in the line, the rest still runs)
                row[f"flame_sdpa_{label}_p{p}_error"] = f"{type(error).__name__}: {error}"[:200]
    row["torch_p0_ms"] = torch_ms(host, 0.0, args.causal)
    row["torch_p0.1_ms"] = torch_ms(host, 0.1, args.causal)
    row["flash_dropout_cost"] = row["flash_p0.1_ms"] / row["flash_p0_ms"]
    row["flash_vs_torch_p0.1"] = row["torch_p0.1_ms"] / row["flash_p0.1_ms"]
    if "flame_sdpa_cudnn_p0.1_ms" in row:
        row["cudnn_vs_torch_p0.1"] = row["torch_p0.1_ms"] / row["flame_sdpa_cudnn_p0.1_ms"]
    print(json.dumps({key: round(v, 4) if isinstance(v, float) else v for key, v in row.items()}))


if __name__ == "__main__":
    main()
