"""The Python part of a compiled one-kernel call, measured without a GPU.

    python notes/probes/replay_python.py [ROUNDS]

CuPy's allocation, current stream and the driver's launch are replaced by stand-ins that cost
next to nothing; a hand-made plan of one launch (tiny20's parameters: out, x, y, n) is
prepared through ``fast_replay`` and registered with a ``CompiledFunction`` as ``_trace``
registers a traced one-kernel program's entry. What is left is every line of FLAME's per-call path:
the dispatch, the binding, the recycle test, the packing and the result's tensor. Times are
best of 5 x 20000 calls, median over interleaved rounds, beside the pure-Python probe of the
host's speed.
"""

import statistics
import sys
import time
import types

import numpy as np


class FakeArray:
    """What the runner reads of a CuPy array: ``data.ptr``."""

    itemsize, strides = 4, (4,)

    def __init__(self, shape=None, dtype=None):
        self.data = types.SimpleNamespace(ptr=id(self) * 16)


def stub_cupy():
    import cupy
    import cupy.cuda
    from cupy_backends.cuda.api import driver

    stream = types.SimpleNamespace(ptr=0)
    cupy.ndarray = FakeArray
    cupy.cuda.get_current_stream = lambda: stream
    driver.launchKernel = lambda *arguments: None


def prepared():
    stub_cupy()
    from flame.compile import CompiledFunction, _front
    from flame.ir import dtypes
    from flame.ir.node import user_site
    from flame.replay import direct_key, dispatcher, fast_replay, wrap
    from flame.runtime.executor import Plan
    from flame.runtime.launch import Launch
    from flame.runtime.storage import Storage

    f32 = dtypes.float32
    launch = Launch(
        spec=None, function=types.SimpleNamespace(ptr=1), grid=1, block=256,
        args=(("out", 2), ("in", 0), ("in", 1), ("scalar", np.int32(1024))),
        writes=((2, 0),), shapes=(((1024,), np.float32),),
    )  # fmt: skip
    plan = Plan(launches=(launch,), slot_count=3, output_slots=(2,), graph=None, plan_seconds=0)
    site = user_site()
    sources = (("arg", 0), ("arg", 1))
    outputs = (types.SimpleNamespace(dtype=f32, shape=(1024,), site=site),)

    def tiny(x, y):
        return x + y

    state = CompiledFunction(tiny)
    x, y = (wrap(Storage("cuda", f32, FakeArray()), f32, (1024,), site) for _ in range(2))
    key = direct_key((x, y))
    _, entry = fast_replay(plan, sources, outputs, (("out", 0),), "tensor", None, 2, key)
    assert entry is not None
    state._direct[key] = state._entry = entry
    state._dispatch = dispatcher(2)
    return _front(state), x, y


def best_us(function, calls=20000, runs=5):
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            function()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main():
    sys.path.insert(0, ".")
    from bench.timing import python_probe_us

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    compiled, x, y = prepared()
    result = compiled(x, y)
    assert result.shape == (1024,) and compiled.cache_info().hits == 1
    samples = {"compiled(x, y), driver stubbed": [], "empty lambda": [], "probe": []}
    for _ in range(rounds):
        samples["compiled(x, y), driver stubbed"].append(best_us(lambda: compiled(x, y)))
        samples["empty lambda"].append(best_us(lambda: None))
        samples["probe"].append(python_probe_us())
    for name, values in samples.items():
        print(f"{name:32s} median {statistics.median(values):6.3f} us  min {min(values):6.3f}")


if __name__ == "__main__":
    main()
