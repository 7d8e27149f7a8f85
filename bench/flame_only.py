"""Workloads that measure FLAME's own costs: building lazy graphs and compiling new kernels.

The harness is imported inside the runners: ``workloads`` imports this module to declare the
runners, and the harness imports ``workloads``.
"""

import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import environment, expressions
from bench.firstcall import RESULT_MARKER

GRAPH_OPS = 1000
CHILD_TIMEOUT_SECONDS = 600


def graph_build(session, workload) -> dict:
    """Microseconds per op to build a 1000-op lazy graph from realized inputs, never realized."""
    from bench.harness import make_inputs
    from bench.timing import summarize

    flame = session.flame
    chains = GRAPH_OPS // expressions.TINY20_OPS
    repeats = 3 if session.options.quick else session.options.build_repeats
    samples = []
    with flame.scope(workload):
        arrays = make_inputs(session.array_module, workload.input_specs(session.options.quick))
        first, second = flame.adopt(arrays)
        ops = expressions.flame_ops(flame.module)
        for _ in range(repeats):
            gc.collect()  # collect the last graph now, not inside the timed build
            start = time.perf_counter()
            value = first
            for _ in range(chains):
                value = workload.expression(ops, value, second)
            samples.append((time.perf_counter() - start) / GRAPH_OPS * 1e6)
            del value
    return {"ops": GRAPH_OPS, "build": summarize(samples, unit="us_per_op")}


def compile_time(session, workload) -> dict:
    """The first call in a new process: with empty caches (cold), then with those caches (warm).

    A throwaway first process, with caches of its own, leaves Python's bytecode behind: "cold"
    means FLAME's kernels, not the interpreter compiling FLAME's modules, which an installed
    FLAME never does twice.
    """
    bytecode = session.scratch / "pycache"
    throwaway = run_first_call_process(session, workload, new_cache_root(session), bytecode)
    cache_root = new_cache_root(session)
    cold = run_first_call_process(session, workload, cache_root, bytecode)
    cache_files = sum(len(files) for _, _, files in os.walk(cache_root))
    warm = run_first_call_process(session, workload, cache_root, bytecode)
    return {
        "cold": cold,
        "warm": warm,
        "bytecode_warm_up": throwaway,
        "cache_files_after_cold": cache_files,
        "elements": math.prod(workload.shapes(session.options.quick)[0]),
    }


def new_cache_root(session) -> Path:
    return Path(tempfile.mkdtemp(prefix="compile-", dir=session.scratch))


def child_environment(cache_root: Path, bytecode: Path) -> dict:
    variables = dict(os.environ)
    # Both kernel caches matter: FLAME's own, and CuPy's, which would otherwise hand back a cubin.
    variables["FLAME_CACHE_DIR"] = str(cache_root / "flame")
    variables["CUPY_CACHE_DIR"] = str(cache_root / "cupy")
    # A writable bytecode cache shared by the three processes (the tree may be read-only).
    variables["PYTHONPYCACHEPREFIX"] = str(bytecode)
    variables.pop("PYTHONDONTWRITEBYTECODE", None)
    root = str(environment.REPOSITORY_ROOT)
    variables["PYTHONPATH"] = os.pathsep.join(filter(None, [root, variables.get("PYTHONPATH")]))
    return variables


def run_first_call_process(session, workload, cache_root: Path, bytecode: Path) -> dict:
    root = str(environment.REPOSITORY_ROOT)
    command = [sys.executable, "-m", "bench.firstcall", "--workload", workload.name]
    command += ["--backend", session.options.backend]
    if session.options.quick:
        command.append("--quick")
    spawned = time.time()
    completed = subprocess.run(
        command + ["--spawned", repr(spawned)],
        env=child_environment(cache_root, bytecode),
        cwd=root,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_SECONDS,
    )
    for line in completed.stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            return phases(json.loads(line[len(RESULT_MARKER) :]))
    tail = (completed.stderr or completed.stdout)[-2000:]
    raise RuntimeError(f"first-call process exited {completed.returncode}: {tail}")


def phases(stamps: dict) -> dict:
    """Milliseconds of each phase from the wall-clock stamps the child printed."""

    def between(earlier, later):
        if stamps.get(earlier) is None or stamps.get(later) is None:
            return None
        return (stamps[later] - stamps[earlier]) * 1e3

    context_end = "context" if stamps.get("context") is not None else "imported"
    return {
        "python_start_ms": between("spawned", "started"),
        "import_flame_ms": between("started", "imported"),
        "import_cupy_ms": between("imported", "cupy_imported"),
        "cuda_context_ms": between("cupy_imported", "context"),
        "inputs_ms": between(context_end, "inputs"),
        "first_result_ms": between("inputs", "first_result"),
        "second_call_ms": between("first_result", "second_result"),
        "process_start_to_import_ms": between("spawned", "imported"),
        "process_start_to_first_result_ms": between("spawned", "first_result"),
        "kernel_cache": stamps.get("kernel_cache"),
        "rel_l2_error_vs_numpy": stamps.get("rel_l2_error"),
        "flame_version": stamps.get("flame_version"),
    }
