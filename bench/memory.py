"""Peak memory of one call (forward + backward), above what was allocated before it.

Measured after the warm-up, once, on the same inputs as the timings; the inputs are allocated
before the call, so they are not counted, and the outputs the call returns are (they are part
of what a training step needs). MB = 10^6 bytes.

- FLAME on the GPU allocates from CuPy's default memory pool. CuPy's pool has no peak counter,
  so a CuPy ``MemoryHook`` follows every ``malloc`` and ``free`` of the pool during the call
  (sizes as the pool rounds them) and keeps the largest total in use: that is the figure.
  ``pool_growth_mb`` (growth of ``total_bytes()`` over the call, after ``free_all_blocks()``) is
  kept in bench.json as a cross-check only: a cached block split with a live allocation cannot
  be released, and a call that reuses it grows the pool less (layer norm fwd+bwd on an H200,
  2026-11-21: 0 MB of growth for a 537 MB peak).
- PyTorch (eager and torch.compile): ``torch.cuda.reset_peak_memory_stats()``, then
  ``max_memory_allocated() - memory_allocated()`` before the call (the inputs are CuPy arrays
  that PyTorch reads through DLPack, so they are not in its allocator at all).
- FLAME's reference backend (no GPU): ``tracemalloc``'s peak over the call (NumPy reports its
  buffers to it; Python objects count too), so that the path runs in the smoke test.
"""

import gc
import tracemalloc

MB = 1e6


def measure(system, call) -> dict:
    """``{"peak_mb", "outputs_mb", "method", ...}`` for one call, or ``{"error"}``."""
    try:
        gc.collect()
        system.synchronize()
        if system.key == "flame" and getattr(system, "backend", None) == "reference":
            return _tracemalloc_peak(call)
        if system.key == "flame":
            return _cupy_pool_peak(system, call)
        return _torch_peak(system, call)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}


def _cupy_pool_peak(system, call) -> dict:
    import cupy
    from cupy.cuda.memory_hook import MemoryHook

    pool = cupy.get_default_memory_pool()

    class PeakHook(MemoryHook):
        name = "flame_bench_peak"

        def __init__(self, in_use: int):
            self.in_use = self.peak = in_use

        def malloc_postprocess(self, **kwargs):
            self.in_use += kwargs["mem_size"]
            self.peak = max(self.peak, self.in_use)

        def free_postprocess(self, **kwargs):
            self.in_use -= kwargs["mem_size"]

    pool.free_all_blocks()
    used_before, total_before = pool.used_bytes(), pool.total_bytes()
    hook = PeakHook(used_before)
    with hook:
        outputs = call()
        system.synchronize()
    try:  # a step captured as a CUDA graph keeps its intermediates in a pool of its own
        from flame.runtime.step_graphs import graph_pool_bytes

        graphs = graph_pool_bytes()
    except ImportError:
        graphs = 0
    result = {
        "peak_mb": (hook.peak - used_before + graphs) / MB,
        "outputs_mb": (pool.used_bytes() - used_before) / MB,
        "pool_growth_mb": (pool.total_bytes() - total_before) / MB,
        "graph_pool_mb": graphs / MB,
        "method": "CuPy MemoryHook on the default pool: largest bytes in use during the call, "
        "plus what captured steps' own pools hold (flame.runtime.step_graphs.graph_pool_bytes)",
    }
    del outputs
    return result


def _torch_peak(system, call) -> dict:
    cuda = system.torch.cuda
    cuda.reset_peak_memory_stats()
    before = cuda.memory_allocated()
    outputs = call()
    system.synchronize()
    result = {
        "peak_mb": (cuda.max_memory_allocated() - before) / MB,
        "outputs_mb": (cuda.memory_allocated() - before) / MB,
        "method": "torch.cuda.max_memory_allocated() after reset_peak_memory_stats()",
    }
    del outputs
    return result


def _tracemalloc_peak(call) -> dict:
    started = tracemalloc.is_tracing()
    if not started:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        outputs = call()
        current, peak = tracemalloc.get_traced_memory()
    finally:
        if not started:
            tracemalloc.stop()
    del outputs
    return {
        "peak_mb": (peak - before) / MB,
        "outputs_mb": (current - before) / MB,
        "method": "tracemalloc on the host (reference backend; NumPy buffers and Python objects)",
    }
