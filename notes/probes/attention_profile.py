"""Where the attention fwd+bwd step spends its device time: FLAME (cuDNN inside a compiled
step) vs torch SDPA, every kernel, timed by the PyTorch profiler."""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import flame as fl
import flame.nn.functional as F

B, H, L, D = (int(value) for value in (sys.argv[1:] or ["16", "16", "256", "64"]))
shape = (B, H, L, D)
tq, tk, tv, tgo = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
for t in (tq, tk, tv):
    t.requires_grad_()
fq, fk, fv, fgo = (fl.from_dlpack(t.detach().clone()) for t in (tq, tk, tv, tgo))
for t in (fq, fk, fv):
    t.requires_grad_()


@fl.compile
def flame_step(q, k, v, go):
    out = F.scaled_dot_product_attention(q, k, v)
    out.backward(go)
    return out


def run_flame():
    for t in (fq, fk, fv):
        t.grad = None
    flame_step(fq, fk, fv, fgo)


def run_torch():
    for t in (tq, tk, tv):
        t.grad = None
    torch.nn.functional.scaled_dot_product_attention(tq, tk, tv).backward(tgo)


for name, step in (("flame", run_flame), ("torch", run_torch)):
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    fl.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        fl.synchronize()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / 10
    print(f"== {name} {shape}: {total:.1f} us of kernels per step")
    for e in events[:12]:
        print(f"{e.device_time_total / 10:9.1f} us  x{e.count // 10:<3d} {e.key[:100]}")
