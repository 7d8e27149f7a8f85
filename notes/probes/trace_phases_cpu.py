"""The first compiled step's trace by phase, on the CPU: first_step_cpu.py with timers.

    FLAME_CACHE_DIR=DIR .venv/bin/python notes/probes/trace_phases_cpu.py --model unet \
        --pin-sources PIN

Runs ``first_step_cpu.main`` (same arguments) with main-thread CPU timers
(``time.thread_time``) around the phases of the compiled step's trace and prints one JSON
line: ``host_cpu`` / ``host_wall`` (the trace, ``CompiledFunction._build``, less every
``plan_for`` and less the reference interpreter standing in for the GPU's kernels), the
probe's ``trace_without_plan_for``, ``stand_in_values`` and ``direct_writes``, and per phase:
``forward_loss``, ``backward``, ``clip``, ``optimizer`` (with ``optimizer.zeros_state``, the
first step's zeroed state, apart), ``ema``, ``linearize``, ``plan_for``, ``stand_in``.
Timers count only inside ``_build``. notes/trace-speed.md compares trees with it (alternate
runs of two trees, medians: the machine's load moves single runs by +-30 %).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "notes/probes"))

import first_step_cpu as probe  # noqa: E402

WALL: dict = {}
CPU: dict = {}
INSIDE: list = []  # non-empty while the trace (``_build``) runs


def timed(owner, name: str, key: str) -> None:
    """``owner.name`` wrapped to add its seconds to ``key`` (inside the trace only)."""
    function = getattr(owner, name)
    outermost = key == "trace"

    def run(*args, **kwargs):
        if not outermost and not INSIDE:
            return function(*args, **kwargs)
        if outermost:
            INSIDE.append(key)
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            WALL[key] = WALL.get(key, 0.0) + time.perf_counter() - wall
            CPU[key] = CPU.get(key, 0.0) + time.thread_time() - cpu
            if outermost:
                INSIDE.pop()

    setattr(owner, name, run)


def main() -> None:
    import flame  # noqa: F401
    import flame.nn.utils as nn_utils
    import flame.optim.adam as adam
    import flame.optim.optimizer as optimizer
    import flame.optim.swa_utils as swa_utils
    import flame.runtime.executor as executor
    import flame.runtime.reference as reference
    import flame.runtime.walks as walks
    from examples.diffusion import train

    timed(sys.modules["flame.compile"].CompiledFunction, "_build", "trace")
    timed(train, "diffusion_loss", "forward_loss")
    timed(sys.modules["flame.tensor"].Tensor, "backward", "backward")
    timed(nn_utils, "clip_grad_norm_", "clip")
    timed(optimizer.Optimizer, "step", "optimizer")
    timed(adam, "zeros_state", "optimizer.zeros_state")
    timed(swa_utils.AveragedModel, "update_parameters", "ema")
    timed(walks, "linearize", "linearize")
    timed(executor.Executor, "plan_for", "plan_for")
    timed(reference, "realize", "stand_in")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        probe.main()
    phases = json.loads(printed.getvalue().strip().splitlines()[-1])
    kept = ("trace_without_plan_for", "stand_in_values", "direct_writes")
    result = {key: phases.get(key) for key in kept}
    apart = ("plan_for", "stand_in")
    result["host_wall"] = round(WALL["trace"] - sum(WALL.get(key, 0.0) for key in apart), 3)
    result["host_cpu"] = round(CPU["trace"] - sum(CPU.get(key, 0.0) for key in apart), 3)
    result.update({key: round(seconds, 3) for key, seconds in CPU.items() if key != "trace"})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
