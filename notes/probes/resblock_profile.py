"""Where a UNet ResBlock's forward + backward spends device time (bf16, 128ch 32x32 b32):
FLAME compiled vs torch.compile vs eager, every kernel by the PyTorch profiler; and PyTorch
eager conv fwd+bwd in NCHW vs channels-last (is NHWC faster on this GPU?)."""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import flame as fl
import flame.nn as fnn
from bench.conv_attention import resblock_class

batch, channels, size, embedding = (int(v) for v in (sys.argv[1:] or [32, 128, 32, 512]))
torch.manual_seed(0)
module = resblock_class(torch.nn)(channels, embedding).cuda().bfloat16()
x = torch.randn(
    batch, channels, size, size, device="cuda", dtype=torch.bfloat16, requires_grad=True
)
temb = torch.randn(batch, embedding, device="cuda", dtype=torch.bfloat16, requires_grad=True)
gout = torch.randn(batch, channels, size, size, device="cuda", dtype=torch.bfloat16)
block = resblock_class(fnn)(channels, embedding).bfloat16()
block.load_state_dict({k: v.float().cpu().numpy() for k, v in module.state_dict().items()})
fx, ftemb, fgout = (fl.from_dlpack(t.detach().clone()) for t in (x, temb, gout))
fx.requires_grad_()
ftemb.requires_grad_()


@fl.compile
def flame_step(x, temb, gout):
    out = block(x, temb)
    out.backward(gout)
    return out


compiled = torch.compile(module)


def run_flame():
    block.zero_grad(set_to_none=True)
    fx.grad = ftemb.grad = None
    flame_step(fx, ftemb, fgout)


def run_torch(forward):
    def run():
        module.zero_grad(set_to_none=True)
        x.grad = temb.grad = None
        forward(x, temb).backward(gout)

    return run


for name, step in (("flame", run_flame), ("torch.compile", run_torch(compiled)),
                   ("eager", run_torch(module))):  # fmt: skip
    for _ in range(5):
        step()
    fl.synchronize()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        fl.synchronize()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / 10
    print(f"== {name}: {total:.1f} us of kernels per step")
    for e in events[:14]:
        print(f"{e.device_time_total / 10:9.1f} us  x{e.count // 10:<3d} {e.key[:96]}")

print("== eager conv3x3 fwd+bwd, NCHW vs channels-last (ms)")
for b, c, s in ((8, 64, 128), (16, 128, 64), (32, 256, 32), (32, 512, 16), (64, 512, 8)):
    conv = torch.nn.Conv2d(c, c, 3, padding=1).cuda().bfloat16()
    times = []
    for layout in (torch.contiguous_format, torch.channels_last):
        conv = conv.to(memory_format=layout)
        xi = torch.randn(b, c, s, s, device="cuda", dtype=torch.bfloat16)
        xi = xi.to(memory_format=layout).requires_grad_()
        g = torch.randn(b, c, s, s, device="cuda", dtype=torch.bfloat16).to(memory_format=layout)
        for _ in range(3):
            conv(xi).backward(g)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(20):
            conv(xi).backward(g)
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / 20)
    print(
        f"{b}x{c}x{s}x{s}: NCHW {times[0]:.3f}  NHWC {times[1]:.3f}  "
        f"ratio {times[0] / times[1]:.2f}"
    )
