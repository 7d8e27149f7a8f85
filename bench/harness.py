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

from bench import environment, memory, timing
from bench.checks import Reference
from bench.systems import discover_systems
from bench.workloads import DEVICE, FLAME_ONLY, FLOAT32_TOLERANCE, HOST

__all__ = ["FLOAT32_TOLERANCE", "Options", "Session", "make_inputs", "run_workload"]
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


def make_inputs(xp, specs, seed: int = INPUT_SEED) -> list:
    """One array per input spec, a different seed for each: standard-normal floats (never
    zeros), or integers in ``[0, high)``. bfloat16 inputs are made as float32 (CuPy has no
    bfloat16); each system casts them when it adopts them."""
    return [make_array(xp, spec, seed + index) for index, spec in enumerate(specs)]


def make_array(xp, spec, seed: int):
    if spec.high is not None:
        dtype = getattr(xp, spec.dtype)
        if xp is numpy:
            return numpy.random.default_rng(seed).integers(0, spec.high, spec.shape, dtype=dtype)
        return xp.random.RandomState(seed).randint(0, spec.high, spec.shape, dtype=dtype)
    if xp is numpy:
        return numpy.random.default_rng(seed).standard_normal(spec.shape, dtype=numpy.float32)
    return xp.random.RandomState(seed).standard_normal(spec.shape, dtype=xp.float32)


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
    for system in session.systems:  # the system's own torch module: none where a test stubs it
        torch = getattr(system, "torch", None) if system.key == "torch_eager" else None
        if torch is not None and system.available:
            torch.cuda.empty_cache()


def first_call_and_check(system, workload, adopted, reference):
    """(call, function, entry): the call of the adopted inputs, the compiled function, and an
    entry with the first call's time, its correctness check and the settings it ran under."""
    function = system.compile(workload.expression)

    def call():
        return function(*adopted)

    first_ms, output = timing.first_call_ms(system, call)
    entry = {"first_call_ms": first_ms, "check": reference.check(system, output)}
    settings = system.settings(workload)
    if settings:
        entry["settings"] = settings
    return call, function, entry


def measure_device(session, workload, system, inputs, reference) -> dict:
    options = session.options
    with system.scope(workload):
        adopted = system.adopt(inputs, reference.specs)
        call, function, entry = first_call_and_check(system, workload, adopted, reference)
        timing.warm_up(system, call, options.warmup)
        latency = timing.latency_ms(system, call, options.repeats)
        steady = timing.steady_ms(system, call, options.repeats)
        setup, timed = system.split(workload.expression, function, adopted)
        spin = timing.spin_seconds(latency)
        device = timing.device_ms(system, setup, timed, options.repeats, spin)
        if workload.peak_memory:
            entry["peak_memory"] = memory.measure(system, call)
    return {**entry, "steady": steady, "latency": latency, "device": device, "spin_ms": spin * 1e3}


def prepare_host(session, workload, system, inputs, reference) -> dict:
    """A host row's system made ready to time: inputs adopted, first call checked, warmed up.
    The call is kept under ``"call"`` for the interleaved rounds (``run_host_compared``)."""
    with system.scope(workload):
        adopted = system.adopt(inputs, reference.specs)
        call, _, entry = first_call_and_check(system, workload, adopted, reference)
        timing.warm_up(system, call, session.options.warmup)
    return {**entry, "call": call}


def peers_first(systems) -> list:
    """PyTorch eager runs first so that its output is the reference for everyone after it;
    torch.compile runs last (see ``host_bound_first``)."""
    return sorted(
        systems, key=lambda system: (system.key != "torch_eager", system.key == "torch_compile")
    )


def host_bound_first(workloads) -> list:
    """The workloads whose cost is host time run before the others, and within each
    torch.compile runs last: once torch.compile has compiled something, its background
    threads (Inductor's subprocess pool, a progress monitor) take the GIL from time to time,
    and every system's host time in this process goes up with them (measured on the H100
    host: FLAME's lazy tiny20 41 us in a clean process, 63-101 us after a torch.compile call).
    Device-time rows hide the host and are unaffected."""
    host_bound = [w for w in workloads if w.kind != DEVICE]
    return host_bound + [w for w in workloads if w.kind == DEVICE]


def unavailable_entry(system) -> dict:
    # FLAME that cannot run is an error of this benchmark; a missing peer is only skipped.
    if system.key == "flame":
        return {"status": "error", "error": system.skip_reason}
    return {"status": "skipped", "reason": system.skip_reason}


def row_skip_reason(session, workload) -> str | None:
    """Why no system runs this workload: FLAME lacks what it needs (an op still being added)."""
    module = getattr(session.flame, "module", None)
    if workload.requires and module is not None and not hasattr(module, workload.requires):
        return f"flame.{workload.requires} not available"
    return None


def skip_reason(session, workload, system) -> str | None:
    return row_skip_reason(session, workload) or workload.skip.get(system.key)


def run_host_rounds(session, workload, prepared: list) -> dict | None:
    """Times the prepared systems of a host row (``prepared``: (system, entry) pairs) in
    interleaved rounds: each round runs every system's ``host_calls`` calls once, in an order
    rotated each round, so that a change in the shared host's speed (1.5-3x within seconds on
    the H100 host; notes/performance.md) falls on every system alike and the ratios compare
    like with like. A pure-Python probe runs in the same rounds: its time says how fast the
    host was. Each timed entry gets its ``host`` statistics; the probe's are returned."""
    options = session.options
    timed = [
        (system, entry, entry.pop("call"))
        for system, entry in prepared
        if entry.get("status") == "ok" and "call" in entry
    ]
    if not timed:
        return None
    quiet = None
    if session.uses_gpu and not options.quick:  # smoke runs share their CPUs with tests
        quiet = timing.wait_for_quiet_host()
        progress(f"{workload.name}: waited {quiet['waited_s']:.1f} s for a quiet host")
    samples = {system.key: [] for system, _, _ in timed}
    probe = []
    for round_index in range(options.host_repeats):
        shift = round_index % len(timed)
        for system, _, call in timed[shift:] + timed[:shift]:
            with system.scope(workload):
                samples[system.key].append(timing.host_round_us(system, call, options.host_calls))
        probe.append(timing.python_probe_us())
    for system, entry, _ in timed:
        entry["host"] = {
            **timing.summarize(samples[system.key], unit="us"),
            "calls_per_run": options.host_calls,
            "interleaved": True,
        }
    return {
        **timing.summarize(probe, unit="us"),
        "before_rounds": quiet,
        "audit_hook_ns_per_event": timing.audit_cost_ns(),
    }


def row_inputs(session, workload):
    """(inputs, reference) of a compared row; no inputs when the whole row is skipped."""
    xp = session.array_module
    specs = workload.input_specs(session.options.quick)
    inputs = make_inputs(xp, specs) if row_skip_reason(session, workload) is None else []
    return inputs, Reference(workload, inputs, specs, xp)


def each_system(session, workload, action, label: str = ""):
    """(system, entry) for every system, PyTorch eager first and torch.compile last: a skipped
    or unavailable system's entry says why; the others run ``action(system)``, guarded."""
    for system in peers_first(session.systems):
        reason = skip_reason(session, workload, system)
        if reason is not None:
            yield system, {"status": "skipped", "reason": reason}
        elif not system.available:
            yield system, unavailable_entry(system)
        else:
            progress(f"{workload.name}: {system.label}{label}")
            yield system, guarded(action, system)


def run_compared(session, workload) -> dict:
    if workload.kind == HOST:
        return run_host_compared(session, workload)
    row = row_inputs(session, workload)  # cleared at the end: the inputs' memory goes back

    def measure(system):
        entry = measure_device(session, workload, system, *row)
        release_memory(session)
        return entry

    results = {system.key: entry for system, entry in each_system(session, workload, measure)}
    row = ()
    release_memory(session)
    return {system.key: results[system.key] for system in session.systems}


def run_host_compared(session, workload) -> dict:
    """A host row: every system prepared first (torch.compile last, as in device rows), then
    all of them timed in the same interleaved rounds."""
    row = row_inputs(session, workload)

    def prepare(system):
        return prepare_host(session, workload, system, *row)

    prepared = list(each_system(session, workload, prepare, " (prepare)"))
    progress(f"{workload.name}: interleaved rounds")
    probe = run_host_rounds(session, workload, prepared)
    results = {system.key: entry for system, entry in prepared}
    if probe is not None:
        results["flame"]["python_probe"] = probe
    row = prepared = ()  # the inputs go before the memory is released
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


def output_names_and_shapes(workload, quick: bool) -> dict:
    """Workloads with several outputs list them all (``output_shape`` is the first's)."""
    if not workload.output_names:
        return {}
    pairs = zip(workload.output_names, workload.output_shapes(quick), strict=True)
    return {"output_shapes": {name: list(shape) for name, shape in pairs}}


def run_workload(session, workload) -> dict:
    quick = session.options.quick
    row = {
        "name": workload.name,
        "kind": workload.kind,
        "description": workload.description,
        "shapes": [list(shape) for shape in workload.shapes(quick)],
        "dtypes": [spec.dtype for spec in workload.input_specs(quick)],
        "output_shape": list(workload.output_shape(quick)),
        **output_names_and_shapes(workload, quick),
        "output_dtype": workload.output_dtype,
    }
    if workload.kind == DEVICE:
        row["floor_bytes"] = workload.floor_bytes(quick)
        if workload.flops is not None:
            row["flops"] = workload.floor_flops(quick)
    if workload.kind == FLAME_ONLY:
        row["results"] = run_flame_only(session, workload)
    else:
        row["results"] = run_compared(session, workload)
    return row
