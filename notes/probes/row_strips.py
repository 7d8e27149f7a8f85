"""Probe (device machine): layer norm fwd+bwd float32 plans, timed per kernel; the shape is
``PROBE_SHAPE`` (default ``16384,4096``).

``PYTHONPATH=. python3 notes/probes/row_strips.py old 128 256 512``: ``old`` is the plan
without row/column fusion (three kernels); a number is the fused plan with that many strips.
Prints the median device time of the whole plan and of each kernel (CUDA events, batches of
20 back-to-back runs), and a device-to-device copy for the bandwidth reference.
"""

import os
import sys

import cupy as cp
import numpy as np

import flame as fl
import flame.ir.passes.row_columns as row_columns
import flame.ir.passes.split as split
from flame.runtime.executor import _array_of, default_executor, linearize

SHAPE = tuple(int(n) for n in os.environ.get("PROBE_SHAPE", "16384,4096").split(","))
BATCH, REPEATS = 20, 15


def batched(run) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(REPEATS):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(BATCH):
            run()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / BATCH)
    return float(np.median(times))


def build():
    rng = np.random.default_rng(0)
    x, dy = (fl.tensor(rng.standard_normal(SHAPE, dtype=np.float32)) for _ in range(2))
    w = fl.tensor((1 + 0.1 * rng.standard_normal(SHAPE[-1])).astype(np.float32))
    b = fl.tensor(rng.standard_normal(SHAPE[-1]).astype(np.float32))
    kept = {}

    def objective(x, w, b):
        kept["y"] = fl.nn.functional.layer_norm(x, (SHAPE[-1],), w, b, eps=1e-5)
        return fl.sum(kept["y"] * dy)

    _, grads = fl.value_and_grad(objective, argnums=(0, 1, 2))(x, w, b)
    return [kept["y"].node] + [g.node for g in grads]


def main(variants):
    attach, rows = row_columns.attach_columns, split._row_reductions
    source = cp.random.standard_normal(int(np.prod(SHAPE)), dtype=cp.float32)
    target = cp.empty_like(source)
    copy = batched(lambda: cp.copyto(target, source))
    rate = 2 * source.nbytes / copy / 1e9
    print(f"{SHAPE}: copy {source.nbytes / 1e6:.0f} MB: {copy:.4f} ms = {rate:.2f} TB/s")
    executor = default_executor()
    for variant in variants:
        if variant == "old":
            row_columns.attach_columns = lambda graph, groups, materialized: groups
            split._row_reductions = lambda graph: {}
        else:
            row_columns.attach_columns, split._row_reductions = attach, rows
            split.ROW_STRIPS = int(variant)
        nodes = build()
        _, inputs, _ = linearize(nodes)
        plan = executor._plan(nodes, inputs)
        arrays = [_array_of(node) for node in inputs]
        slots = executor.run(plan, arrays)
        whole = batched(lambda p=plan, a=arrays: executor.run(p, a))
        parts = [batched(lambda s=step, v=slots: s.execute(v)) for step in plan.launches]
        grids = [(step.grid, step.block) for step in plan.launches]
        kernels = " + ".join(f"{t:.4f}" for t in parts)
        print(f"{variant:>5}: {whole:.4f} ms  kernels {kernels}  grids {grids}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["old", "256"])
