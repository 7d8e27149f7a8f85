"""Where a new process's first result from a warm disk cache spends its time, on the GPU host.

    python3 notes/probes/warm_first.py [CLEAN_RUNS] [IMPORT_RUNS] [PROFILED_RUNS]

As ``bench --only compile_time`` does: a throwaway process writes Python's bytecode, a cold
process fills fresh kernel caches, then new processes start warm. Each warm child times ew_chain's
first realize (inputs already on the device, as in bench/firstcall.py) and reports the modules
that realize imported. Clean runs print the times only; import runs add ``-X importtime`` (self
time of each module imported inside the first realize); profiled runs add cProfile's top
entries as well.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MARKER = "WARM_FIRST "
ROOT = Path(__file__).resolve().parents[2]


def child(mode: str) -> None:
    started = time.perf_counter()
    import cupy

    import flame
    from bench import expressions
    from bench.firstcall import device_tensors
    from bench.workloads import find_workload

    cupy.cuda.runtime.free(0)
    import numpy

    workload = find_workload("ew_chain")
    generator = numpy.random.default_rng(0)
    arrays = [generator.standard_normal(s, dtype=numpy.float32) for s in workload.shapes(False)]
    tensors = device_tensors(flame, arrays, "cuda")
    ops = expressions.flame_ops(flame)
    before = set(sys.modules)
    profile = None
    if mode == "profiled":
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    start = time.perf_counter()
    built = workload.expression(ops, *tensors)
    after_build = time.perf_counter()
    built.realize()
    after_realize = time.perf_counter()
    flame.synchronize()
    end = time.perf_counter()
    if profile is not None:
        profile.disable()
    second_start = time.perf_counter()
    workload.expression(ops, *tensors).realize()
    flame.synchronize()
    second = time.perf_counter() - second_start
    report = {
        "setup_ms": (start - started) * 1e3,
        "build_ms": (after_build - start) * 1e3,
        "realize_ms": (after_realize - after_build) * 1e3,
        "sync_ms": (end - after_realize) * 1e3,
        "first_ms": (end - start) * 1e3,
        "second_ms": second * 1e3,
        "new_modules": sorted(set(sys.modules) - before),
    }
    if profile is not None:
        import io
        import pstats

        for key in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats(key).print_stats(30)
            report[f"top_{key}"] = text.getvalue()
    print(MARKER + json.dumps(report), flush=True)


def run_child(environment: dict, mode: str) -> dict:
    command = [sys.executable]
    if mode != "clean":
        command += ["-X", "importtime"]
    command += [__file__, "--child", mode]
    done = subprocess.run(command, env=environment, cwd=ROOT, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith(MARKER):
            report = json.loads(line[len(MARKER) :])
            report["importtime"] = done.stderr
            return report
    raise RuntimeError(done.stderr[-3000:])


def import_self_times(stderr: str, modules: set) -> list:
    """(self us, cumulative us, module) for each module of ``modules`` in -X importtime's log."""
    rows = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        own, total, name = (part.strip() for part in line[len("import time:") :].split("|"))
        if name.strip() in modules:
            rows.append((int(own), int(total), name))
    return rows


def main() -> None:
    counts = [int(argument) for argument in sys.argv[1:4]] + [3, 1, 1][len(sys.argv[1:4]) :]
    modes = ["clean"] * counts[0] + ["imports"] * counts[1] + ["profiled"] * counts[2]
    scratch = Path(tempfile.mkdtemp(prefix="warm-first-"))
    environment = dict(os.environ)
    environment.pop("PYTHONDONTWRITEBYTECODE", None)
    environment["PYTHONPYCACHEPREFIX"] = str(scratch / "pycache")
    environment["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    )

    def caches(name: str) -> dict:
        return dict(environment, FLAME_CACHE_DIR=str(scratch / name / "flame"),
                    CUPY_CACHE_DIR=str(scratch / name / "cupy"))  # fmt: skip

    run_child(caches("throwaway"), "clean")
    cold = run_child(caches("kept"), "clean")
    print(f"{ROOT}: cold first {cold['first_ms']:.1f} ms")
    for mode in modes:
        report = run_child(caches("kept"), mode)
        print(
            f"warm {mode}: first {report['first_ms']:.1f} ms "
            f"(build {report['build_ms']:.2f}, realize {report['realize_ms']:.2f}, "
            f"sync {report['sync_ms']:.2f}); second {report['second_ms']:.2f} ms; "
            f"{len(report['new_modules'])} modules imported"
        )
        if mode == "clean":
            continue
        print("modules imported by the first realize:", " ".join(report["new_modules"]))
        rows = import_self_times(report["importtime"], set(report["new_modules"]))
        print(f"their import self time: {sum(r[0] for r in rows) / 1e3:.2f} ms; top:")
        for own, total, name in sorted(rows, reverse=True)[:20]:
            print(f"  self {own / 1e3:7.2f} ms  cumulative {total / 1e3:7.2f} ms  {name}")
        if mode != "profiled":
            continue
        print(report["top_tottime"])
        print(report["top_cumulative"])


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        main()
