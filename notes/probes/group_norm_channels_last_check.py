"""GroupNorm + SiLU + time embedding on channels-last float32 memory, forward and backward:
a script for `flame check` (each fused kernel against the float64 reference)."""

import numpy as np

import flame as fl
import flame.nn.functional as F

rng = np.random.default_rng(0)
nhwc = rng.standard_normal((2, 7, 5, 64)).astype(np.float32) * 3 + 1.5
leaf = fl.tensor(nhwc).requires_grad_()
x = leaf.permute(0, 3, 1, 2)  # NHWC memory seen as NCHW
weight = fl.tensor(rng.standard_normal(64).astype(np.float32)).requires_grad_()
bias = fl.tensor(rng.standard_normal(64).astype(np.float32)).requires_grad_()
emb = fl.tensor(rng.standard_normal((2, 64, 1, 1)).astype(np.float32))
out = F.silu(F.group_norm(x, 8, weight, bias)) + emb
gy = fl.tensor(rng.standard_normal(out.shape).astype(np.float32))
(out * gy).sum().backward()
print(float(leaf.grad.sum().numpy()), float(weight.grad.sum().numpy()))
