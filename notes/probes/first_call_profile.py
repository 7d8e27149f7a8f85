"""Where the first call of a compiled conv + attention step spends its host time: cProfile of
the first call after import (run twice with one FLAME_CACHE_DIR: cold, then from disk)."""

import cProfile
import pstats
import time

t0 = time.perf_counter()
import numpy as np  # noqa: E402

import flame as fl  # noqa: E402
import flame.nn.functional as F  # noqa: E402
from flame.runtime import library_cudnn  # noqa: E402

t1 = time.perf_counter()
rng = np.random.default_rng(0)
x = fl.tensor(rng.standard_normal((2, 320, 32, 32)).astype(np.float32)).to(fl.bfloat16)
x = x.realize()
t2 = time.perf_counter()
library_cudnn._load()
t3 = time.perf_counter()


def bf16(*shape, scale=1.0):
    values = rng.standard_normal(shape).astype(np.float32) * scale
    return fl.tensor(values).to(fl.bfloat16).realize()


w = bf16(320, 320, 3, 3, scale=0.02)
q, k, v = (bf16(2, 5, 1024, 64) for _ in range(3))
for t in (x, w, q, k, v):
    t.requires_grad_()


@fl.compile
def step(x, w, q, k, v):
    y = F.conv2d(x, w, padding=1)
    o = F.scaled_dot_product_attention(q, k, v)
    loss = y.float().square().mean() + o.float().square().mean()
    loss.backward()
    return loss


profile = cProfile.Profile()
t4 = time.perf_counter()
profile.enable()
step(x, w, q, k, v).item()
profile.disable()
t5 = time.perf_counter()
for t in (x, w, q, k, v):
    t.grad = None
step(x, w, q, k, v).item()
t6 = time.perf_counter()
print(
    f"import {1e3 * (t1 - t0):.0f} ms, first upload {1e3 * (t2 - t1):.0f} ms, "
    f"cudnn handle {1e3 * (t3 - t2):.0f} ms, first call {1e3 * (t5 - t4):.0f} ms, "
    f"second call {1e3 * (t6 - t5):.1f} ms"
)
for op, origin, ms in library_cudnn.plan_times():
    print(f"plan {op:14s} {origin:6s} {ms:8.1f} ms")
for made in library_cudnn._PLANS.values():
    print(made.key[0], "serialized bytes", len(bytes(made.graph.serialize())))
pstats.Stats(profile).sort_stats("cumulative").print_stats(28)
