"""The kernels of one compiled ResBlock forward + backward in launch order (bf16, 128 ch 32x32
b32), with each cuDNN layout transpose's neighbours and sizes: which operand cuDNN transposes.

    PYTHONPATH=. python3 notes/probes/resblock_kernel_order.py [batch channels size embedding]
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import flame as fl
import flame.nn as fnn
from bench.conv_attention import resblock_class

batch, channels, size, embedding = (int(v) for v in (sys.argv[1:] or [32, 128, 32, 512]))
torch.manual_seed(0)
module = resblock_class(torch.nn)(channels, embedding).cuda().bfloat16()
block = resblock_class(fnn)(channels, embedding).bfloat16()
block.load_state_dict({k: v.float().cpu().numpy() for k, v in module.state_dict().items()})
x = torch.randn(batch, channels, size, size, device="cuda", dtype=torch.bfloat16)
temb = torch.randn(batch, embedding, device="cuda", dtype=torch.bfloat16)
gout = torch.randn(batch, channels, size, size, device="cuda", dtype=torch.bfloat16)
fx, ftemb, fgout = (fl.from_dlpack(t.clone()) for t in (x, temb, gout))
fx.requires_grad_()
ftemb.requires_grad_()


@fl.compile
def step(x, temb, gout):
    out = block(x, temb)
    out.backward(gout)
    return out


def run():
    block.zero_grad(set_to_none=True)
    fx.grad = ftemb.grad = None
    step(fx, ftemb, fgout)


for _ in range(4):
    run()
fl.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    run()
    fl.synchronize()
kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
kernels.sort(key=lambda e: e.time_range.start)
for index, event in enumerate(kernels):
    print(f"{index:3d} {event.time_range.elapsed_us():8.1f} us  {event.name[:110]}")
