"""bench/diffusion.py's ``sampling`` section: the whole DDIM chain (guided, no gradients) with
FLAME's ``Sampler`` against the same chain in PyTorch, eager and compiled, from the same
weights, noise and labels."""

from __future__ import annotations

from bench import conv_attention as ca
from bench.diffusion_cases import (
    CHANNELS,
    CLASSES,
    GUIDANCE,
    TARGETS,
    progress,
    targets_met,
    torch_model,
)


def sampling_systems(case, backend: str) -> dict:
    import torch

    import flame as fl
    from examples.diffusion.diffusion import Sampler, make_schedule
    from examples.diffusion.models import build_model

    name, size, image_size, images, steps = case
    model, device = torch_model(case, backend).eval(), ca.torch_device(backend)
    torch.manual_seed(1)
    noise = torch.randn(images, CHANNELS, image_size, image_size, device=device)
    labels = torch.randint(0, CLASSES, (images,), device=device)

    def sampler(network):
        return Sampler(network, make_schedule("linear"), kind="ddim", steps=steps,
                       guidance=GUIDANCE, num_classes=CLASSES)  # fmt: skip

    def flame_build():
        network = build_model(name, image_size, CHANNELS, CLASSES, size)
        network.load_state_dict({k: v.float().cpu().numpy() for k, v in model.state_dict().items()})
        chain, x, y = (
            sampler(network.eval()),
            ca.to_flame(noise, backend),
            ca.to_flame(labels, backend),
        )

        def call():
            with fl.inference_mode(), fl.autocast(dtype=fl.bfloat16):
                return (chain.sample(x, y).realize(),)

        return call, ca.flame_clock(backend)

    def torch_build(compiled: bool):
        def build():
            with fl.backend(backend):  # the per-step values: FLAME's sampler's, on the host
                chain = sampler(None)
            plan = [(torch.full((images,), int(t), device=device),
                     torch.tensor(h, dtype=torch.float32, device=device))
                    for t, h in zip(chain.timesteps, chain.per_step_values())]  # fmt: skip
            null = torch.full_like(labels, CLASSES)

            def ddim_step(x, t, h):  # Sampler._step: DDIM, eta 0, guided, x0 clipped
                doubled = model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([labels, null]))
                conditional, unconditional = doubled.chunk(2)
                output = (unconditional + h[2] * (conditional - unconditional)).float()
                x0 = ((x - h[1] * output) / h[0]).clamp(-1.0, 1.0)
                return h[3] * x0 + h[4] * (x - h[0] * x0) / h[1]

            step = torch.compile(ddim_step) if compiled else ddim_step

            def call():
                with torch.inference_mode(), torch.autocast(device, dtype=torch.bfloat16):
                    x = noise
                    for t, h in plan:
                        x = step(x, t, h)
                    return (x.clamp(-1.0, 1.0),)

            return call, ca.torch_clock(device)

        return build

    return {
        "torch_eager": ca.System(torch_build(False)),
        "flame": ca.System(flame_build, ca.flame_scope(backend)),
        "torch_compile": ca.System(torch_build(True), skip=ca.torch_compile_skip(backend)),
    }


def sampling_section(backend: str, cases, timing) -> dict:
    rows = []
    for case in cases:
        label = f"{case[0]} {case[1]} {case[2]}x{case[2]}, {case[3]} images, {case[4]} steps"
        progress(f"sampling {label}")
        results = ca.run_systems(sampling_systems(case, backend), timing, ("samples",), backend)
        for entry in results.values():
            if entry.get("ms"):
                entry["images_per_s"] = case[3] * 1e3 / entry["ms"]
        found = ca.ratios(results, backend, "")
        rows.append({"label": label, "results": results, "ratios": found,
                     "targets": targets_met(TARGETS["sampling"], found)})  # fmt: skip
    return {"guidance": GUIDANCE, "rows": rows}
