"""Where the flash-attention path's memory goes as L grows (the gpu test
``test_long_sequence_never_stores_the_scores[flash]`` saw 6.0 MiB at L=4096, 36.2 at 8192).

For each L (2 heads, head dim 64, bf16, fwd + bwd through fl.vjp): the CuPy pool's growth, and
every allocation above 1 MiB made while the step ran (size and the Python frame that asked),
cuDNN off (FLAME's kernel) and on. One JSON line per (path, L).

    PYTHONPATH=. python3 notes/probes/flash_memory.py
"""

from __future__ import annotations

import json
import traceback

import cupy
import numpy as np

import flame as fl
import flame.nn.functional as F


def run(length: int, cudnn: bool, rng) -> dict:
    fl.backends.cudnn.enabled = cudnn
    shape = (1, 2, length, 64)
    q, k, v, seed = (
        fl.tensor(rng.standard_normal(shape).astype(np.float32)).to(fl.bfloat16).realize()
        for _ in range(4)
    )
    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    big: list[dict] = []
    original = pool.malloc

    def watched(size):
        if size >= 1 << 20:
            frames = [
                f"{frame.filename.split('/')[-1]}:{frame.lineno}:{frame.name}"
                for frame in traceback.extract_stack(limit=8)[:-1]
            ]
            big.append({"MiB": round(size / 2**20, 2), "at": frames[-4:]})
        return original(size)

    cupy.cuda.set_allocator(watched)
    try:
        out, pullback = fl.vjp(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k, v
        )
        grads = [grad.realize() for grad in pullback(seed)]
        out.realize()
        cupy.cuda.Device().synchronize()
    finally:
        cupy.cuda.set_allocator(pool.malloc)
    del grads, out
    return {
        "path": "cudnn" if cudnn else "flash",
        "L": length,
        "pool_growth_MiB": round((pool.total_bytes() - before) / 2**20, 2),
        "allocations_over_1MiB": big,
    }


def main() -> None:
    rng = np.random.default_rng(0)
    for cudnn in (False, True):
        for length in (2048, 4096, 8192, 16384):
            print(json.dumps(run(length, cudnn, rng)), flush=True)


if __name__ == "__main__":
    main()
