"""One-off probe of the cuDNN frontend on the device: versions, API spellings, and a conv and
attention through FLAME's library code against the reference."""

import json
import time

import numpy as np

out = {}
import cudnn

out["frontend"] = cudnn.__version__
out["backend"] = cudnn.backend_version()
out["has_generate_stats"] = "generate_stats" in (cudnn.pygraph.sdpa.__doc__ or "")
out["execute_doc"] = (cudnn.pygraph.execute.__doc__ or "")[:400]
out["deserialize_doc"] = (cudnn.pygraph.deserialize.__doc__ or "")[:400]
print(json.dumps(out, indent=1))

import flame as fl
import flame.nn.functional as F
from flame.runtime import library_cudnn

print(library_cudnn.status())
rng = np.random.default_rng(0)
for dtype in (fl.bfloat16, fl.float32):
    x = rng.standard_normal((4, 32, 17, 19)).astype(np.float32)
    w = rng.standard_normal((48, 32, 3, 3)).astype(np.float32) * 0.1
    gy = rng.standard_normal((4, 48, 9, 10)).astype(np.float32)
    res = {}
    for backend in ("reference", "cuda"):
        with fl.backend(backend):
            X = fl.tensor(x).to(dtype).requires_grad_()
            W = fl.tensor(w).to(dtype).requires_grad_()
            t = time.perf_counter()
            y = F.conv2d(X, W, stride=2, padding=1)
            (y.float() * fl.tensor(gy)).sum().backward()
            res[backend] = [
                y.float().numpy().copy(),
                X.grad.float().numpy().copy(),
                W.grad.float().numpy().copy(),
            ]
            print(backend, dtype, "first call", round((time.perf_counter() - t) * 1e3, 1), "ms")
    for name, a, b in zip(("y", "dx", "dw"), res["cuda"], res["reference"]):
        print("conv", dtype, name, float(np.abs(a - b).max() / (np.abs(b).max() + 1e-9)))
print(library_cudnn.plan_counts())
for causal in (False, True):
    q = rng.standard_normal((2, 4, 300, 64)).astype(np.float32)
    k = rng.standard_normal((2, 4, 257, 64)).astype(np.float32)
    v = rng.standard_normal((2, 4, 257, 64)).astype(np.float32)
    go = rng.standard_normal((2, 4, 300, 64)).astype(np.float32)
    res = {}
    for backend in ("reference", "cuda"):
        with fl.backend(backend):
            Q, K, V = [fl.tensor(a).to(fl.bfloat16).requires_grad_() for a in (q, k, v)]
            o = F.scaled_dot_product_attention(Q, K, V, is_causal=causal)
            (o.float() * fl.tensor(go)).sum().backward()
            res[backend] = [o.float().numpy().copy()] + [
                t.grad.float().numpy().copy() for t in (Q, K, V)
            ]
    for name, a, b in zip(("o", "dq", "dk", "dv"), res["cuda"], res["reference"]):
        print("sdpa causal", causal, name, float(np.abs(a - b).max() / (np.abs(b).max() + 1e-9)))
print(library_cudnn.plan_counts())
