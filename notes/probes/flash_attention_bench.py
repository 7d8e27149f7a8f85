"""FLAME's fused attention kernels vs torch.nn.functional.scaled_dot_product_attention on the
GPU: forward, and forward + backward, bfloat16, head dims 64 and 128, L = 256 .. 16384, causal
and not, B * H * L = 2^16 rows. CUDA events around each call, warm-up first, the median of
REPEATS. Checks the largest difference from torch once per configuration.

    python3 notes/probes/flash_attention_bench.py OUT.json [--tiles SPEC ...] [--dims 64,128]
        [--lengths 256,1024,4096,16384]

Prints a table (milliseconds, TFLOP/s, FLAME's speed as a fraction of torch's) and writes every
row to OUT.json. Each ``--tiles`` SPEC (``default``, or a FLAME_FLASH_TILES value such as
``fwd=4x2x32,bwd=8x64``; see flame/runtime/flash_attention.py ``tiles``) times FLAME once more
with that tile configuration, torch once: A/B of tile shapes in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's flame

import cupy  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flame.runtime import flash_attention as fa  # noqa: E402

ROWS = 2**16  # B * H * L
WARMUP = 5
REPEATS = 25


def to_cupy(tensor):
    return cupy.from_dlpack(tensor.detach().contiguous().view(torch.int16)).view(cupy.uint16)


def to_torch(array):
    return torch.from_dlpack(array.view(cupy.int16)).view(torch.bfloat16)


def median_ms(function) -> float:
    for _ in range(WARMUP):
        function()
    times = []
    for _ in range(REPEATS):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_config(head_dim: int, length: int, causal: bool, tiles: str, torch_ms: dict) -> dict:
    heads_total = max(1, ROWS // length)
    heads = min(16, heads_total)
    batch = heads_total // heads
    shape = (batch, heads, length, head_dim)
    scale = head_dim**-0.5
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
        for _ in range(4)
    )
    qc, kc, vc, doc = (to_cupy(t) for t in (q, k, v, do))
    row = {
        "head_dim": head_dim,
        "L": length,
        "causal": causal,
        "B": batch,
        "H": heads,
        "tiles": tiles,
    }
    if tiles == "default":
        os.environ.pop(fa.TILES_VARIABLE, None)
    else:
        os.environ[fa.TILES_VARIABLE] = tiles
    row["tile_config"] = [list(part) for part in fa.tiles(head_dim, head_dim)]

    def flame_forward():
        return fa.forward(qc, kc, vc, scale=scale, causal=causal, dtype="bfloat16")

    def flame_both():
        o, lse = flame_forward()
        return o, lse, fa.backward(qc, kc, vc, o, doc, lse, scale=scale, causal=causal,
                                   dtype="bfloat16")  # fmt: skip

    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

    def torch_forward():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    def torch_both():
        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, scale=scale)
        o.backward(do)
        return o

    # correctness once: largest absolute difference from torch
    o, _, (dq, dk, dv) = flame_both()
    qg.grad = kg.grad = vg.grad = None
    reference = torch_both()
    errors = {}
    for name, mine, theirs in (("o", o, reference), ("dq", dq, qg.grad), ("dk", dk, kg.grad),
                               ("dv", dv, vg.grad)):  # fmt: skip
        difference = (to_torch(mine).float() - theirs.float()).abs().max().item()
        errors[name] = difference / max(theirs.float().abs().max().item(), 1e-6)
    row["max_rel_error"] = errors

    flops = 4 * batch * heads * length * length * head_dim * (0.5 if causal else 1.0)
    key = (head_dim, length, causal)
    if key not in torch_ms:  # torch once per configuration, whatever the tiles
        torch_ms[key] = (median_ms(torch_forward), median_ms(torch_both))
    timings = {
        "flame_fwd_ms": median_ms(flame_forward),
        "torch_fwd_ms": torch_ms[key][0],
        "flame_fwdbwd_ms": median_ms(flame_both),
        "torch_fwdbwd_ms": torch_ms[key][1],
    }
    row.update(timings)
    row["flame_fwd_tflops"] = flops / timings["flame_fwd_ms"] / 1e9
    row["torch_fwd_tflops"] = flops / timings["torch_fwd_ms"] / 1e9
    row["flame_fwdbwd_tflops"] = 3.5 * flops / timings["flame_fwdbwd_ms"] / 1e9
    row["torch_fwdbwd_tflops"] = 3.5 * flops / timings["torch_fwdbwd_ms"] / 1e9
    row["fwd_ratio"] = timings["torch_fwd_ms"] / timings["flame_fwd_ms"]
    row["fwdbwd_ratio"] = timings["torch_fwdbwd_ms"] / timings["flame_fwdbwd_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default="flash_attention_bench.json")
    parser.add_argument("--tiles", nargs="+", default=["default"])
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--lengths", default="256,1024,4096,16384")
    args = parser.parse_args()
    dims = [int(x) for x in args.dims.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    rows, torch_ms = [], {}
    header = f"{'D':>4} {'L':>6} {'causal':>6} {'BxH':>7}  {'fwd ms':>15} {'TF/s':>11} "
    header += f"{'ratio':>5}  {'fwd+bwd ms':>15} {'TF/s':>11} {'ratio':>5}  max rel err  tiles"
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("ms and TF/s: FLAME/torch; ratio: torch time / FLAME time (>= 0.5 is the goal)")
    print(header)
    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        for head_dim in dims:
            for length in lengths:
                for causal in (False, True):
                    for tiles in args.tiles:
                        try:
                            row = run_config(head_dim, length, causal, tiles, torch_ms)
                        except Exception as error:  # report, go on with the next one
                            traceback.print_exc()
                            rows.append({"head_dim": head_dim, "L": length, "causal": causal,
                                         "tiles": tiles,
                                         "error": f"{type(error).__name__}: {error}"})  # fmt: skip
                            continue
                        rows.append(row)
                        errors = " ".join(f"{k}={v:.1e}" for k, v in row["max_rel_error"].items())
                        print(
                            f"{head_dim:>4} {length:>6} {causal!s:>6} {row['B'] * row['H']:>7}  "
                            f"{row['flame_fwd_ms']:>7.3f}/{row['torch_fwd_ms']:<7.3f} "
                            f"{row['flame_fwd_tflops']:>5.0f}/{row['torch_fwd_tflops']:<5.0f} "
                            f"{row['fwd_ratio']:>5.2f}  "
                            f"{row['flame_fwdbwd_ms']:>7.3f}/{row['torch_fwdbwd_ms']:<7.3f} "
                            f"{row['flame_fwdbwd_tflops']:>5.0f}/"
                            f"{row['torch_fwdbwd_tflops']:<5.0f} "
                            f"{row['fwdbwd_ratio']:>5.2f}  {errors}  {tiles}",
                            flush=True,
                        )
    with open(args.out, "w") as file:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, file, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
