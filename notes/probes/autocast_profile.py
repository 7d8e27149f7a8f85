"""Where the bf16 autocast MLP step spends its device time: FLAME vs torch.compile, every
kernel of one step, timed by the PyTorch profiler (CUPTI sees FLAME's kernels too)."""
import torch
from torch.profiler import ProfilerActivity, profile

from bench.autocast import MLP, flame_step, problem, torch_step

x, y, weights = problem(MLP)
systems = {
    "flame": flame_step(x, y, weights)[0],
    "torch_compile": torch_step(x, y, weights, compiled=True)[0],
}
for name, step in systems.items():
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / 10
    print(f"== {name}: {total:.1f} us of kernels per step")
    for e in events[:16]:
        print(f"{e.device_time_total / 10:9.1f} us  x{e.count // 10:<3d} {e.key[:110]}")
