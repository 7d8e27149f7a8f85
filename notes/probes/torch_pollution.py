"""Does a torch.compile call in the same process slow FLAME's and cupy.fuse's host time?

    python3 notes/probes/torch_pollution.py

Times lazy tiny20, compiled tiny20 and cupy.fuse's tiny20 (best of 5 x 2000 calls, with the
pure-Python probe) with torch imported, then compiles and calls tiny20 with torch.compile
and times them all again, in 3 rounds each side, interleaved with the probe.
"""

import cupy
import torch
from probe_common import best_us

import flame as fl
from bench import expressions
from bench.timing import python_probe_us, wait_for_quiet_host


def rounds(label, calls):
    for index in range(3):
        row = {name: round(best_us(call, calls=2000), 2) for name, call in calls.items()}
        row["probe"] = round(python_probe_us(), 2)
        print(label, index, row, flush=True)


def main():
    x = fl.randn(1024, seed=0).realize()
    y = fl.randn(1024, seed=1).realize()
    ops = expressions.flame_ops(fl)
    compiled = fl.compile(expressions.bind(expressions.tiny20, ops))
    cx, cy = cupy.asarray(x.numpy()), cupy.asarray(y.numpy())
    fused = cupy.fuse(expressions.bind(expressions.tiny20, expressions.array_ops(cupy)))
    calls = {
        "lazy": lambda: expressions.tiny20(ops, x, y).realize(),
        "compiled": lambda: compiled(x, y),
        "cupy.fuse": lambda: fused(cx, cy),
    }
    rounds("before torch.compile", calls)
    tx, ty = torch.from_dlpack(cx), torch.from_dlpack(cy)
    tc = torch.compile(expressions.bind(expressions.tiny20, expressions.torch_ops(torch)))
    tc(tx, ty)
    print("quiet wait", wait_for_quiet_host())
    calls["torch.compile"] = lambda: tc(tx, ty)
    rounds("after torch.compile", calls)


if __name__ == "__main__":
    main()
