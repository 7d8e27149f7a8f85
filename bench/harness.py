"""Runs each workload on every system: inputs, correctness check, then the timing loops.

One workload is one row; one system's part of it is one entry. An entry that raises becomes an
error entry with the exception's text, so one broken system never ends the run.
"""

import gc
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy

from bench import environment, timing
from bench.expressions import array_ops
from bench.systems import discover_systems
from bench.workloads import DEVICE, FLAME_ONLY, HOST

FLOAT32_TOLERANCE = 1e-4  # relative L2 error, FLAME against PyTorch eager (or NumPy float64)
INPUT_SEED = 0


@dataclass(frozen=True)
class Options:
    out: Path
    quick: bool = False
    backend: str = "cuda"
    repeats: int = 30
    warmup: int = 5
    host_calls: int = 1000
    host_repeats: int = 5
    build_repeats: int = 7


@dataclass
class Session:
    options: Options
    scratch: Path
    gpu: dict | None
    gpu_reason: str | None
    systems: list
    copy: dict | None = None
    copy_error: str | None = None

    @property
    def flame(self):
        return self.systems[0]

    @property
    def uses_gpu(self) -> bool:
        return self.gpu is not None and self.options.backend != "reference"

    @property
    def array_module(self):
        """Where the shared inputs live: CuPy on a GPU, NumPy for the reference backend."""
        if self.uses_gpu:
            import cupy

            return cupy
        return numpy


def progress(message: str):
    """Progress goes to stderr, so that stdout carries the Markdown report alone."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def open_session(options: Options, scratch: Path) -> Session:
    gpu, gpu_reason = environment.probe_gpu()
    systems = discover_systems(options.backend, gpu, gpu_reason)
    session = Session(options, scratch, gpu, gpu_reason, systems)
    progress("copy bandwidth")
    try:
        session.copy = timing.copy_bandwidth(session.uses_gpu, options.quick, options.repeats)
    except Exception as error:
        session.copy_error = f"{type(error).__name__}: {error}"
    return session


def make_inputs(xp, shapes, seed: int = INPUT_SEED) -> list:
    """Standard-normal float32 arrays, a different seed for each input; never zeros."""
    if xp is numpy:
        return [
            numpy.random.default_rng(seed + index).standard_normal(shape, dtype=numpy.float32)
            for index, shape in enumerate(shapes)
        ]
    return [
        xp.random.RandomState(seed + index).standard_normal(shape, dtype=xp.float32)
        for index, shape in enumerate(shapes)
    ]


def as_check_array(value, xp):
    """Any system's output as an array of ``xp`` (CuPy reads FLAME and torch tensors zero-copy)."""
    if xp is numpy:
        if type(value).__module__.startswith("torch"):
            return value.detach().cpu().numpy()
        if hasattr(value, "numpy"):
            return value.numpy()
        return numpy.asarray(value)
    return xp.asarray(value)


def relative_l2_error(result, reference, xp) -> float:
    if tuple(result.shape) != tuple(reference.shape):
        raise ValueError(f"result shape {tuple(result.shape)} != reference {reference.shape}")
    wide_reference = reference.astype(xp.float64).ravel()
    difference = result.astype(xp.float64).ravel() - wide_reference
    return float(xp.linalg.norm(difference) / xp.linalg.norm(wide_reference))


class Reference:
    """The answer every system is checked against.

    PyTorch eager's own first output where it runs (it goes first), otherwise the expression in
    NumPy float64, computed only when first needed.
    """

    def __init__(self, workload, inputs, xp):
        self.workload = workload
        self.inputs = inputs
        self.xp = xp
        self.array = None
        self.name = None

    def check(self, system, output) -> dict:
        if self.array is None and system.key == "torch_eager":
            self.array, self.name = as_check_array(output, self.xp), "torch eager"
            return {"is_reference": True}
        if self.array is None:
            self.array, self.name = self._numpy_float64(), "numpy float64"
        result = as_check_array(output, self.xp)
        error = relative_l2_error(result, self.array, self.xp)
        finite = bool(self.xp.isfinite(result).all())
        passed = finite and error < FLOAT32_TOLERANCE  # NaN compares false, so it fails too
        return {
            "reference": self.name,
            "rel_l2_error": error,
            "all_finite": finite,
            "tolerance": FLOAT32_TOLERANCE,
            "passed": passed,
        }

    def _numpy_float64(self):
        host = [as_check_array(array, numpy).astype(numpy.float64) for array in self.inputs]
        value = self.workload.expression(array_ops(numpy), *host)
        return self.xp.asarray(value)


def guarded(action, *arguments) -> dict:
    try:
        return {"status": "ok", **action(*arguments)}
    except Exception as error:
        return {
            "status": "error",
            "error": f"{type(error).__name__}: {error}",
            "traceback": traceback.format_exc(limit=-8),
        }


def release_memory(session: Session):
    gc.collect()
    if session.array_module is not numpy:
        session.array_module.get_default_memory_pool().free_all_blocks()
    if any(system.key == "torch_eager" and system.available for system in session.systems):
        import torch

        torch.cuda.empty_cache()


def measure_device(session, workload, system, inputs, reference) -> dict:
    options = session.options
    with system.scope():
        adopted = system.adopt(inputs)
        function = system.compile(workload.expression)

        def call():
            return function(*adopted)

        first_ms, output = timing.first_call_ms(system, call)
        check = reference.check(system, output)
        del output
        timing.warm_up(system, call, options.warmup)
        latency = timing.latency_ms(system, call, options.repeats)
        steady = timing.steady_ms(system, call, options.repeats)
        setup, timed = system.split(workload.expression, function, adopted)
        spin = timing.spin_seconds(latency)
        device = timing.device_ms(system, setup, timed, options.repeats, spin)
    return {
        "first_call_ms": first_ms,
        "check": check,
        "steady": steady,
        "latency": latency,
        "device": device,
        "spin_ms": spin * 1e3,
    }


def measure_host(session, workload, system, inputs, reference) -> dict:
    options = session.options
    with system.scope():
        adopted = system.adopt(inputs)
        function = system.compile(workload.expression)

        def call():
            return function(*adopted)

        first_ms, output = timing.first_call_ms(system, call)
        check = reference.check(system, output)
        del output
        timing.warm_up(system, call, options.warmup)
        host = timing.host_us(system, call, options.host_calls, options.host_repeats)
    return {"first_call_ms": first_ms, "check": check, "host": host}


MEASURES = {DEVICE: measure_device, HOST: measure_host}


def peers_first(systems) -> list:
    """PyTorch eager runs first so that its output is the reference for everyone after it."""
    return sorted(systems, key=lambda system: system.key != "torch_eager")


def unavailable_entry(system) -> dict:
    # FLAME that cannot run is an error of this benchmark; a missing peer is only skipped.
    if system.key == "flame":
        return {"status": "error", "error": system.skip_reason}
    return {"status": "skipped", "reason": system.skip_reason}


def run_compared(session, workload) -> dict:
    measure = MEASURES[workload.kind]
    xp = session.array_module
    inputs = make_inputs(xp, workload.shapes(session.options.quick))
    reference = Reference(workload, inputs, xp)
    results = {}
    for system in peers_first(session.systems):
        if not system.available:
            results[system.key] = unavailable_entry(system)
            continue
        progress(f"{workload.name}: {system.label}")
        results[system.key] = guarded(measure, session, workload, system, inputs, reference)
        release_memory(session)
    return {system.key: results[system.key] for system in session.systems}


def run_flame_only(session, workload) -> dict:
    results = {}
    flame = session.flame
    if flame.available:
        progress(f"{workload.name}: flame")
        results["flame"] = guarded(workload.runner, session, workload)
    else:
        results["flame"] = unavailable_entry(flame)
    return results


def run_workload(session, workload) -> dict:
    quick = session.options.quick
    row = {
        "name": workload.name,
        "kind": workload.kind,
        "description": workload.description,
        "shapes": [list(shape) for shape in workload.shapes(quick)],
        "dtype": "float32",
    }
    if workload.kind == DEVICE:
        row["floor_bytes"] = workload.floor_bytes(quick)
    if workload.kind == FLAME_ONLY:
        row["results"] = run_flame_only(session, workload)
    else:
        row["results"] = run_compared(session, workload)
    return row
