"""Where the host time of a compiled replay goes (tiny20 on [1024]).

    python -m bench.replay_profile

Prints µs per call of: the compiled function; its parts measured alone (CuPy's allocation,
a raw launch of the same kernel with prepared arguments); and cProfile's top entries.
"""

from __future__ import annotations

import cProfile
import pstats
import time

from bench import expressions


def per_call_us(function, calls: int = 2000) -> float:
    import cupy

    for _ in range(50):
        function()
    cupy.cuda.get_current_stream().synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        function()
    cupy.cuda.get_current_stream().synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    import cupy

    import flame as fl

    x = fl.randn(1024, seed=0).realize()
    y = fl.randn(1024, seed=1).realize()
    ops = expressions.flame_ops(fl)
    compiled = fl.compile(expressions.bind(expressions.tiny20, ops))
    compiled(x, y)
    program = next(iter(compiled._state._programs.values()))
    launch = program.plan.launches[0]
    out = cupy.empty(1024, dtype=cupy.float32)
    slots = [None] * program.plan.slot_count
    for index, (_, value) in enumerate(program.sources):
        node = (x if value == 0 else y).node
        slots[index] = (node.buffer or node.attr("storage")).device_array()
    arguments = [slots[v] if k != "scalar" else v for k, v in launch.args]
    arguments[0] = out
    grid, block = (launch.grid,), (launch.block,)
    rows = {
        "compiled call": per_call_us(lambda: compiled(x, y)),
        "cupy.empty(1024)": per_call_us(lambda: cupy.empty(1024, dtype=cupy.float32)),
        "raw launch, prepared arguments": per_call_us(
            lambda: launch.function(grid, block, arguments)
        ),
        "Launch.execute": per_call_us(lambda: launch.execute(list(slots))),
    }
    for name, value in rows.items():
        print(f"{name:34s} {value:7.2f} us")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(2000):
        compiled(x, y)
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
