"""Clocks: events to time a region, a way to wait for the device, and a spin to hide the host.

``spin(seconds)`` queues a kernel that busy-waits on the GPU. Work queued behind it starts only
when it ends, so events around that work measure the device alone, even where the host takes
longer to issue the work than the GPU takes to run it.
"""

import time

SPIN_SOURCE = r"""
extern "C" __global__ void flame_bench_spin(unsigned long long duration_ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < duration_ns);
}
"""


class HostEvent:
    def __init__(self):
        self.seconds = None

    def record(self):
        self.seconds = time.perf_counter()


class HostClock:
    """For work that runs synchronously on the CPU (FLAME's reference backend)."""

    name = "time.perf_counter"

    def __init__(self, synchronize=None):
        self._synchronize = synchronize

    def event(self):
        return HostEvent()

    def elapsed_ms(self, start, end) -> float:
        return (end.seconds - start.seconds) * 1e3

    def synchronize(self):
        if self._synchronize is not None:
            self._synchronize()

    def spin(self, seconds: float):
        """Nothing runs asynchronously, so there is no host work to hide."""


class CupyClock:
    """CUDA events on CuPy's current stream (FLAME launches there too)."""

    name = "cupy.cuda.Event"

    def __init__(self, synchronize=None):
        import cupy

        self._cupy = cupy
        self._synchronize = synchronize
        self._spin_kernel = None

    def event(self):
        return self._cupy.cuda.Event()

    def elapsed_ms(self, start, end) -> float:
        end.synchronize()
        return self._cupy.cuda.get_elapsed_time(start, end)

    def synchronize(self):
        if self._synchronize is not None:
            self._synchronize()
        self._cupy.cuda.get_current_stream().synchronize()

    def spin(self, seconds: float):
        if self._spin_kernel is None:
            module = self._cupy.RawModule(code=SPIN_SOURCE)
            self._spin_kernel = module.get_function("flame_bench_spin")
        duration = self._cupy.uint64(int(seconds * 1e9))
        self._spin_kernel((1,), (1,), (duration,))


class TorchClock:
    """CUDA events on PyTorch's current stream."""

    name = "torch.cuda.Event"

    def __init__(self):
        import torch

        self._torch = torch
        self._cycles_per_second = None

    def event(self):
        return self._torch.cuda.Event(enable_timing=True)

    def elapsed_ms(self, start, end) -> float:
        end.synchronize()
        return start.elapsed_time(end)

    def synchronize(self):
        self._torch.cuda.synchronize()

    def spin(self, seconds: float):
        # torch.cuda._sleep counts clock cycles, not seconds: measure the rate once.
        if self._cycles_per_second is None:
            self._cycles_per_second = self._measure_cycles_per_second()
        self._torch.cuda._sleep(int(seconds * self._cycles_per_second))

    def _measure_cycles_per_second(self) -> float:
        cycles = 20_000_000
        self._torch.cuda._sleep(cycles)  # the first launch loads the kernel
        start, end = self.event(), self.event()
        start.record()
        self._torch.cuda._sleep(cycles)
        end.record()
        return cycles / (self.elapsed_ms(start, end) * 1e-3)
