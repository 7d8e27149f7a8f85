"""The README's main job: realize the elementwise chain of bench/ as one fused kernel and
compare it with the unfused path (every op realized on its own, as an eager library runs it).

    python examples/elementwise_chain.py [--elements N]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import flame as fl


def chain(x, y, realize_each=False):
    step = (lambda t: t.realize()) if realize_each else (lambda t: t)
    a = step(x * 1.5)
    a = step(a + y)
    a = step(fl.gelu(a, approximate="tanh"))
    a = step(a * step(fl.sigmoid(y)))
    b = step(step(0.5 * x) * x)
    c = step(fl.tanh(step(x - y)))
    return step(step(a - b) + c)


def timed(function, repeats):
    fl.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function().realize()
        fl.synchronize()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main() -> None:
    from flame.runtime.device import gpu_available, gpu_unavailable_reason

    if gpu_available():
        run()
    else:
        print(f"no GPU ({gpu_unavailable_reason()}): running on the reference backend")
        with fl.backend("reference"):
            run()


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--elements", type=int, default=1 << 26)
    parser.add_argument("--repeats", type=int, default=20)
    options = parser.parse_args()
    on_gpu = fl.get_backend() == "cuda"
    count = options.elements if on_gpu else min(options.elements, 1 << 16)
    x = fl.randn(count, seed=0).realize()
    y = fl.randn(count, seed=1).realize()

    start = time.perf_counter()
    fused = chain(x, y).realize().numpy()
    print(f"first call (build, fuse, compile or load from cache, run): "
          f"{(time.perf_counter() - start) * 1e3:.1f} ms")
    unfused = chain(x, y, realize_each=True).numpy()
    error = np.linalg.norm(fused - unfused) / np.linalg.norm(unfused)
    print(f"fused vs unfused relative L2 difference: {error:.2e}")

    fused_ms = timed(lambda: chain(x, y), options.repeats)
    unfused_ms = timed(lambda: chain(x, y, realize_each=True), options.repeats)
    moved = 3 * 4 * count
    print(f"{count} elements on {fl.get_backend()}:")
    print(f"  fused   {fused_ms:8.3f} ms  ({moved / fused_ms / 1e6:7.1f} GB/s)")
    print(f"  unfused {unfused_ms:8.3f} ms  ({unfused_ms / fused_ms:.1f}x slower)")


if __name__ == "__main__":
    main()
