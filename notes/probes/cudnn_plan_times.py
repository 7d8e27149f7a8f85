"""cuDNN plan cost per configuration: run twice with one FLAME_CACHE_DIR (cold, then disk)."""

import time

import numpy as np

import flame as fl
import flame.nn.functional as F
from flame.runtime import library_cudnn

rng = np.random.default_rng(0)
x = (
    fl.tensor(rng.standard_normal((2, 320, 32, 32)).astype(np.float32))
    .to(fl.bfloat16)
    .realize()
    .requires_grad_()
)
w = (
    fl.tensor(rng.standard_normal((320, 320, 3, 3)).astype(np.float32) * 0.02)
    .to(fl.bfloat16)
    .realize()
    .requires_grad_()
)
q, k, v = [
    fl.tensor(rng.standard_normal((2, 5, 1024, 64)).astype(np.float32))
    .to(fl.bfloat16)
    .realize()
    .requires_grad_()
    for _ in range(3)
]
start = time.perf_counter()
y = F.conv2d(x, w, padding=1)
o = F.scaled_dot_product_attention(q, k, v)
(y.float().sum() + o.float().sum()).backward()
fl.realize(x.grad, w.grad, q.grad)
print("first call ms", round((time.perf_counter() - start) * 1e3, 1))
for op, origin, ms in library_cudnn.plan_times():
    print(f"plan {op:14s} {origin:6s} {ms:8.1f} ms")
