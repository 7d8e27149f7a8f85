"""Where the host time of lazy mode goes (tiny20 on [1024], built and realized every call).

    python -m bench.lazy_profile [--profile | --whole]

Prints µs per call (best of several runs of many calls, the GPU synchronized at the end of
each run) of: the whole call; building the graph alone; ``linearize`` of a built graph; the
plan lookup; running the cached plan (allocation + launch); wrapping the results. With
``--profile``, cProfile's top entries of the whole call follow. On a machine without a GPU it
times the build and ``linearize`` on the reference backend only.
"""

from __future__ import annotations

import cProfile
import gc
import pstats
import sys
import time

from bench import expressions


def per_call_us(function, calls: int = 2000, runs: int = 7, synchronize=None) -> float:
    for _ in range(100):
        function()
    best = float("inf")
    for _ in range(runs):
        if synchronize:
            synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            function()
        if synchronize:
            synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    import flame as fl
    from flame.runtime.device import gpu_available
    from flame.runtime.walks import linearize

    on_gpu = gpu_available()
    backend = "cuda" if on_gpu else "reference"
    with fl.backend(backend):
        x = fl.randn(1024, seed=0).realize()
        y = fl.randn(1024, seed=1).realize()
    ops = expressions.flame_ops(fl)
    sync = fl.synchronize if on_gpu else None

    def build():
        return expressions.tiny20(ops, x, y)

    def call():
        return build().realize()

    if "--whole" in sys.argv:  # the whole call only, for A/B runs in alternating processes
        call()
        print(f"whole call (build + realize) {per_call_us(call, synchronize=sync):8.2f} us")
        return
    built = build()
    rows = {"build (20 ops)": per_call_us(build)}
    rows["linearize"] = per_call_us(lambda: linearize([built.node]))
    if on_gpu:
        from flame.runtime.executor import default_executor

        executor = default_executor()
        call()
        _, inputs, key = linearize([built.node])
        rows["plan lookup (plan_for, hit)"] = per_call_us(
            lambda: executor.plan_for([built.node], inputs, key)
        )
        plan = executor.plan_for([built.node], inputs, key)
        arrays = [(n.buffer or n.attr("storage")).device_array() for n in inputs]
        rows["run the plan (allocate + launch)"] = per_call_us(
            lambda: executor.run(plan, arrays), synchronize=sync
        )
        rows["Executor.realize of a built graph"] = (
            per_call_us(lambda: executor.realize([build().node]), synchronize=sync)
            - rows["build (20 ops)"]
        )
        rows["whole call (build + realize)"] = per_call_us(call, synchronize=sync)
    else:
        rows["build + linearize"] = per_call_us(lambda: linearize([build().node]))
    gc.collect()
    print(f"backend {backend}, python {sys.version.split()[0]}")
    for name, value in rows.items():
        print(f"{name:38s} {value:8.2f} us")
    if "--profile" in sys.argv:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(3000):
            call() if on_gpu else linearize([build().node])
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
