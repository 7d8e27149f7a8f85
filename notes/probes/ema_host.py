"""An EMA of 200 weight tensors (160.6 M float32 elements, the AdamW bench's shapes), three
ways: FLAME lazy (a loop of ``e.lerp_(p, w)`` under no_grad), FLAME compiled (the same loop
inside ``fl.compile``), PyTorch eager (the loop, and ``torch._foreach_lerp_``). Wall time per
EMA step with the GPU's work included (synchronize after 20 steps).

    PYTHONPATH=. python notes/probes/ema_host.py
"""

import time

import numpy as np

import flame as fl

SHAPES = [(1024, 784)] * 200  # 160.6 M elements


def wall_ms(step, count=20):
    for _ in range(3):
        step()
    fl.synchronize()
    start = time.perf_counter()
    for _ in range(count):
        step()
    fl.synchronize()
    return (time.perf_counter() - start) / count * 1e3


def main():
    rng = np.random.default_rng(0)
    with fl.backend("cuda"):
        params = [fl.tensor(rng.standard_normal(s, dtype=np.float32)).realize() for s in SHAPES]
        ema = [fl.tensor(rng.standard_normal(s, dtype=np.float32)).realize() for s in SHAPES]

        def lazy():
            with fl.no_grad():
                for e, p in zip(ema, params):
                    e.lerp_(p, 1e-3)

        @fl.compile
        def compiled():
            with fl.no_grad():
                for e, p in zip(ema, params):
                    e.lerp_(p, 1e-3)
            return params[0].sum()

        print(f"flame lazy loop: {wall_ms(lazy):.3f} ms per EMA step")
        print(f"flame compiled: {wall_ms(compiled):.3f} ms per EMA step")
        (program,) = compiled._state._programs.values()
        print(f"  direct writes {sum(s is not None for s in program.direct)}/{len(program.direct)}")
    import torch

    tp = [torch.randn(s, device="cuda") for s in SHAPES]
    te = [torch.randn(s, device="cuda") for s in SHAPES]

    def torch_loop():
        with torch.no_grad():
            for e, p in zip(te, tp):
                e.lerp_(p, 1e-3)

    def torch_foreach():
        with torch.no_grad():
            torch._foreach_lerp_(te, tp, 1e-3)

    for name, step in (("torch loop", torch_loop), ("torch _foreach_lerp_", torch_foreach)):
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        print(f"{name}: {(time.perf_counter() - start) / 20 * 1e3:.3f} ms per EMA step")


main()
