"""Device time of FLAME's column sums (a bias gradient: ``g.float().sum(0)`` over [rows,
columns], the reduced axis outermost) on DiT/UNet shapes, against PyTorch and the byte floor
(one read of the input at the copy bandwidth measured in the same run), CUDA events over
repeated calls.

    PYTHONPATH=. python3 notes/probes/column_sum_bench.py [OUT.json]

Run under notes/probes/switches.py to A/B the column kernel's constants
(``flame.codegen.reduce.THREAD_LANES``, ``flame.ir.passes.split.COLUMN_PART_ROWS``, ...).
"""

import json
import sys

import torch
from probe_common import event_us

import flame as fl

CASES = (  # rows, columns, dtype: DiT-S/2 b64 bias gradients, UNet conv bias gradients (NHWC)
    (16384, 384, torch.bfloat16), (16384, 1152, torch.bfloat16), (16384, 1536, torch.bfloat16),
    (65536, 128, torch.bfloat16), (16384, 256, torch.bfloat16), (16384, 384, torch.float32),
)  # fmt: skip


def measure(rows: int, columns: int, dtype) -> dict:
    g = torch.randn(rows, columns, device="cuda").to(dtype)
    x = fl.from_dlpack(g)
    column_sum = fl.compile(lambda v: v.float().sum(0))
    bytes_read = g.numel() * g.element_size()
    copy_us = event_us(lambda: g.clone(), 50)
    found = {
        "rows": rows, "columns": columns, "dtype": str(dtype).split(".")[-1],
        "bytes": bytes_read,
        "flame_us": event_us(lambda: column_sum(x), 50),
        "torch_us": event_us(lambda: g.float().sum(0) if dtype != torch.float32 else g.sum(0), 50),
        "floor_us": copy_us / 2,  # a copy reads and writes: half of it reads
    }  # fmt: skip
    got = torch.from_dlpack(column_sum(x))
    found["max_rel_err"] = float(
        (got - g.float().sum(0)).abs().max() / g.float().abs().sum(0).max()
    )
    return found


def main() -> None:
    rows = []
    for case in CASES:
        found = measure(*case)
        rows.append(found)
        print(
            f"{found['dtype']:9s} [{found['rows']}, {found['columns']}] "
            f"flame {found['flame_us']:7.1f} us torch {found['torch_us']:7.1f} us "
            f"floor {found['floor_us']:6.1f} us ({found['floor_us'] / found['flame_us']:.0%}) "
            f"err {found['max_rel_err']:.1e}",
            flush=True,
        )
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as file:
            json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main()
