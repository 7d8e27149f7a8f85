"""Timing loops shared by every system and workload, and the copy bandwidth that sets floors.

All GPU numbers come from events after warm-up; each loop reports the median and the minimum.
- ``steady``: events around each call, issued back to back as a training loop would; per call,
  about max(host time, device time).
- ``latency``: synchronize before and after each call; host time plus device time.
- ``device``: the timed part queued behind a spin kernel; the device alone.
- ``host``: wall time over many calls, then one synchronize; the host's cost per call.
"""

import os
import statistics
import sys
import time

GIB = 1 << 30
MIN_SPIN_SECONDS = 0.001
MAX_SPIN_SECONDS = 0.5


def summarize(samples: list[float], unit: str = "ms") -> dict:
    return {
        f"median_{unit}": statistics.median(samples),
        f"min_{unit}": min(samples),
        "runs": len(samples),
    }


def first_call_ms(system, call):
    """Wall time of one call up to its result on the device; returns (ms, output)."""
    system.synchronize()
    start = time.perf_counter()
    output = call()
    system.synchronize()
    return (time.perf_counter() - start) * 1e3, output


def warm_up(system, call, count: int):
    for _ in range(count):
        call()
    system.synchronize()


def steady_ms(system, call, repeats: int) -> dict:
    clock = system.clock
    pairs = [(clock.event(), clock.event()) for _ in range(repeats)]
    system.synchronize()
    for start, end in pairs:
        start.record()
        call()
        end.record()
    system.synchronize()
    return summarize([clock.elapsed_ms(start, end) for start, end in pairs])


def latency_ms(system, call, repeats: int) -> dict:
    clock = system.clock
    samples = []
    for _ in range(repeats):
        start, end = clock.event(), clock.event()
        system.synchronize()
        start.record()
        call()
        end.record()
        system.synchronize()
        samples.append(clock.elapsed_ms(start, end))
    return summarize(samples)


def spin_seconds(latency: dict) -> float:
    """Long enough for the host to queue the timed work while the GPU still spins."""
    seconds = 2 * latency["median_ms"] * 1e-3 + MIN_SPIN_SECONDS
    return min(seconds, MAX_SPIN_SECONDS)


def device_ms(system, setup, timed, repeats: int, spin: float) -> dict:
    clock = system.clock
    pairs = [(clock.event(), clock.event()) for _ in range(repeats)]
    for start, end in pairs:
        token = setup()
        system.synchronize()
        clock.spin(spin)
        start.record()
        timed(token)
        end.record()
        del token  # the result returns to the stream-ordered pool; nothing reads it
    system.synchronize()
    return summarize([clock.elapsed_ms(start, end) for start, end in pairs])


def host_round_us(system, call, calls: int) -> float:
    """Microseconds per call: wall time over ``calls`` calls, then one synchronize."""
    system.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    system.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


PROBE_CALLS = 2000
QUIET_BUSY_CPUS = 0.5  # the machine's other work, in CPUs, under which host timing starts
QUIET_WINDOW_SECONDS = 1.0
QUIET_MAX_SECONDS = 90.0


def _busy_and_total_jiffies() -> tuple[int, int] | None:
    """All CPUs' busy and total time from /proc/stat (Linux), else None."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def wait_for_quiet_host(
    busy_cpus: float = QUIET_BUSY_CPUS,
    window: float = QUIET_WINDOW_SECONDS,
    limit: float = QUIET_MAX_SECONDS,
) -> dict:
    """Sleeps until the machine's CPUs are quiet: two windows in a row with less than
    ``busy_cpus`` CPUs busy (this process sleeps, so that is everyone else's work), or
    ``limit`` seconds. A system's first call can leave work behind: torch.compile's first
    compile starts a pool of compile worker processes, which kept the H100 host's CPUs busy
    for 6-12 s (notes/performance.md), and that would land on whichever system was timed
    then."""
    first = _busy_and_total_jiffies()
    if first is None:
        return {"waited_s": 0.0, "busy_cpus": None, "quiet": None}
    cpus = os.cpu_count() or 1
    start = time.perf_counter()
    quiet_windows, busy = 0, None
    previous = first
    while quiet_windows < 2 and time.perf_counter() - start < limit:
        time.sleep(window)
        current = _busy_and_total_jiffies()
        total = current[1] - previous[1]
        busy = cpus * (current[0] - previous[0]) / total if total else 0.0
        quiet_windows = quiet_windows + 1 if busy < busy_cpus else 0
        previous = current
    return {
        "waited_s": time.perf_counter() - start,
        "busy_cpus": busy,
        "quiet": quiet_windows >= 2,
    }


def _probe_work(values: tuple) -> tuple:
    # Small objects, attribute reads and calls: the kind of work a Python graph builder does.
    nodes = []
    for value in values:
        nodes.append((value, (value + 1, {"v": value}), [value]))
    return tuple(node[1][1]["v"] for node in nodes)


def audit_cost_ns(calls: int = PROBE_CALLS) -> float:
    """Nanoseconds the interpreter's audit hooks add to one audited event: ``sys._getframe``
    (an audited event) against ``sys.getrecursionlimit`` (a C call without one). Zero-ish
    without hooks; libraries add hooks at import (filelock, which PyTorch imports, adds two),
    and every ``sys._getframe`` or ``frame.f_code`` pays it (lazy mode reads ``f_code`` once
    per new frame and reaches frames through ``flame.ir.node.caller_frame``)."""
    getframe, plain = sys._getframe, sys.getrecursionlimit
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            getframe()
        middle = time.perf_counter()
        for _ in range(calls):
            plain()
        end = time.perf_counter()
        best = min(best, ((middle - start) - (end - middle)) / calls * 1e9)
    return max(0.0, best)


def python_probe_us(calls: int = PROBE_CALLS) -> float:
    """A fixed pure-Python workload's microseconds per call: the host's speed at that moment,
    so that host rows from different runs can be told apart by the host they ran on."""
    values = tuple(range(20))
    start = time.perf_counter()
    for _ in range(calls):
        _probe_work(values)
    return (time.perf_counter() - start) / calls * 1e6


def copy_bandwidth(on_gpu: bool, quick: bool, repeats: int) -> dict:
    """One large copy, read + write bytes counted; on the GPU through cudaMemcpyAsync."""
    if on_gpu:
        try:
            import cupy  # noqa: F401 (the CuPy path is the one FLAME itself uses)

            return _cupy_copy_bandwidth(GIB, repeats)
        except ImportError:
            return _torch_copy_bandwidth(GIB, repeats)
    # Reference backend: a host copy, so that floors and ratios stay defined there too.
    return _numpy_copy_bandwidth(GIB // 16 if quick else GIB // 4, repeats)


def _bandwidth_result(method: str, nbytes: int, stats: dict) -> dict:
    moved = 2 * nbytes
    return {
        "method": method,
        "buffer_bytes": nbytes,
        "bytes_moved": moved,
        **stats,
        "gb_per_s": moved / (stats["median_ms"] * 1e-3) / 1e9,
        "best_gb_per_s": moved / (stats["min_ms"] * 1e-3) / 1e9,
    }


def _time_copy(clock, synchronize, copy, repeats: int) -> dict:
    for _ in range(3):
        copy()
    synchronize()
    pairs = [(clock.event(), clock.event()) for _ in range(repeats)]
    for start, end in pairs:
        start.record()
        copy()
        end.record()
    synchronize()
    return summarize([clock.elapsed_ms(start, end) for start, end in pairs])


def _cupy_copy_bandwidth(nbytes: int, repeats: int) -> dict:
    import cupy

    from bench.clocks import CupyClock

    source = cupy.random.RandomState(7).standard_normal(nbytes // 4, dtype=cupy.float32)
    target = cupy.empty_like(source)
    runtime = cupy.cuda.runtime
    stream = cupy.cuda.get_current_stream()

    def copy():
        runtime.memcpyAsync(
            target.data.ptr, source.data.ptr, nbytes, runtime.memcpyDeviceToDevice, stream.ptr
        )

    clock = CupyClock()
    stats = _time_copy(clock, clock.synchronize, copy, repeats)
    if not bool((target == source).all()):
        raise RuntimeError("device copy for the bandwidth measurement produced wrong data")
    return _bandwidth_result("cudaMemcpyAsync device to device (CuPy)", nbytes, stats)


def _torch_copy_bandwidth(nbytes: int, repeats: int) -> dict:
    import torch

    from bench.clocks import TorchClock

    source = torch.randn(nbytes // 4, device="cuda")
    target = torch.empty_like(source)
    clock = TorchClock()
    stats = _time_copy(clock, clock.synchronize, lambda: target.copy_(source), repeats)
    return _bandwidth_result("torch Tensor.copy_ device to device", nbytes, stats)


def _numpy_copy_bandwidth(nbytes: int, repeats: int) -> dict:
    import numpy

    from bench.clocks import HostClock

    source = numpy.random.default_rng(7).standard_normal(nbytes // 4, dtype=numpy.float32)
    target = numpy.empty_like(source)
    clock = HostClock()
    stats = _time_copy(clock, clock.synchronize, lambda: numpy.copyto(target, source), repeats)
    return _bandwidth_result("numpy.copyto on the host (no GPU)", nbytes, stats)
