"""``python -m bench``: FLAME and its peers on every workload, in one run.

Writes OUT/bench.json and OUT/bench.md and prints the Markdown last. On the GPU machine:
``PYTHONPATH=. python3 -m bench --out $OUT``; without a GPU: ``--backend reference --quick``.
"""

import argparse
import sys
import time
from pathlib import Path

from bench import environment
from bench.workloads import WORKLOAD_NAMES, WORKLOADS


def at_least(minimum: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmark FLAME against PyTorch eager, torch.compile and cupy.fuse.",
        epilog="workloads: "
        + "; ".join(f"{workload.name}: {workload.description}" for workload in WORKLOADS),
    )
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="output folder")
    parser.add_argument(
        "--only",
        action="append",
        choices=WORKLOAD_NAMES,
        metavar="NAME",
        help="run only this workload (repeatable): " + ", ".join(WORKLOAD_NAMES),
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, for smoke runs")
    parser.add_argument(
        "--backend",
        choices=("cuda", "reference"),
        default="cuda",
        help="FLAME backend: cuda (default, the GPU) or reference (NumPy, no GPU; peers skipped)",
    )
    parser.add_argument("--repeats", type=at_least(20), default=30, help="timed runs (>= 20)")
    parser.add_argument("--warmup", type=at_least(1), default=5, help="warm-up calls")
    parser.add_argument(
        "--host-calls", type=at_least(1), default=None, help="calls per host-overhead run"
    )
    parser.add_argument(
        "--warm-caches",
        action="store_true",
        help="keep the caller's compile caches (default: empty caches, so first calls compile)",
    )
    return parser


def make_options(arguments, harness):
    host_calls = arguments.host_calls or (200 if arguments.quick else 1000)
    return harness.Options(
        out=arguments.out,
        quick=arguments.quick,
        backend=arguments.backend,
        repeats=arguments.repeats,
        warmup=arguments.warmup,
        host_calls=host_calls,
        host_repeats=3 if arguments.quick else 15,  # more runs: a steadier median on a shared host
    )


def main(argv=None) -> int:
    arguments = build_parser().parse_args(argv)
    selected = [w for w in WORKLOADS if not arguments.only or w.name in arguments.only]
    started_wall = time.strftime("%Y-%m-%d %H:%M:%S %z")
    started = time.perf_counter()
    with environment.scratch_directory(isolate_caches=not arguments.warm_caches) as scratch:
        environment.warm_python_bytecode(scratch, with_torch=arguments.backend == "cuda")
        # Imported only now: the cache variables must be set before torch, CuPy or FLAME load.
        from bench import harness, report

        options = make_options(arguments, harness)
        session = harness.open_session(options, scratch)
        by_name = {
            workload.name: harness.run_workload(session, workload)
            for workload in harness.host_bound_first(selected)
        }
        rows = [by_name[workload.name] for workload in selected]  # reported in the usual order
        versions = environment.library_versions()
        seconds = time.perf_counter() - started
        data = report.build_report(session, rows, versions, started_wall, seconds)
        json_path, markdown_path = report.write(data, options.out)
    harness.progress(f"wrote {json_path} and {markdown_path}")
    print(markdown_path.read_text(), end="")
    # Non-zero when any FLAME row is wrong or broke, so scripts and CI notice; a row skipped
    # on purpose (an op FLAME does not have yet) is neither.
    return 0 if all(row["status"] in ("ok", "skipped") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
