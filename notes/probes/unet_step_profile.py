"""Where a training step's device time goes: FLAME's compiled step against torch.compile
and eager (bench/diffusion.py's systems, same weights), every GPU kernel by the PyTorch
profiler (CUPTI sees CuPy's launches too), grouped by kind.

    python notes/probes/unet_step_profile.py OUT_DIR [model size image batch [systems]]
    python notes/probes/unet_step_profile.py OUT_DIR sampling size image images [systems]

(``sampling``: the guided DDIM chain of bench/diffusion_sampling.py over 10 steps, UNet.)

Writes ``profile.json`` (per system: kernels by total time, totals per kind) and prints the
top kernels of each system.
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench import diffusion as bd

KINDS = (  # first match wins: (kind, substrings of the kernel name)
    ("attention", ("fmha", "flash", "attention", "sdpa", "_forward", "_backward")),
    ("conv", ("cudnn", "conv", "xmma", "implicit", "dgrad", "wgrad", "fprop", "winograd")),
    ("gemm", ("gemm", "nvjet", "cutlass", "cublas", "sm90_")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "lerp", "multi")),
    ("triton", ("triton",)),
    ("flame reduce", ("reduce", "row")),
    ("flame elementwise", ("ew", "elementwise", "fused")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, needles in KINDS:
        if any(needle in lowered for needle in needles):
            return kind
    return "other"


def profiled(call, synchronize, steps: int = 5) -> dict:
    for _ in range(3):
        call()
    synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            call()
        synchronize()
    kernels = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels[event.name]
            entry[0] += event.device_time / steps
            entry[1] += 1
    rows = sorted(((us, n // steps, name) for name, (us, n) in kernels.items()), reverse=True)
    kinds = defaultdict(lambda: [0.0, 0])
    for us, count, name in rows:
        kinds[kind_of(name)][0] += us
        kinds[kind_of(name)][1] += count
    return {"total_us": sum(r[0] for r in rows), "launches": sum(r[1] for r in rows),
            "kinds": dict(kinds), "kernels": rows}  # fmt: skip


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    model, size, image, batch = (
        sys.argv[2:6] + ["unet", "full", "32", "64"][len(sys.argv[2:6]) :]
    )[:4]
    report = {}
    wanted = sys.argv[6].split(",") if len(sys.argv) > 6 else None  # e.g. "flame"
    if model == "sampling":
        from bench.diffusion_sampling import sampling_systems

        systems = sampling_systems(("unet", size, int(image), int(batch), 10), "cuda")
    else:
        systems = bd.step_systems((model, size, int(image), int(batch)), "cuda", False)
    for key, system in systems.items():
        if wanted and key not in wanted:
            continue
        build = system.build if hasattr(system, "build") else system
        scope = system.scope() if hasattr(system, "scope") else None
        if scope is not None:
            scope.__enter__()
        call, clock = build()
        report[key] = profiled(call, clock.synchronize)
        if scope is not None:
            scope.__exit__(None, None, None)
        found = report[key]
        print(f"== {key}: {found['total_us'] / 1e3:.2f} ms device, {found['launches']} launches")
        for kind, (us, n) in sorted(found["kinds"].items(), key=lambda kv: -kv[1][0]):
            print(f"   {kind:18s} {us / 1e3:8.2f} ms {n:5d} launches")
        for us, n, name in found["kernels"][:25]:
            print(f"   {us:9.1f} us x{n:3d} {name[:110]}")
    (out / "profile.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
