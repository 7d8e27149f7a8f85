"""Child process for ``compile_time``: one workload's first FLAME call in a brand-new process.

Prints one line of wall-clock stamps (``time.time()``, comparable with the parent's spawn stamp):
started, flame imported, CUDA context up, inputs on the device, first result, second result.
The parent sets FLAME_CACHE_DIR and CUPY_CACHE_DIR, which decide whether this is cold or warm.
"""

import time

STARTED = time.time()  # first thing: everything before it is interpreter start-up

import argparse  # noqa: E402 (imports after the stamp on purpose)
import contextlib  # noqa: E402
import json  # noqa: E402

RESULT_MARKER = "FLAME_BENCH_FIRSTCALL "


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.firstcall")
    parser.add_argument("--workload", required=True)
    parser.add_argument("--backend", default="cuda", choices=("cuda", "reference"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--spawned", type=float, required=True)
    return parser.parse_args(argv)


def create_cuda_context(backend: str, stamps: dict):
    """Stamps ``cupy_imported`` (FLAME may have imported it already) and ``context``."""
    if backend == "reference":
        return
    import cupy

    stamps["cupy_imported"] = time.time()
    cupy.cuda.runtime.free(0)  # cudaFree(0): the usual way to force the context into being
    stamps["context"] = time.time()


def main(argv=None):
    arguments = parse_arguments(argv)
    import flame

    stamps = {"spawned": arguments.spawned, "started": STARTED, "imported": time.time()}
    stamps["flame_version"] = getattr(flame, "__version__", "unknown")
    create_cuda_context(arguments.backend, stamps)

    import numpy

    from bench import expressions
    from bench.workloads import find_workload

    workload = find_workload(arguments.workload)
    shapes = workload.shapes(arguments.quick)
    generator = numpy.random.default_rng(0)
    arrays = [generator.standard_normal(shape, dtype=numpy.float32) for shape in shapes]
    scope = flame.backend("reference") if arguments.backend == "reference" else None
    with scope or contextlib.nullcontext():
        tensors = device_tensors(flame, arrays, arguments.backend)
        stamps["inputs"] = time.time()
        ops = expressions.flame_ops(flame)
        result = workload.expression(ops, *tensors).realize()
        flame.synchronize()
        stamps["first_result"] = time.time()
        stamps["kernel_cache"] = kernel_cache_counts()
        workload.expression(ops, *tensors).realize()
        flame.synchronize()
        stamps["second_result"] = time.time()
        stamps["rel_l2_error"] = error_against_numpy(workload, arrays, result.numpy())
    print(RESULT_MARKER + json.dumps(stamps), flush=True)


def device_tensors(flame, arrays, backend: str) -> list:
    """Inputs already in device memory, so that the first result's time is the call's alone
    (``flame.tensor`` would defer the upload to the first kernel that reads it)."""
    if backend == "reference":
        return [flame.tensor(array).realize() for array in arrays]
    import cupy

    tensors = [flame.from_dlpack(cupy.asarray(array)).realize() for array in arrays]
    flame.synchronize()
    return tensors


def kernel_cache_counts() -> dict | None:
    """FLAME's own counters, to tell a disk-cache hit from a compile; None if they moved."""
    try:
        from flame.runtime.compiler import default_kernel_cache

        stats = default_kernel_cache().stats
        return {
            "compiles": stats.compiles,
            "disk_hits": stats.disk_hits,
            "compile_ms": stats.compile_seconds * 1e3,
        }
    except Exception:  # an internal API: its absence must not cost the measurement
        return None


def error_against_numpy(workload, arrays, result) -> float:
    import numpy

    from bench import expressions

    wide = [array.astype(numpy.float64) for array in arrays]
    expected = workload.expression(expressions.array_ops(numpy), *wide)
    difference = numpy.linalg.norm(result.astype(numpy.float64) - expected)
    return float(difference / numpy.linalg.norm(expected))


if __name__ == "__main__":
    main()
