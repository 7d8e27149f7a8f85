"""GroupNorm + SiLU (bench.diffusion_kernels' groupnorm rows) timed for FLAME and PyTorch
eager (torch.compile with ``TC=1``) in this process's formulation: run it once per setting of
a switch to compare formulations on the same machine. One JSON line per row.

    python notes/probes/groupnorm_variants.py [nhwc|nchw|both] [bfloat16|float32]

Session 24 ran it under a temporary switch ``GNX`` in flame/nn/functional.py's group_norm
(not kept): 1 the shipped formulation for channels-innermost input, 0 the NCHW formulation
([N, G, C/G, S], copied by simplify onto rows read across memory), 2 the per-channel column
sums of flame/nn/group_norm_layouts.py (notes/performance-session24.md).
"""

import json
import os
import sys

from bench import diffusion_kernels as dk
from bench.side_by_side import run_systems


def main() -> None:
    layouts = {"nhwc": (True,), "nchw": (False,), "both": (False, True)}[sys.argv[1]]
    dtype = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
    timing = dk.Timing(3, 10, 9)
    bandwidth = dk.guarded(dk.copy_bandwidth, True, False, 20)
    size = 4 if dtype == "float32" else 2
    for case in dk.GROUPNORM:
        elements = case[0] * case[1] * case[2] * case[3]
        for channels_last in layouts:
            for backward in (False, True):
                systems, _ = dk.groupnorm_systems(case, dtype, channels_last, backward, "cuda")
                if os.environ.get("TC") != "1":
                    systems.pop("torch_compile", None)
                names = ("y", "grad_x", "grad_w", "grad_b") if backward else ("y",)
                results = run_systems(systems, timing, names, "cuda")
                floor = (5 if backward else 2) * (elements + case[1]) * size
                row = {"case": "x".join(map(str, case)), "layout": "NHWC" if channels_last
                       else "NCHW", "mode": "fwd+bwd" if backward else "fwd"}  # fmt: skip
                for key, entry in results.items():
                    row[key] = entry.get("ms")
                    check = entry.get("check")
                    if check:
                        row[key + "_agrees"] = check["agrees"]
                ms = row.get("flame")
                if ms and bandwidth.get("status") == "ok":
                    row["flame_pct_floor"] = round(
                        100 * floor / (ms * 1e-3) / (bandwidth["gb_per_s"] * 1e9), 1
                    )  # fmt: skip
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
