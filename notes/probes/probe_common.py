"""What the host-time probes share: timing loops, compiled tiny20's prepared launch, and the
interleaved rounds with their summary. Imported by the probes beside it (run as scripts, their
folder is on ``sys.path``)."""

import statistics
import time

try:
    import torch  # noqa: F401 (its audit hooks, as in the bench)
except ImportError:
    pass
import cupy

import flame as fl
from bench import expressions
from bench.timing import python_probe_us
from flame.replay import bind_arrays


def event_us(call, repeats=30) -> float:
    """Device microseconds per call of ``call`` (CUDA events around ``repeats`` calls, after
    3 warm-up calls); calls whose host work outlasts the kernels measure the host instead."""
    for _ in range(3):
        call()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(repeats):
        call()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) * 1e3 / repeats


def best_us(function, calls=5000, runs=5, synchronize=None):
    """Microseconds per call of ``function``: best of ``runs`` runs of ``calls`` calls, each
    closed by a synchronize."""
    synchronize = synchronize or cupy.cuda.get_current_stream().synchronize
    for _ in range(200):
        function()
    synchronize()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            function()
        synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def tiny20_prepared():
    """Compiled tiny20 on [1024], called once: a namespace of its inputs, the compiled
    function, its program, the plan's one launch and the slots it runs over (results
    allocated)."""
    x = fl.randn(1024, seed=0).realize()
    y = fl.randn(1024, seed=1).realize()
    compiled = fl.compile(expressions.bind(expressions.tiny20, expressions.flame_ops(fl)))
    compiled(x, y)
    ((_, program),) = compiled._state._programs.items()
    plan = program.plan
    sources = tuple((kind == "arg", value) for kind, value in program.sources)
    slots = bind_arrays(sources, (x, y)) + [None] * (plan.slot_count - len(sources))
    launch = plan.launches[0]
    launch.allocate(slots)
    return dict(x=x, y=y, compiled=compiled, program=program, plan=plan, launch=launch,
                sources=sources, slots=slots)  # fmt: skip


def interleaved(pieces: dict, rounds: int, timer=best_us) -> dict:
    """Per name, the times of ``timer(pieces[name])`` over ``rounds`` rounds, the order rotated
    each round; a piece that is None is the pure-Python probe of the host's speed."""
    samples = {name: [] for name in pieces}
    for index in range(rounds):
        names = list(pieces)
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            piece = pieces[name]
            samples[name].append(python_probe_us() if piece is None else timer(piece))
    return samples


def print_medians(samples: dict) -> None:
    for name, values in samples.items():
        print(
            f"{name:28s} median {statistics.median(values):7.3f} us  "
            f"min {min(values):7.3f}  max {max(values):7.3f}"
        )
