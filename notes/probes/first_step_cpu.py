"""The first compiled UNet training step's host phases, measured on a machine without a GPU.

    .venv/bin/python notes/probes/first_step_cpu.py [--size full] [--image 32] [--batch 64]
        [--threads 8] [--compile {none,threads,processes,both}] [--profile OUT.pstats]
        [--model {unet,dit}] [--pin-sources TEXT]

A warm first step: run it twice with one ``FLAME_CACHE_DIR`` (the second process loads the
plan and kernels from disk); ``--pin-sources`` keeps the plan store's key when flame/ is
edited between the runs (only sound while the edits build the same plans).

Builds bench.diffusion's FLAME trainer on the CUDA backend with the GPU replaced by the
reference interpreter (weights realized in NumPy, held as not-yet-uploaded host data), traces
the compiled step, and plans it as the GPU run does: the pass pipeline, lowering, rendering
and NVRTC compiles (NVRTC needs no GPU), with module loading and launching left out. Prints
the seconds of each phase:

- ``trace``: the step's Python (forward, loss, autograd, clipping, optimizer, EMA) up to the
  plan, measured as the trace event minus the plan;
- ``passes.<name>``: each pass of the pipeline; ``lower``: lowering every group
  (``PlanLowering.lower``);
- ``load``: the executor's kernel loads (cache lookups, rendering, NVRTC) as the plan does them;
- ``render``: rendering every kernel again, apart;
- ``nvrtc_threads`` / ``nvrtc_processes``: the plan's kernels compiled again with no cache
  (``--compile``), in N threads or N processes, to see whether NVRTC scales;
- ``trace_without_plan_for``: the trace less ``plan_for`` (with a plan loaded from disk,
  ``trace`` still holds the load);
- ``realizes``, ``realize_plans``: the step's own realizes (an optimizer's first step
  realizes its zeroed state, one tensor a parameter) and the executor's plans for them (the
  host's part of a realize on the GPU); ``stand_in_values``: NumPy computing their values
  (the GPU's kernels do this), and ``first_step_host``: ``first_step`` without it;
- ``plan_for``: the executor's plan lookups (memory, the disk's plan store, or ``plan``);
  ``plan_disk_hits``: plans loaded from the plan store (set ``FLAME_PLAN_CACHE=0`` to plan
  every time);
- ``siblings``: the background size-class work for the plan's row kernels (lowered and
  rendered, not compiled);
- ``gc_seconds``, ``gc_collections``: the garbage collector's time and passes (per
  generation) during the first step;
- ``imports``: modules imported during the step (PyTorch must not be one).

Kernels are compiled into an empty cache directory (FLAME_CACHE_DIR is set to a new temporary
directory unless given), so each run is a cold start.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def _compile_one(item):
    """NVRTC one kernel (a process pool's job): (source, name, arch) -> seconds."""
    from flame.runtime.compiler import nvrtc_compile

    start = time.perf_counter()
    nvrtc_compile(*item)
    return time.perf_counter() - start


def patch_gpu_away(timings: dict) -> None:
    """Realize on the reference interpreter, plan launches for a made-up H100, compile but
    load no module."""
    from flame.runtime import launch, reference
    from flame.runtime.device import DeviceInfo
    from flame.runtime.executor import Executor
    from flame.runtime.storage import Storage

    def realize(nodes):
        # what the GPU's realize does on the host: plan the graph (cached by its key), ...
        from flame.runtime.executor import default_executor
        from flame.runtime.walks import linearize

        start = time.perf_counter()
        pending = [node for node in nodes if node.buffer is None and node.op != "buffer"]
        if pending:
            timings["realizes"] = timings.get("realizes", 0) + 1
            _, inputs, key = linearize(pending)
            default_executor().plan_for(pending, inputs, key)
        middle = time.perf_counter()
        timings["realize_plans"] = timings.get("realize_plans", 0.0) + middle - start
        # ... while its kernels compute the values: here NumPy does, apart (an optimizer's
        # zeroed state, ~290 MB for the full UNet, is copied on the host)
        reference.realize(nodes, lambda dtype, array: Storage("cuda", dtype, host=array))
        seconds = time.perf_counter() - middle
        timings["stand_in_values"] = timings.get("stand_in_values", 0.0) + seconds

    sys.modules["flame.backend"]._realize_on_gpu = realize  # flame.backend is also a function
    fake = DeviceInfo("CPU stand-in for an H100", "sm_90", 132, 50 * 2**20)
    launch.device_info = lambda: fake

    def load(self, sources):
        start = time.perf_counter()
        self.kernels.cubins(sources)
        timings["load"] = timings.get("load", 0.0) + time.perf_counter() - start
        timings["kernels"] = timings.get("kernels", 0) + len(sources)
        timings.setdefault("sources", []).extend(sources)
        return [None] * len(sources)

    Executor._load = load


def direct_writes_as_on_gpu(timings: dict) -> None:
    """``direct_writes`` skips memory that is not a contiguous device array: here every
    write target gets a stand-in array for the call, so the checks run as on the GPU."""
    from types import SimpleNamespace

    flame_compile = sys.modules["flame.compile"]  # flame.compile is also a function
    checked = flame_compile.direct_writes

    def direct_writes(program, order, inputs, trace):
        moved = []
        for storage, _value, _ in trace.writes.values():
            if storage.array is None and storage.host is not None:
                flags = SimpleNamespace(c_contiguous=True)
                data = SimpleNamespace(ptr=id(storage))
                storage.array = SimpleNamespace(flags=flags, shape=storage.host.shape, data=data)
                moved.append(storage)
        start = time.perf_counter()
        try:
            return checked(program, order, inputs, trace)
        finally:
            timings["direct_writes"] = time.perf_counter() - start
            for storage in moved:
                storage.array = None

    flame_compile.direct_writes = direct_writes


def record_passes(timings: dict) -> None:
    """Time each pass and the lowering as the executor's plan runs them."""
    from flame.ir.passes import pipeline
    from flame.runtime import executor

    def timed(step):
        @functools.wraps(step)
        def run(graph):
            start = time.perf_counter()
            result = step(graph)
            key = f"passes.{step.__name__}"
            timings[key] = timings.get(key, 0.0) + time.perf_counter() - start
            return result

        return run

    pipeline.PIPELINE = tuple(timed(step) for step in pipeline.PIPELINE)
    from flame.codegen.lower import PlanLowering

    lower = PlanLowering.lower

    def lower_timed(self, group):
        start = time.perf_counter()
        result = lower(self, group)
        timings["lower"] = timings.get("lower", 0.0) + time.perf_counter() - start
        return result

    PlanLowering.lower = lower_timed
    plan = executor.Executor._plan

    def plan_timed(self, pending, inputs):
        start = time.perf_counter()
        result = plan(self, pending, inputs)
        timings["plan"] = timings.get("plan", 0.0) + time.perf_counter() - start
        timings["groups"] = len(result.graph.groups)
        timings["nodes"] = sum(len(group.nodes) for group in result.graph.groups)
        return result

    executor.Executor._plan = plan_timed
    plan_for = executor.Executor.plan_for

    def plan_for_timed(self, pending, inputs, key):
        start = time.perf_counter()
        hits = self.plan_disk_hits
        result = plan_for(self, pending, inputs, key)
        timings["plan_for"] = timings.get("plan_for", 0.0) + time.perf_counter() - start
        if self.plan_disk_hits > hits:  # loaded from the plan store (flame/runtime/plan_store.py)
            timings["plan_disk_hits"] = timings.get("plan_disk_hits", 0) + 1
            timings["groups"] = len(result.graph.groups)
            timings["nodes"] = sum(len(group.nodes) for group in result.graph.groups)
        return result

    executor.Executor.plan_for = plan_for_timed


def watch_collections(timings: dict):
    """Count the garbage collector's passes and their seconds (``gc_seconds``,
    ``gc_collections`` per generation) until the returned callback is removed."""
    started = []

    def callback(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
            return
        seconds = time.perf_counter() - started.pop()
        timings["gc_seconds"] = timings.get("gc_seconds", 0.0) + seconds
        counts = timings.setdefault("gc_collections", [0, 0, 0])
        counts[info["generation"]] += 1

    gc.callbacks.append(callback)
    return callback


def move_to_cuda() -> None:
    """Every live tensor moved to the CUDA backend, its data as host data not yet uploaded."""
    import numpy as np

    from flame.ir import dtypes
    from flame.random import Generator
    from flame.runtime.storage import Storage
    from flame.tensor import Tensor

    gc.collect()
    for value in gc.get_objects():
        if isinstance(value, Generator):
            value._states["cuda"] = Storage("cuda", dtypes.int64, host=np.zeros(2, np.int64))
        elif isinstance(value, Tensor):
            value.backend = "cuda"
        elif isinstance(value, Storage) and value.backend == "reference":
            value.backend, value.host, value.array = "cuda", value.array, None


def recompile(sources, threads: int, mode: str) -> dict:
    """Compile every kernel again with no cache: seconds of the whole, in threads/processes."""
    from flame.runtime.device import target_arch

    items = [(source(), name, target_arch()) for source, name, *_ in sources]
    result = {}
    start = time.perf_counter()
    one = _compile_one(items[0])
    result["nvrtc_one_kernel"] = one
    if mode in ("threads", "both"):
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            summed = sum(pool.map(_compile_one, items))
        result[f"nvrtc_threads_{threads}"] = time.perf_counter() - start
        result["nvrtc_summed_in_threads"] = summed
    if mode in ("processes", "both"):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(threads, mp_context=context) as pool:
            pool.submit(_compile_one, items[0]).result()  # started and warm
            start = time.perf_counter()
            summed = sum(pool.map(_compile_one, items))
        result[f"nvrtc_processes_{threads}"] = time.perf_counter() - start
        result["nvrtc_summed_in_processes"] = summed
    start = time.perf_counter()
    for item in items[:20]:
        _compile_one(item)
    result["nvrtc_serial_20"] = time.perf_counter() - start
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="unet", choices=("unet", "dit"))
    parser.add_argument("--size", default="full")
    parser.add_argument("--image", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=8)
    modes = ("none", "threads", "processes", "both")
    parser.add_argument("--compile", default="none", choices=modes)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--dump", default=None, help="write every kernel's source here")
    parser.add_argument(
        "--pin-sources", default=None, metavar="TEXT",
        help="use TEXT as the plan store's source digest (compare runs while others edit"
        " flame/; only sound while the plans the edits build stay the same)",
    )  # fmt: skip
    options = parser.parse_args()
    os.environ.setdefault("FLAME_CACHE_DIR", tempfile.mkdtemp(prefix="flame-first-step-"))
    os.environ["FLAME_SIBLING_CLASSES"] = "0"  # timed apart below

    timings: dict = {}
    start = time.perf_counter()
    import flame as fl
    from bench import diffusion as bd

    timings["import"] = time.perf_counter() - start
    patch_gpu_away(timings)
    if options.pin_sources:
        from flame.runtime import plan_store

        plan_store.source_digest = lambda: options.pin_sources
    record_passes(timings)
    direct_writes_as_on_gpu(timings)
    from flame.runtime import events

    start = time.perf_counter()
    with fl.backend("reference"):  # in-place initialisers write device memory: built here
        trainer = bd.flame_trainer((options.model, options.size, options.image, options.batch))
        images, labels = bd.flame_batch(options.image, options.batch)
    move_to_cuda()
    timings["build"] = time.perf_counter() - start
    # A GPU process has imported CuPy before its first step (uploading the weights); here
    # nothing uploads, and the step's first convolution imported it (~0.2-0.4 s).
    start = time.perf_counter()
    import cupy  # noqa: F401

    timings["import_cupy"] = time.perf_counter() - start
    with fl.backend("cuda"):
        before = set(sys.modules)
        traces = []
        profile = cProfile.Profile() if options.profile else None
        start = time.perf_counter()
        collections = watch_collections(timings)
        with events.recording(lambda kind, data: traces.append((kind, data))):
            if profile is not None:
                profile.enable()
            try:
                trainer.compiled(images, labels)
            except Exception as error:  # the replay needs a GPU: the plan is what we time
                timings["replay"] = f"not run ({type(error).__name__})"
            if profile is not None:
                profile.disable()
        timings["first_step"] = time.perf_counter() - start
        gc.callbacks.remove(collections)
    trace_seconds = sum(data["seconds"] for kind, data in traces if kind == "trace")
    timings["trace_total"] = trace_seconds
    timings["trace"] = trace_seconds - timings.get("plan", 0.0)
    timings["trace_without_plan_for"] = trace_seconds - timings.get("plan_for", 0.0)
    # the first step less what NumPy computed in place of the GPU's kernels
    timings["first_step_host"] = timings["first_step"] - timings.get("stand_in_values", 0.0)
    timings["imports"] = sorted(
        name for name in set(sys.modules) - before if "." not in name and name != "__mp_main__"
    )
    sources = timings.pop("sources", [])
    if options.profile:
        profile.dump_stats(options.profile)
    rows = [row for row in trainer_rows(sources)]
    timings["row_kernels"] = len(rows)
    from flame.codegen.render import render

    start = time.perf_counter()
    for _, _, _, spec in sources:
        render(spec)
    timings["render"] = time.perf_counter() - start
    if options.dump:
        os.makedirs(options.dump, exist_ok=True)
        for source, name, *_ in sources:
            with open(os.path.join(options.dump, f"{name}.cu"), "w") as file:
                file.write(source())
    names = [name for _, name, *_ in sources]
    timings["unique_names"] = len(set(names))
    if options.compile != "none" and sources:
        timings.update(recompile(sources, options.threads, options.compile))
    text = json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in timings.items()})
    print(text)
    if options.json:
        with open(options.json, "w") as file:
            file.write(text + "\n")


def trainer_rows(sources):
    return [item for item in sources if item[3].size_class]


if __name__ == "__main__":
    main()
