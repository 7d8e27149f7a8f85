"""Device time of FLAME's layout-changing elementwise kernels (flame/codegen/transpose.py)
on UNet activation shapes, against PyTorch's ``permute(...).contiguous()`` and a plain copy
of the same bytes (the floor), CUDA events over repeated calls.

    PYTHONPATH=. python3 notes/probes/transpose_bench.py [OUT.json]

Rows: NHWC -> NCHW and NCHW -> NHWC copies, and a transposing residual add (an NHWC operand
plus an NCHW one, written NCHW), bfloat16 and float32.
"""

import json
import sys

import numpy as np
import torch
from probe_common import event_us

import flame as fl

SHAPES = ((256, 32, 32, 128), (256, 16, 16, 256), (256, 8, 8, 512), (64, 32, 32, 384))


def measure(dtype, tdtype, shape) -> dict:
    n, h, w, c = shape
    nhwc = torch.randn(n, h, w, c, device="cuda").to(tdtype)
    nchw = torch.randn(n, c, h, w, device="cuda").to(tdtype)
    a, b = fl.from_dlpack(nhwc), fl.from_dlpack(nchw)
    to_first = fl.compile(lambda x: fl.permute(x, (0, 3, 1, 2)).clone())
    to_last = fl.compile(lambda x: fl.permute(x, (0, 2, 3, 1)).clone())
    add = fl.compile(lambda x, y: fl.permute(x, (0, 3, 1, 2)) + y)
    found = {
        "shape": list(shape), "dtype": dtype.name,
        "bytes": nhwc.numel() * nhwc.element_size() * 2,
        "flame_to_nchw_us": event_us(lambda: to_first(a)),
        "flame_to_nhwc_us": event_us(lambda: to_last(b)),
        "flame_add_us": event_us(lambda: add(a, b)),
        "torch_to_nchw_us": event_us(lambda: nhwc.permute(0, 3, 1, 2).contiguous()),
        "torch_add_us": event_us(lambda: nhwc.permute(0, 3, 1, 2) + nchw),
        "copy_us": event_us(lambda: nhwc.clone()),
    }  # fmt: skip
    expected = nhwc.permute(0, 3, 1, 2).contiguous()
    found["exact"] = bool(torch.equal(torch.from_dlpack(to_first(a)), expected))
    return found


def main() -> None:
    rows = []
    for dtype, tdtype in ((fl.bfloat16, torch.bfloat16), (fl.float32, torch.float32)):
        for shape in SHAPES:
            found = measure(dtype, tdtype, shape)
            rows.append(found)
            moved = found["bytes"]
            print(
                f"{dtype.name:8s} {str(list(shape)):20s} copy {found['copy_us']:7.1f} us | "
                f"flame nchw {found['flame_to_nchw_us']:7.1f} "
                f"nhwc {found['flame_to_nhwc_us']:7.1f} add {found['flame_add_us']:7.1f} | "
                f"torch nchw {found['torch_to_nchw_us']:7.1f} add {found['torch_add_us']:7.1f} | "
                f"copy {moved / found['copy_us'] / 1e6:.2f} TB/s, "
                f"flame {moved / found['flame_to_nchw_us'] / 1e6:.2f} TB/s "
                f"exact={found['exact']}",
                flush=True,
            )
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as file:
            json.dump(rows, file, indent=1)


if __name__ == "__main__":
    np.random.seed(0)
    main()
